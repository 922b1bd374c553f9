"""`bankml serve FILE --fork F --native`: verify, load the engine, then listen on two addresses.

Order of events (nothing listens until the file is verified and the engine is open):

1. ``make_native_service(options)`` runs ``verify`` (guard, then the sha256 pin) before the
   reactor starts; a refusal exits with verify's code, as P0 does (tap.verify_or_exit).
2. When the reactor runs, ``NativeService`` opens the engine on the bridge's engine thread
   (``Engine.open`` and ``Model.warm_up``: seconds, more when Numba compiles), so a slow load
   never stalls the reactor, and the thread that will run every request owns the kernels'
   OpenMP workers (``open_native`` says why that doubles decoding speed).
   A model the engine refuses prints ``refuse: <reason>`` and bankml exits 2.
3. It binds ``--listen`` (bankml's own address: ``/bankml``, the OpenAI endpoints and
   llama-server's) and the engine address ``--upstream`` (llama-server's endpoints, with
   ``/slots``), both through ``listen_loopback``.

``build_native_roots(native)`` gives the two resource trees, for tests and for tap.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Mapping
from typing import Any

from twisted.application import service
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.logger import Logger
from twisted.web.resource import Resource

from bankml.bridge import EngineBridge, NativeEngine

_log = Logger(namespace="bankml.native")

DEFAULT_LISTEN = "127.0.0.1:18093"
DEFAULT_UPSTREAM = "127.0.0.1:18092"
DEFAULT_CTX = 4096
EXIT_REFUSED = 2


NOT_SUPPORTED_PROPS = (
    "This server does not support changing global properties. Start it with `--props`"
)
NOT_SUPPORTED_SLOTS_LIST = "This server does not support slots endpoint. Start it with `--slots`"


class LlamaRoute(Resource):
    """One llama-server route around its endpoint resource.

    llama-server dispatches on method and exact path, so a method the endpoint does not answer,
    or anything after its path, is its 404 ``File Not Found`` rather than HTTP's 405 (a client
    written for llama-server sees the same answer). ``refusals`` holds the methods llama-server
    routes but refuses as started here: ``POST /props`` (no ``--props``) and ``GET /slots`` (no
    ``--slots``: bankml has no slot monitor), each ``(status, message, type)``."""

    def __init__(
        self, endpoint: Resource, refusals: Mapping[str, tuple[int, str, str]] | None = None
    ) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.refusals = dict(refusals or {})
        self.isLeaf = endpoint.isLeaf

    def getChildWithDefault(self, path: bytes, request: Any) -> Resource:
        return LlamaRoute(self.endpoint.getChildWithDefault(path, request))

    def render(self, request: Any) -> Any:
        from twisted.web.server import NOT_DONE_YET

        from bankml.proxy_resource import not_found, write_json
        from bankml.resources.openai import dumps

        method = request.method.decode("latin-1")
        if method in self.refusals:
            status, message, kind = self.refusals[method]
            write_json(
                request,
                status,
                dumps({"error": {"code": status, "message": message, "type": kind}}),
            )
            return NOT_DONE_YET
        if (self.isLeaf and request.postpath) or not self._answers(method):
            not_found(request)
            return NOT_DONE_YET
        return self.endpoint.render(request)

    def _answers(self, method: str) -> bool:
        if hasattr(self.endpoint, f"render_{method}"):
            return True
        return method == "HEAD" and hasattr(
            self.endpoint, "render_GET"
        )  # httplib answers HEAD as GET


def _put_llama_endpoints(root: Resource, native: NativeEngine, slots: bool) -> None:
    """llama-server's endpoints and the OpenAI ones, on one tree, under llama-server's paths
    (its aliases included: /v1/health, /completions, /chat/completions, /models)."""
    from bankml.resources import llama
    from bankml.resources.openai import (
        CHAT,
        LLAMA_COMPLETION,
        OAI_COMPLETION,
        ModelsResource,
        NativeChat,
    )
    from bankml.resources.p0 import Branch

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
        put(parent, b"models", ModelsResource(native))
    put(root, b"props", llama.Props(native), POST=(501, NOT_SUPPORTED_PROPS, "not_supported_error"))
    put(root, b"metrics", llama.Metrics(native))
    put(root, b"tokenize", llama.Tokenize(native))
    put(root, b"detokenize", llama.Detokenize(native))
    put(root, b"apply-template", llama.ApplyTemplate(native))
    for name in (b"completion", b"completions"):  # one prompt or several (llama-server's array)
        put(root, name, llama.Completion(native, LLAMA_COMPLETION))
    put(v1, b"completions", llama.Completion(native, OAI_COMPLETION))
    root_chat = Branch()
    root.putChild(b"chat", root_chat)
    for parent in (chat, root_chat):
        put(parent, b"completions", NativeChat(native, CHAT))
    if slots:
        # POST /slots/{id} only: /slots itself is llama-server's slot monitor (GET), not here
        put(
            root,
            b"slots",
            llama.Slots(native),
            GET=(501, NOT_SUPPORTED_SLOTS_LIST, "not_supported_error"),
            POST=(404, "File Not Found", "not_found_error"),
        )


def build_native_roots(native: NativeEngine, sampler: Any = None) -> tuple[Resource, Resource]:
    """(listen_root, engine_root): bankml's address with /bankml, and the engine address with
    /slots; both answer the OpenAI and llama-server endpoints."""
    from bankml.resources.bankml import BankmlResource
    from bankml.resources.p0 import Branch

    if sampler is None:
        from bankml.usage import UsageSampler

        sampler = UsageSampler(
            native.reactor or _reactor(), lambda: [("bankml serve", os.getpid())]
        )
    listen_root = Branch()
    listen_root.putChild(b"bankml", BankmlResource(native, sampler, native.metrics))  # type: ignore[arg-type]
    _put_llama_endpoints(listen_root, native, slots=False)
    engine_root = Branch()
    _put_llama_endpoints(engine_root, native, slots=True)
    return listen_root, engine_root


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


def open_engine(verified: Any, options: Mapping[str, Any]) -> Any:
    """Open the engine on the verified path and run each kernel once (blocking)."""
    from bankml.engine_cupy.engine import Engine

    engine = Engine.open(
        verified.path,
        n_ctx=int(options.get("ctx") or DEFAULT_CTX),
        device=options.get("device") or "auto",
        cache_type=options.get("cache_type") or os.environ.get("BANKML_CACHE_TYPE"),
        cache_ram=os.environ.get("BANKML_CACHE_RAM"),
    )
    # compile or load the kernels now, not on the first request; say what compiles
    engine.warm_up(report=lambda line: _log.info("{line}", line=line))
    return engine


def open_native(verified: Any, options: Mapping[str, Any], reactor: Any) -> Deferred[NativeEngine]:
    """The engine opened on the bridge's own engine thread, then wrapped for serving.

    Loading there, not on a pool thread, matters for speed: the thread that first runs the
    kernels' parallel loops owns OpenMP's warm worker team, and a decode step run from any other
    thread took twice as long (25-28 against 53-58 tok/s on the default model)."""
    from bankml.engine_cupy import backend

    bridge = EngineBridge(reactor)

    def wrap(engine: Any) -> NativeEngine:
        device = backend.device_name(engine.model.xp) if hasattr(engine.model, "xp") else "cpu"
        return NativeEngine(
            engine,
            bridge,
            verified,
            slot_dir=options.get("slot-dir") or options.get("slot_dir"),
            n_ctx=engine.n_ctx,
            device=device,
            reactor=reactor,
        )

    def failed(reason: Any) -> Any:
        bridge.stop()
        return reason

    return bridge.call(open_engine, verified, options).addCallbacks(wrap, failed)


class NativeService(service.MultiService):
    """Opens the engine when the reactor runs, then listens on both addresses."""

    def __init__(self, options: Mapping[str, Any], verified: Any, reactor: Any = None) -> None:
        super().__init__()
        self.options = dict(options)
        self.verified = verified
        self.reactor = reactor or _reactor()
        self.native: NativeEngine | None = None
        self.ports: list[Any] = []
        self.exit_code = 0
        self.exit_at_interpreter_end = True  # under twistd; serve_command reads exit_code itself
        self.ready: Any = None  # the Deferred of the bring-up, for tests

    def startService(self) -> None:
        super().startService()
        from bankml.tap import stop_on_sighup

        stop_on_sighup(self.reactor)  # SIGHUP stops bankml like SIGTERM, exactly as in P0
        self.ready = self._bring_up()

    @inlineCallbacks
    def _bring_up(self) -> Any:
        from bankml.site import LoopbackSite, listen_loopback

        try:
            self.native = yield open_native(self.verified, self.options, self.reactor)
        except Exception as err:
            name = os.path.basename(self.verified.path)
            self._fatal(f"{name}: bankml's native engine does not play it: {err}")
            return
        if not self.running:
            return
        listen_root, engine_root = build_native_roots(self.native)
        try:
            for address, root in (
                (self.options.get("listen") or DEFAULT_LISTEN, listen_root),
                (self.options.get("upstream") or DEFAULT_UPSTREAM, engine_root),
            ):
                self.ports.append(listen_loopback(LoopbackSite(root), address, self.reactor))
        except Exception as err:
            self._fatal(f"cannot listen: {err}")
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

    def _fatal(self, reason: str, code: int = EXIT_REFUSED) -> None:
        _log.error("refuse: {reason}", reason=reason)
        print(f"refuse: {reason}", file=sys.stderr, flush=True)
        self.exit_code = code
        if self.exit_at_interpreter_end:
            atexit.register(os._exit, code)
        if self.reactor.running:
            self.reactor.stop()

    def stopService(self) -> Any:
        for port in self.ports:
            port.stopListening()
        self.ports = []
        if self.native is not None and self.native.bridge is not None:
            self.native.bridge.stop()
        return super().stopService()

    def port_of(self, index: int) -> int:
        """The bound port of --listen (0) or the engine address (1); for tests that bind port 0."""
        return self.ports[index].getHost().port


def make_native_service(options: Mapping[str, Any]) -> service.IService:
    """What tap's makeService calls for ``--native``: verify now (a refusal exits with verify's
    code before anything listens), then a NativeService. ``options`` keys: file, fork, listen,
    upstream, ctx, device, slot-dir (and optionally cache_type)."""
    from bankml.tap import verify_or_exit

    verified = verify_or_exit(options)  # type: ignore[arg-type]
    _log.info(
        "verified {path}: sha256 {sha} pinned in {fork}",
        path=verified.path,
        sha=verified.sha256,
        fork=verified.fork_path,
    )
    return NativeService(options, verified)
