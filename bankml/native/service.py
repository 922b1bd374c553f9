"""`bankml serve FILE --fork F --native`: verify, load the engine, then listen on two addresses.

Order of events (nothing listens until the file is verified and the engine is open):

1. ``make_native_service(options)`` verifies before the reactor starts
   (``serving.startup.verify_before_listening``); a refusal exits with verify's code, as P0 does.
2. When the reactor runs, ``NativeService`` opens the engine on the bridge's engine thread
   (``Engine.open`` and ``Model.warm_up``: seconds, more when Numba compiles), so a slow load
   never stalls the reactor, and the thread that will run every request owns the kernels'
   OpenMP workers (``open_native`` says why that doubles decoding speed). A model the engine
   refuses is ``ServingService.fatal``: ``refuse: <reason>``, exit 2.
3. It binds ``--listen`` (bankml's own address: ``/bankml``, the OpenAI endpoints and
   llama-server's) and the engine address ``--upstream`` (llama-server's endpoints, with
   ``/slots``), both loopback only.

``build_native_roots(native)`` gives the two resource trees, for tests and for the service.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from twisted.internet import task
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.web.resource import Resource

from bankml.native import heap
from bankml.native.bridge import DEFAULT_MAX_QUEUE, EngineBridge
from bankml.native.embed import Embedder, EmbedSettings
from bankml.native.ollama import make_host
from bankml.native.rerank import Reranker
from bankml.native.resident import compile_served, idle_served, open_served
from bankml.native.router import RouterModels
from bankml.resources import llama
from bankml.resources import router as router_routes
from bankml.resources.bankml import (
    BankmlResource,
    KeyResource,
    MetricsResource,
    UsageResource,
)
from bankml.resources.description import ApiDescription
from bankml.resources.embeddings import Embeddings, OllamaEmbed, Rerank
from bankml.resources.ollama import put_ollama_routes
from bankml.resources.openai import ChatCompletions, Completions, Messages, Models, Responses
from bankml.resources.web import WebRoot, put_web_page
from bankml.serving.access import AccessControl, CorsPolicy
from bankml.serving.routes import Branch, LlamaRoute, Loading
from bankml.serving.site import LoopbackSite
from bankml.serving.startup import (
    DEFAULT_LISTEN,
    DEFAULT_UPSTREAM,
    ServingService,
    receipt_key_before_listening,
    receipt_log_before_listening,
    verify_before_listening,
)
from bankml.usage import UsageSampler

if TYPE_CHECKING:
    from bankml.native.ollama import OllamaHost
    from bankml.native.resident import NativeEngine
    from bankml.receipts.keys import SigningKey

_log = Logger(namespace="bankml.native")

NOT_SUPPORTED_PROPS = (
    "This server does not support changing global properties. Start it with `--props`"
)
NOT_SUPPORTED_SLOTS_LIST = "This server does not support slots endpoint. Start it with `--slots`"
NOT_SUPPORTED_METRICS = "This server does not support metrics endpoint. Start it with `--metrics`"


def _put_llama_endpoints(
    root: Resource,
    native: NativeEngine,
    slots: bool,
    metrics: bool,
    slots_list: bool = True,
    embedder: Embedder | None = None,
    reranker: Reranker | None = None,
) -> None:
    """llama-server's endpoints and the OpenAI ones, on one tree, under llama-server's paths
    (its aliases included: /v1/health, /completions, /chat/completions, /models); the
    embedding endpoints answer llama-server's 501 unless ``embedder`` is enabled, the rerank
    ones unless ``reranker`` is."""

    def put(
        parent: Resource, name: bytes, endpoint: Resource, **refusals: tuple[int, str, str]
    ) -> None:
        parent.putChild(name, LlamaRoute(endpoint, refusals))

    v1 = Branch()
    root.putChild(b"v1", v1)
    chat = Branch()
    v1.putChild(b"chat", chat)
    for parent in (root, v1):
        put(parent, b"health", llama.Health(native))
        put(parent, b"models", Models(native))
    put(root, b"props", llama.Props(native), POST=(501, NOT_SUPPORTED_PROPS, "not_supported_error"))
    if metrics:
        put(root, b"metrics", llama.Metrics(native))
    else:  # llama-server without --metrics
        put(
            root,
            b"metrics",
            llama.Metrics(native),
            GET=(501, NOT_SUPPORTED_METRICS, "not_supported_error"),
        )
    put(root, b"openapi.json", ApiDescription())
    put(root, b"tokenize", llama.Tokenize(native))
    put(root, b"detokenize", llama.Detokenize(native))
    put(root, b"apply-template", llama.ApplyTemplate(native))
    for name in (b"completion", b"completions"):  # one prompt or several (llama-server's array)
        put(root, name, llama.Completion(native))
    put(root, b"infill", llama.Infill(native))
    put(v1, b"completions", Completions(native))
    root_chat = Branch()
    root.putChild(b"chat", root_chat)
    for parent in (chat, root_chat):
        put(parent, b"completions", ChatCompletions(native))
    for parent in (root, v1):
        put(parent, b"responses", Responses(native))
    put(v1, b"messages", Messages(native))
    embedder = embedder or Embedder(native, EmbedSettings())
    for name in (b"embedding", b"embeddings"):  # llama-server's own shape
        put(root, name, Embeddings(embedder, oai=False))
    put(v1, b"embeddings", Embeddings(embedder, oai=True))
    rerank = Rerank(reranker or Reranker(native, False))
    for parent in (root, v1):
        for name in (b"rerank", b"reranking"):
            put(parent, name, rerank)
    if slots:
        # GET /slots is the slot monitor, POST /slots/{id} the actions (POST /slots itself: 404)
        refusals = {"POST": (404, "File Not Found", "not_found_error")}
        if not slots_list:  # --no-slots: the monitor is llama-server's 501, the actions stay
            refusals["GET"] = (501, NOT_SUPPORTED_SLOTS_LIST, "not_supported_error")
        put(root, b"slots", llama.Slots(native), **refusals)


def build_native_roots(
    native: NativeEngine,
    sampler: UsageSampler | None = None,
    ollama: OllamaHost | None = None,
    *,
    metrics: bool = True,
    slots_list: bool = True,
    webui: bool = True,
    router: Any = None,
    embedding: Mapping[str, Any] | None = None,
) -> tuple[Resource, Resource]:
    """(listen_root, engine_root): bankml's address with /bankml (and Ollama's routes, given
    ``ollama``), and the engine address with /slots; both answer the OpenAI and llama-server
    endpoints (/metrics only with ``metrics``, else llama-server's 501; ``GET /slots`` unless
    ``slots_list`` is False, --no-slots). The engine address also answers ``GET /bankml/key``
    (with a receipt key), ``GET /bankml/metrics`` and ``GET /bankml/usage`` (the same sampler
    as the listen address's), which its web page reads.

    ``webui`` (llama-server's ``--no-webui`` makes it False): the web page
    (resources/web.py) at ``/`` of the engine address, where llama-server serves its own, and
    at ``/ui`` of both; without it ``/`` is llama-server's JSON 404 and ``/ui`` is not routed."""
    if sampler is None:
        sampler = UsageSampler(
            native.reactor,
            lambda: [("bankml serve", os.getpid())],
            prompt_cache=native.prompt_cache_state,
            models=native.models_state,
        )
    settings = EmbedSettings.of({"embedding": embedding})
    embedder = Embedder(native, settings)
    reranker = Reranker(native, settings.enabled and settings.pooling == "rank")
    listen_root = Branch()
    listen_root.putChild(b"bankml", BankmlResource(native, sampler, native.metrics))
    if ollama is not None:
        put_ollama_routes(listen_root, ollama)
        put_ollama_embed_routes(listen_root, ollama, embedding)
    _put_llama_endpoints(
        listen_root, native, slots=False, metrics=metrics, embedder=embedder, reranker=reranker
    )
    engine_root = WebRoot() if webui else Branch()
    _put_llama_endpoints(
        engine_root,
        native,
        slots=True,
        metrics=metrics,
        slots_list=slots_list,
        embedder=embedder,
        reranker=reranker,
    )
    engine_bankml = Branch()  # what the page on / reads: the key, the records, the usage
    if native.receipt_key is not None:
        engine_bankml.putChild(b"key", KeyResource(native.receipt_key))
    engine_bankml.putChild(b"metrics", MetricsResource(native.metrics))
    engine_bankml.putChild(b"usage", UsageResource(sampler))
    engine_root.putChild(b"bankml", engine_bankml)
    if router is not None:  # llama-server's router mode: its /models routes on both addresses
        for root in (listen_root, engine_root):
            root.putChild(b"models", LlamaRoute(router_routes.RouterModels(router)))
            v1 = root.children[b"v1"]
            v1.putChild(b"models", LlamaRoute(router_routes.RouterListing(router)))
            root.putChild(
                b"props",
                LlamaRoute(
                    router_routes.RouterProps(router),
                    {"POST": (501, NOT_SUPPORTED_PROPS, "not_supported_error")},
                ),
            )
    if webui:
        put_web_page(listen_root)
        put_web_page(engine_root)
    if router is not None:  # the routes llama-server's router forwards to a model's child
        return router_routes.RouterGate(listen_root, router), router_routes.RouterGate(
            engine_root, router
        )
    return listen_root, engine_root


def _open_on_engine_thread(
    verified: Any,
    options: Mapping[str, Any],
    bridge: EngineBridge,
    reactor: Any,
    receipt_key: SigningKey | None,
) -> NativeEngine:
    # Loading here matters: the thread that loads the model starts OpenMP's worker team
    # (Model.load), and only that thread's parallel loops run at full speed.
    return open_served(
        verified,
        options,
        bridge,
        reactor,
        report=lambda line: _log.info("{line}", line=line),
        receipt_key=receipt_key,
    )


def idle_native(
    verified: Any,
    options: Mapping[str, Any],
    reactor: Any,
    bridge: EngineBridge | None = None,
    receipt_key: SigningKey | None = None,
) -> Deferred[NativeEngine]:
    """llama-server's router mode: the NativeEngine with no model open (on the engine thread,
    which imports the engine), as llama-server's router starts with none loaded."""
    return _on_engine_thread(idle_served, verified, options, reactor, bridge, receipt_key)


def _on_engine_thread(
    make: Callable[..., NativeEngine],
    verified: Any,
    options: Mapping[str, Any],
    reactor: Any,
    bridge: EngineBridge | None,
    receipt_key: SigningKey | None,
) -> Deferred[NativeEngine]:
    """``make(verified, options, bridge, reactor, receipt_key)`` on the bridge's engine thread (a
    new bridge unless one is given); the bridge is stopped if it fails."""
    if bridge is None:
        bridge = EngineBridge(reactor)

    def failed(reason: Any) -> Any:
        bridge.stop()
        return reason

    return bridge.call(make, verified, options, bridge, reactor, receipt_key).addErrback(failed)


def open_native(
    verified: Any,
    options: Mapping[str, Any],
    reactor: Any,
    bridge: EngineBridge | None = None,
    receipt_key: SigningKey | None = None,
) -> Deferred[NativeEngine]:
    """The engine opened on the bridge's own engine thread (a new bridge unless one is given),
    then wrapped for serving.

    Loading there, not on a pool thread, matters for speed: the thread that first runs the
    kernels' parallel loops owns OpenMP's warm worker team, and a decode step run from any other
    thread took twice as long (25-28 against 53-58 tok/s on the default model)."""
    return _on_engine_thread(
        _open_on_engine_thread, verified, options, reactor, bridge, receipt_key
    )


class NativeService(ServingService):
    """Opens the engine when the reactor runs, then listens on both addresses."""

    def __init__(
        self,
        options: Mapping[str, Any],
        verified: Any,
        reactor: Any,
        bridge: EngineBridge | None = None,
        compiling: Deferred[Any] | None = None,
        receipt_key: SigningKey | None = None,
    ) -> None:
        super().__init__(reactor)
        self.options = dict(options)
        self.verified = verified
        self.bridge = bridge
        self.compiling = compiling  # the kernels compiling on the bridge while the file hashed
        self.receipt_key = receipt_key  # signs every receipt
        self.native: NativeEngine | None = None
        self.ready: Deferred[None] | None = None  # the bring-up, for tests
        self.reaper: task.LoopingCall | None = None  # Ollama's keep-alive
        self.heap_trimmer: task.LoopingCall | None = None  # free heap pages back (native/heap.py)

    def startService(self) -> None:
        super().startService()
        self.ready = self._bring_up()

    def _addresses(self) -> list[str]:
        out = [
            self.options.get("listen") or DEFAULT_LISTEN,
            self.options.get("upstream") or DEFAULT_UPSTREAM,
        ]
        if self.options.get("ollama-listen"):
            out.append(self.options["ollama-listen"])
        return out

    def _access(self, root: Resource) -> Resource:
        """CORS and the API key, once for each address, before any endpoint."""
        llama_options = self.options.get("llama") or {}
        cors = CorsPolicy(**llama_options["cors"]) if "cors" in llama_options else CorsPolicy()
        return AccessControl(root, llama_options.get("api_keys") or (), cors)

    @inlineCallbacks
    def _bring_up(self) -> Any:
        # listen at once, answering llama-server's 503 "Loading model" until the engine is up
        # (the file is verified already; the kernels may take minutes to compile)
        sites = []
        try:
            for address in self._addresses():
                site = LoopbackSite(self._access(Loading()))
                self.listen(site, address)
                sites.append(site)
        except Exception as err:
            self.fatal(f"cannot listen: {err}")
            return
        try:
            if self.compiling is not None:
                yield self.compiling  # an error here is the open's too: it reports it
            opener = idle_native if self.options.get("router") else open_native
            self.native = yield opener(
                self.verified,
                self.options,
                self.reactor,
                bridge=self.bridge,
                receipt_key=self.receipt_key,
            )
        except Exception as err:
            name = os.path.basename(self.verified.path) if self.verified else "router"
            self.fatal(f"{name}: bankml's native engine does not play it: {err}")
            return
        if not self.running:
            return
        self.native.receipt_log = self.receipt_log
        llama_options = self.options.get("llama") or {}
        ollama = serve_ollama(self, self.native)
        router = (
            RouterModels(ollama, self.options.get("models-dir"))
            if self.options.get("router")
            else None
        )
        if router is not None:  # the preset's load-on-startup models, verified, before answering
            # (nothing else is loaded: the router starts with no model open, as llama-server's)
            problems = yield ollama.bridge.call(router.load_on_startup)
            for line in problems:
                _log.warn("{line}", line=line)
        listen_root, engine_root = build_native_roots(
            self.native,
            ollama=ollama,
            metrics=bool(llama_options.get("metrics")),
            slots_list=llama_options.get("slots_endpoint", True),
            webui=llama_options.get("webui", True),
            router=router,
            embedding=llama_options.get("embedding"),
        )
        roots = [listen_root, engine_root]
        if self.options.get("ollama-listen"):
            roots.append(ollama_root(ollama, llama_options.get("embedding")))
        for site, root in zip(sites, roots):  # the loaded model answers from now on
            site.resource = self._access(root)
        if heap.can_release():
            # off the reactor thread: a trim of a fragmented heap can take tens of milliseconds
            self.heap_trimmer = task.LoopingCall(deferToThread, heap.release_free_heap)
            self.heap_trimmer.clock = self.reactor
            self.heap_trimmer.start(heap.TRIM_INTERVAL_S, now=False)
        if router is not None:
            _log.info(
                "bankml native router on {listen}, engine address {up}, {device}: {n} models, "
                "none loaded but a preset's load-on-startup ones",
                listen=self.options.get("listen"),
                up=self.options.get("upstream"),
                device=self.native.device,
                n=len(router.listing()["data"]),
            )
            return
        v = self.verified
        _log.info(
            "bankml native serving {path} (sha256 {sha}) on {listen}, engine address {up}, "
            "{device}, n_ctx {ctx}",
            path=v.path,
            sha=v.sha256,
            listen=self.options.get("listen"),
            up=self.options.get("upstream"),
            device=self.native.device,
            ctx=self.native.n_ctx,
        )

    def stopService(self) -> Any:
        stopped = super().stopService()  # the ports first: nothing new reaches the engine
        for loop in (self.reaper, self.heap_trimmer):
            if loop is not None and loop.running:
                loop.stop()
        if self.native is not None and self.native.bridge is not None:
            self.native.bridge.stop()
        return stopped


# -- Ollama's API: its host, its reaper, its own address --------------------------------------------


def serve_ollama(svc: NativeService, native: NativeEngine) -> OllamaHost:
    """The Ollama host over ``native``: the catalog (``--registry`` and the startup model), the
    keep-alive, and the reaper, a ``LoopingCall`` every second that queues the unload of an
    expired model behind whatever the engine runs (so it never interrupts a request)."""
    options = svc.options
    host = make_host(native, options, log=lambda line: _log.info("{line}", line=line))
    reaping: list[Deferred[Any]] = []

    def reap() -> None:
        bridge = native.bridge
        if reaping or bridge is None or not host.expired():
            return
        d = bridge.call(host.reap)
        reaping.append(d)
        d.addErrback(lambda f: _log.failure("the keep-alive reaper failed", f))
        d.addBoth(lambda _: reaping.clear())

    reaper = task.LoopingCall(reap)
    reaper.clock = svc.reactor
    reaper.start(1.0, now=False)
    svc.reaper = reaper
    return host


def ollama_root(host: OllamaHost, embedding: Mapping[str, Any] | None = None) -> Resource:
    """``--ollama-listen``'s tree: Ollama's routes only."""
    root = Branch()
    put_ollama_routes(root, host)
    put_ollama_embed_routes(root, host, embedding)
    return root


def put_ollama_embed_routes(
    root: Resource, host: OllamaHost, embedding: Mapping[str, Any] | None
) -> None:
    """Ollama's /api/embed and /api/embeddings under ``root``'s /api (put_ollama_routes'),
    the request's model checked by the host."""
    settings = EmbedSettings.of({"embedding": embedding})
    embedder = Embedder(host.native, settings, check_model=host.embedding_model)
    api = root.children[b"api"]
    api.putChild(b"embed", OllamaEmbed(embedder, legacy=False, host=host))
    api.putChild(b"embeddings", OllamaEmbed(embedder, legacy=True, host=host))


def make_native_service(options: Mapping[str, Any], reactor: Any) -> NativeService:
    """What tap's makeService calls for ``--native``: verify now (a refusal exits with verify's
    code before anything listens), then a NativeService. ``options`` keys: file, fork, listen,
    upstream, ctx, device, slot-dir, receipt-key (and optionally cache_type, cache_ram, and llama:
    what serving.llama_flags.native_settings read from llama-server's flags). The receipt key is
    loaded (or made) first: a key refused is ``refuse: <reason>``, exit 2.

    The kernels compile on the engine thread while this thread hashes the file (they start once
    the header passed the guard): on a first start the hash costs no time of its own. Nothing is
    answered from that model; the service opens the engine again after the pin matched."""
    receipt_key = receipt_key_before_listening(options.get("receipt-key"))
    llama = options.get("llama") or {}
    bridge = EngineBridge(
        reactor,
        n_slots=int(llama.get("n_parallel", 1)),
        max_queue=int(options.get("max-queue") or DEFAULT_MAX_QUEUE),
    )
    compiling: list[Deferred[Any]] = []

    def report(line: str) -> None:
        _log.info("{line}", line=line)

    def start_compiling(path: str) -> None:
        compiling.append(bridge.call(compile_served, path, options, report))

    # llama-server's router mode loads no model at start: nothing compiles now (each model's
    # kernels compile, or load from Numba's cache, as it is loaded)
    hashing = None if options.get("router") else start_compiling
    try:
        # a router with no pinned model has no startup file (llama_flags._router_startup):
        # nothing to verify now, each model is verified as it is loaded
        verified = (
            None
            if options.get("file") is None
            else verify_before_listening(options["file"], options["fork"], while_hashing=hashing)
        )
    except SystemExit:
        bridge.stop(wait=False)  # a refusal does not wait for the compiler
        for outcome in compiling:
            outcome.addErrback(lambda _: None)  # nobody waits for it now
        raise
    served = NativeService(
        options,
        verified,
        reactor,
        bridge=bridge,
        compiling=compiling[0] if compiling else None,
        receipt_key=receipt_key,
    )
    served.receipt_log = receipt_log_before_listening(options.get("receipt-log"))
    return served
