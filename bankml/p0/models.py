"""P0 with several models: one supervised llama-server per resident model, routed by ``model``.

``bankml serve FILE --fork F --spawn BIN --registry DIR --max-loaded N`` (or ``--max-loaded N``
alone, with N > 1): the models are the startup one and every model DIR pins
(bankml/registry/pins.py), and which of them run is `Residency`'s, as natively: at most N
(``--max-loaded``), at most ``--models-memory`` bytes together (default half of the RAM, as
natively: ``registry.residency.models_memory``), each model its file and the KV cache its
llama-server allocates.

A request is routed by the ``model`` of its JSON body (a POST); none, or a request without a
body, goes to the startup model. Then:

- an unknown name: 404 with the names served;
- a model not running: ``Residency.acquire`` stops the least recently used idle one at the bound
  (never one with a request in flight: 503 with Retry-After when every one is busy), verifies the
  file (the guard, then its sha256 against its fork), and this module launches its own
  llama-server (`EngineProcess`, its own `Gateway`) on a free loopback port; the request waits
  for its ``/health`` and ``/props`` and is then forwarded as one to a single model is
  (routes.py `LlamaServerRoutes`, over that model's gateway: its checks, its receipt);
- a running model whose file changed since it was verified: 503, that model stopped, the others
  untouched;
- a llama-server that exits on its own is restarted by its own `EngineProcess` (after verifying
  its file again), the others untouched.

Every receipt is issued by the answering model's gateway, so it names that model's file and
sha256. ``GET /bankml`` describes the startup model's engine. The hash of a model being loaded
runs on the reactor thread (as the startup verify does before anything listens).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Callable
from typing import Any

import psutil
from twisted.application import service
from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.threads import deferToThread
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET, Request

from bankml.formats.llama import per_model_lines
from bankml.gate.verify import Verified, verify
from bankml.llama_server import DEFAULT_STOP_TIMEOUT
from bankml.p0 import gateway as gw
from bankml.p0 import llama_args
from bankml.p0.gateway import Gateway
from bankml.p0.routes import LlamaServerRoutes
from bankml.process_protocol import EngineProcess
from bankml.registry.pins import NotFound, Pin, Registry, discover
from bankml.registry.residency import LoadError, Residency, Resident, llama_server_kv_bytes
from bankml.resources.bankml import P0_METRICS_SOURCE, empty_metrics
from bankml.serving.writers import JsonResource, gone, write_error

_log = Logger(namespace="bankml.models")


def free_loopback_port(host: str) -> int:
    """A port the system has free on ``host`` now (the new llama-server binds it at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Running:
    """One resident model's llama-server: its gateway, its engine, and when it is up."""

    def __init__(self, gateway: Gateway, engine: EngineProcess, up: Deferred[Any]) -> None:
        self.gateway = gateway
        self.engine = engine
        self.routes = LlamaServerRoutes(gateway)
        self.failed: str | None = None  # why the first start failed
        self.ready = False
        self._waiting: list[Deferred[None]] = []
        up.addCallbacks(self._up, self._down)

    def _up(self, _: Any) -> None:
        self.ready = True
        self._fire()

    def _down(self, failure: Failure) -> None:
        self.failed = failure.getErrorMessage() or repr(failure.value)
        self._fire()

    def _fire(self) -> None:
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(None)

    def when_started(self) -> Deferred[None]:
        """Fires once the first start is over (up, or failed: see ``failed``)."""
        if self.ready or self.failed is not None:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._waiting.append(d)
        return d


class SpawnedModels:
    """The models P0 serves with ``--spawn`` and several pins, each run by its own llama-server."""

    def __init__(
        self,
        registry: Registry,
        startup: Gateway,
        parent: service.MultiService | None,
        make_engine: Callable[[Gateway], EngineProcess],
        max_loaded: int,
        budget: int | None,
        need: Callable[[Pin], int] | None = None,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
    ) -> None:
        self.registry = registry
        # --stop-timeout: an unloaded model's llama-server gets this long from SIGTERM to
        # SIGKILL (llama-server's router: a preset's stop-timeout, 10 s by default)
        self.stop_timeout = stop_timeout
        self.startup = startup
        self.receipt_key = startup.receipt_key  # /bankml's receipt_keyid: every model's key
        self.parent = parent
        self.make_engine = make_engine
        self.gateways: dict[str, Gateway] = {}
        self._loading: Pin | None = None  # the pin ``acquire`` is launching
        self.residency = Residency(
            self._launch,
            self._stop,
            # its lines name native's command: here each load is a llama-server's
            lambda line: _log.info("{line}", line=line.replace("bankml serve --native: ", "")),
            max_loaded=max_loaded,
            budget=budget,
            verify_model=self._verified_before,
            need=need or (lambda pin: int(pin.bytes or 0)),
        )
        self.need = self.residency.need
        self._hashed: dict[str, Verified] = {}  # path -> verified off the reactor thread
        self.forwarded: dict[str, int] = {}  # pin name -> requests routed to its llama-server

    def adopt_startup(self, engine: EngineProcess) -> None:
        """The startup model's llama-server (brought up by the service before it listens) is the
        first resident."""
        pin = self.pins_for_llama(self.registry.pins[0])
        engine.stop_grace = self.stop_timeout
        running = Running(self.startup, engine, succeed(None))
        self.gateways[pin.name] = self.startup
        now = self.startup.reactor.seconds()
        self.residency.resident = Resident(
            pin, self.startup.verified, running, loaded_at=now, need=self.need(pin)
        )

    @staticmethod
    def pins_for_llama(pin: Pin) -> Pin:
        """llama-server plays what bankml's forward pass may not: only the file and its pin
        decide (``acquire`` still refuses a file that is not here, verify anything else)."""
        return dataclasses.replace(pin, native_reason=None)

    # -- Residency's hooks ---------------------------------------------------------------------

    def _verified_before(self, path: str, fork: str) -> Verified:
        """The verify ``acquire`` runs: the one just done off the reactor thread for this
        request (``acquire`` still checks the file is the same after it), else done now."""
        done = self._hashed.pop(os.path.realpath(path), None)
        return done if done is not None else verify(path, fork)

    def _launch(self, verified: Verified) -> Running:
        """A verified model's own llama-server, launched on a free loopback port."""
        assert self._loading is not None
        name = self._loading.name
        gateway = self.gateways.get(name)
        host = self.startup.upstream[0]
        if gateway is None:
            gateway = dataclasses.replace(
                self.startup,
                verified=verified,
                upstream=(host, 0),
                state=gw.STARTING,
                state_reason="starting",
                pid=None,
                engine_build=None,
                restarts=0,
                engine_n_ctx=None,
                answered=0,
                prompt_tokens=0,
                completion_tokens=0,
            )
            self.gateways[name] = gateway
        gateway.verified = verified
        gateway.upstream = (host, free_loopback_port(host))
        engine = self.make_engine(gateway)
        engine.name = f"engine {name}"  # the service's children are named uniquely
        engine.stop_grace = self.stop_timeout  # when unloaded, and when bankml stops
        if self.parent is not None:
            engine.setServiceParent(self.parent)
        return Running(gateway, engine, engine.start())

    def _stop(self, resident: Resident, why: str) -> None:
        running: Running = resident.handle
        _log.info("stopping llama-server of {name} ({why})", name=resident.pin.name, why=why)
        if running.engine.parent is not None:
            running.engine.disownServiceParent()  # stops it (SIGTERM, then SIGKILL)
        else:
            running.engine.stop(self.stop_timeout)

    # -- /bankml, /bankml/usage, /bankml/metrics: every model --------------------------------

    def describe(self) -> dict[str, Any]:
        """``GET /bankml``: the startup model's description, and under ``models`` each served
        model's (its own verified file, llama-server and state; ``resident``), by name."""
        models: dict[str, Any] = {}
        for pin in self.registry.pins:
            gateway = self.gateways.get(pin.name)
            here = self.residency.get(pin.name)
            described = gateway.describe() if gateway is not None else {"file": pin.file}
            models[pin.name] = {"resident": here is not None, **described}
        return {**self.startup.describe(), "models": models}

    def models_state(self) -> dict[str, Any]:
        """Each served model's requests (``requests``: every request routed to its
        llama-server, whatever its route; ``completions``: the answers with a completion
        receipt, and their tokens as llama-server reported them), whether it is resident, and
        a resident one's memory: ``need_bytes`` (``--models-memory``'s reckoning),
        ``rss_bytes`` (its llama-server's resident set), ``pid``, ``in_use``, ``loaded_at``."""
        out: dict[str, Any] = {}
        for pin in self.registry.pins:
            gateway = self.gateways.get(pin.name)
            entry: dict[str, Any] = {
                "resident": False,
                "requests": self.forwarded.get(pin.name, 0),
                "completions": gateway.answered if gateway is not None else 0,
                "prompt_tokens": gateway.prompt_tokens if gateway is not None else 0,
                "completion_tokens": gateway.completion_tokens if gateway is not None else 0,
            }
            here = self.residency.get(pin.name)
            if here is not None:
                pid = here.handle.gateway.pid
                entry.update(
                    resident=True,
                    need_bytes=here.need,
                    rss_bytes=_rss_of(pid),
                    pid=pid,
                    in_use=here.in_use,
                    loaded_at=here.loaded_at,
                )
            out[pin.name] = entry
        return out

    def processes(self) -> list[tuple[str, int]]:
        """/bankml/usage's processes: bankml, and each resident model's llama-server."""
        named = [("bankml serve", os.getpid())]
        for name, here in list(self.residency.residents.items()):
            pid = here.handle.gateway.pid
            if pid:
                named.append((f"llama-server {name}", pid))
        return named

    def metrics(self) -> dict[str, Any]:
        """``GET /bankml/metrics``: P0's document (llama-server's completions are not
        measured) with each model's counts and memory (``models``)."""
        return {**empty_metrics(P0_METRICS_SOURCE), "models": self.models_state()}

    @inlineCallbacks
    def _listing(self, request: Request) -> Any:
        """``GET /v1/models`` (and ``/models``): every served model, in the registry's order,
        as llama-server lists its one: a resident model's entries are its llama-server's own
        (``models`` and ``data``), another's its id (the path its llama-server is started
        with) with ``"bankml_resident": false`` and no ``meta``."""
        listed: dict[str, list[Any]] = {"models": [], "data": []}
        now = int(self.startup.reactor.seconds())
        for pin in self.registry.pins:
            here = self.residency.get(pin.name)
            answer = None
            if here is not None and here.handle.ready:
                try:
                    response = yield here.handle.gateway.request(b"GET", "/v1/models", timeout=10)
                    raw = yield gw.bounded_collect(response)
                    answer = json.loads(raw) if response.code == 200 else None
                except Exception:  # listed as not resident below
                    answer = None
            if isinstance(answer, dict):
                listed["models"] += answer.get("models") or []
                listed["data"] += answer.get("data") or []
            elif pin.path is not None:
                listed["data"].append(
                    {
                        "id": pin.path,
                        "object": "model",
                        "created": now,
                        "owned_by": "llamacpp",
                        "bankml_resident": False,
                    }
                )
        if not gone(request):
            body = json.dumps({**listed, "object": "list"}).encode()
            request.setResponseCode(200)
            request.setHeader(b"content-type", b"application/json; charset=utf-8")
            request.setHeader(b"content-length", str(len(body)).encode())
            request.write(body)
            request.finish()

    # -- routing --------------------------------------------------------------------------------

    def render(self, request: Request) -> Any:
        """Route ``request`` to its model's llama-server (started first when it is not running)."""
        if request.method == b"GET" and request.path in (b"/v1/models", b"/models"):
            self._listing(request)
            return NOT_DONE_YET
        content = request.content
        assert content is not None
        body = content.read()
        content.seek(0)
        try:
            pin = self.registry.resolve(requested_model(request.method, body))
        except NotFound as err:
            write_error(request, 404, str(err), kind="not_found_error")
            return NOT_DONE_YET
        pin = self.pins_for_llama(pin)
        if self.residency.get(pin.name) is not None or pin.path is None:
            self._acquire(request, pin)
            return NOT_DONE_YET
        # not running: its file is verified (hashed) on a thread first, so a refused file stops
        # no other model and the reactor goes on answering meanwhile
        hashing = deferToThread(self.residency.verify_pin, pin)
        hashing.addCallbacks(
            lambda verified: self._acquire(request, pin, verified),
            lambda failure: self._refuse(request, failure),
        )
        return NOT_DONE_YET

    def _refuse(self, request: Request, failure: Failure) -> None:
        err = failure.value
        if isinstance(err, LoadError):
            retry = self.startup.retry_after_s if err.busy else None
            write_error(request, err.status, err.message, retry)
        else:
            _log.failure("loading a model failed", failure)
            write_error(request, 500, f"bankml could not load the model: {err}")

    def _acquire(self, request: Request, pin: Pin, verified: Verified | None = None) -> None:
        if gone(request):
            return
        self._loading = pin
        if verified is not None:
            self._hashed[verified.path] = verified
        try:
            acquired = self.residency.acquire(pin, self.startup.reactor.seconds())
        except Exception:  # LoadError: its status; anything else logged, 500
            self._refuse(request, Failure())
            return
        finally:
            self._hashed.clear()
        resident = acquired.resident
        resident.in_use += 1

        def done(_: Any) -> None:
            resident.in_use -= 1

        request.notifyFinish().addBoth(done)
        running: Running = resident.handle
        running.when_started().addCallback(lambda _: self._forward(request, resident))

    def _forward(self, request: Request, resident: Resident) -> None:
        running: Running = resident.handle
        if running.failed is not None:
            if self.residency.get(resident.pin.name) is resident:
                self.residency.drop("its llama-server did not start", resident.pin.name)
            write_error(
                request, 503, f"{resident.pin.name}: llama-server did not start: {running.failed}"
            )
            return
        if gone(request):
            return
        name = resident.pin.name
        self.forwarded[name] = self.forwarded.get(name, 0) + 1
        if request.method == b"GET" and request.path == b"/metrics":
            self._scrape(request, running)
            return
        running.routes.render(request)

    @inlineCallbacks
    def _scrape(self, request: Request, running: Running) -> Any:
        """``GET /metrics``: the series of the llama-server it is routed to (the startup
        model's), then bankml's own, one line per served model (``per_model_lines``: requests
        routed to it, prompt and completion tokens of its completions, resident memory), as the
        native server ends its /metrics. Another status than 200 (llama-server without
        ``--metrics``: 501) is passed as it is."""
        try:
            response = yield running.gateway.request(
                b"GET", request.uri.decode("ascii"), timeout=30
            )
            raw = yield gw.bounded_collect(response)
        except Exception as err:  # its llama-server went away meanwhile
            if not gone(request):
                write_error(request, 502, f"llama-server did not answer /metrics: {err}")
            return
        if gone(request):
            return
        if response.code == 200:
            raw = raw.rstrip(b"\n") + b"\n"
            raw += "".join(f"{line}\n" for line in per_model_lines(self.models_state())).encode()
        request.setResponseCode(response.code)
        for value in response.headers.getRawHeaders(b"content-type", []):
            request.setHeader(b"content-type", value)
        request.setHeader(b"content-length", str(len(raw)).encode())
        request.write(raw)
        request.finish()


def _rss_of(pid: int | None) -> int | None:
    """The resident set of a process, None when it cannot be read."""
    try:
        return int(psutil.Process(pid).memory_info().rss) if pid else None
    except psutil.Error:
        return None


def requested_model(method: bytes, body: bytes) -> str | None:
    """The ``model`` a request's JSON body names (None: none, or not a JSON object)."""
    if method != b"POST" or not body:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    model = doc.get("model") if isinstance(doc, dict) else None
    return model if isinstance(model, str) else None


class ModelRoutes(JsonResource):
    """Every llama-server path, sent to the model its request names (`SpawnedModels`)."""

    isLeaf = True

    def __init__(self, models: SpawnedModels) -> None:
        super().__init__()
        self.models = models

    def render(self, request: Request) -> Any:
        return self.models.render(request)


def several_models(options: Any) -> bool:
    """Whether ``--spawn`` serves several models: ``--registry``, or ``--max-loaded`` above 1."""
    return options["mode"] == "spawn" and (
        bool(options["registry"]) or int(options["max-loaded"]) > 1
    )


def spawned_registry(options: Any, verified: Verified) -> Registry:
    """The startup model first, then every model the ``--registry`` directory pins."""
    return discover(
        options["registry"], [os.path.dirname(verified.path)], (verified.path, options["fork"])
    )


def llama_server_need(options: Any) -> Callable[[Pin], int]:
    """``--models-memory``'s reckoning of a model in P0: its file, and the KV cache its
    llama-server allocates (registry/residency.py ``llama_server_kv_bytes``: bankml's ``--ctx``,
    and ``-ctk``/``-ctv`` after ``--``, f16 without them)."""
    extra = options.get("engine_args") or []
    type_k = llama_args.value_of(extra, llama_args.CACHE_TYPE_K)
    type_v = llama_args.value_of(extra, llama_args.CACHE_TYPE_V)
    ctx = int(options.get("ctx") or 0)

    def need(pin: Pin) -> int:
        kv = llama_server_kv_bytes(pin.path, ctx, type_k, type_v) if pin.path else 0
        return int(pin.bytes or 0) + kv

    return need
