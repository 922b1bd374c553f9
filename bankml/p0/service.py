"""P0's service: the gateway, llama-server (spawned and supervised, or a running one checked) and
the site, brought up in that order after `verify`; `bankml/tap.py` parses the options and picks
this mode or the native one.

`make_p0_service` runs before the reactor (verify, the signing key, the gateway, the site);
`P0Service` then brings the engine up when the reactor runs: `--spawn` launches and supervises
llama-server (bankml/process_protocol.py); `--upstream` waits up to 10 s for `/health` and
requires `/props` `model_path` to be the verified canonical path. Only then does it listen.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import task
from twisted.internet.defer import inlineCallbacks
from twisted.logger import Logger
from twisted.web.server import Site

from bankml.gate.verify import sha256_file
from bankml.llama_server import DEFAULT_STOP_TIMEOUT
from bankml.p0 import gateway as gw
from bankml.p0 import llama_args
from bankml.p0.gateway import Gateway, make_agent
from bankml.p0.models import (
    ModelRoutes,
    SpawnedModels,
    llama_server_need,
    several_models,
    spawned_registry,
)
from bankml.p0.routes import p0_root
from bankml.process_protocol import EngineFailed, EngineProcess
from bankml.registry.residency import models_memory
from bankml.serving.access import AccessControl, CorsPolicy
from bankml.serving.site import LoopbackSite
from bankml.serving.startup import (
    ServingService,
    receipt_key_before_listening,
    receipt_log_before_listening,
    verify_before_listening,
)
from bankml.usage import EngineFinder, UsageSampler
from bankml.version import __version__

_log = Logger(namespace="bankml.serve")

UPSTREAM_WAIT_S = 10.0


class P0Service(ServingService):
    """P0: brings the engine up (spawned or checked upstream), then listens; stops both."""

    def __init__(
        self, options: Any, gateway: Gateway, site: Site, engine: EngineProcess | None
    ) -> None:
        super().__init__(gateway.reactor)
        self.options = options
        self.gateway = gateway
        self.site = site
        self.engine = engine
        if engine is not None:
            engine.setServiceParent(self)

    def startService(self) -> None:
        super().startService()
        self.reactor.callWhenRunning(self._bring_up)

    @inlineCallbacks
    def _bring_up(self) -> Any:
        try:
            if self.engine is not None:
                yield self.engine.start()
            else:
                yield self._check_upstream()
        except EngineFailed as err:
            self.fatal(str(err))
            return
        except Exception as err:  # an engine we cannot reach or read is refused the same way
            self.fatal(f"engine check failed: {err}")
            return
        if not self.running:
            return
        try:
            self.listen(self.site, self.options["listen"])
        except Exception as err:
            self.fatal(f"cannot listen on {self.options['listen']}: {err}")
            return
        v = self.gateway.verified
        _log.info(
            "bankml {ver} serving {path} (sha256 {sha}) on {listen}, engine {up} ({mode})",
            ver=__version__,
            path=v.path,
            sha=v.sha256,
            listen=self.options["listen"],
            up=self.gateway.upstream_text,
            mode=self.gateway.mode,
        )

    @inlineCallbacks
    def _check_upstream(self) -> Any:
        """--upstream: /health within 10 s, then /props model_path must be the verified path."""
        g = self.gateway
        deadline = self.reactor.seconds() + UPSTREAM_WAIT_S
        last = "no answer"
        while True:
            try:
                response = yield g.request(b"GET", "/health", timeout=2)
                yield gw.bounded_collect(response, 1024 * 1024)
                if response.code == 200:
                    break
                last = f"/health answered {response.code}"
            except Exception as err:
                last = str(err) or err.__class__.__name__
            if self.reactor.seconds() > deadline:
                raise EngineFailed(
                    f"upstream {g.upstream_text} not healthy within "
                    f"{UPSTREAM_WAIT_S:.0f} s ({last})"
                )
            yield task.deferLater(self.reactor, 0.1, lambda: None)
        props = yield g.fetch_props()
        problem = g.engine_path_problem(props)
        if problem is not None:
            raise EngineFailed(problem)
        g.set_state(gw.READY, f"upstream {g.upstream_text} serves the verified file")


def make_p0_service(options: Any, reactor: Any) -> P0Service:
    """Verify (before anything listens), then the gateway, the engine and the site.
    ``options`` is `bankml.tap.Options` in a P0 mode (``--spawn`` or ``--upstream``)."""
    receipt_key = receipt_key_before_listening(options["receipt-key"])
    verified = verify_before_listening(options["file"], options["fork"])
    spawned = options["mode"] == "spawn"
    gateway = Gateway(
        verified=verified,
        upstream=options["upstream_addr"],
        mode=options["mode"],
        agent=make_agent(reactor),
        reactor=reactor,
        # the signing key, and the engine's identity in every receipt where bankml knows it
        receipt_key=receipt_key,
        # llama-server's f16, unless the extra arguments name another K cache type
        cache_type=(llama_args.value_of(options["engine_args"], llama_args.CACHE_TYPE_K) or "f16")
        if spawned
        else None,
        engine_digest=sha256_file(options["spawn"], progress=False) if spawned else None,
        receipt_log=receipt_log_before_listening(options["receipt-log"]),
        rpc_workers=tuple(options.get("rpc_workers", ())) if spawned else (),
    )

    def make_engine(on: Gateway) -> EngineProcess:
        return EngineProcess(
            on,
            options["spawn"],
            threads=options["threads"],
            ctx=options["ctx"],
            slot_dir=options["slot-dir"],
            spec_ngram=bool(options["spec-ngram"]),
            extra_args=options["engine_args"],
            restart_delay=options["restart_delay"],
            rpc_workers=on.rpc_workers,
        )

    engine = make_engine(gateway) if options["mode"] == "spawn" else None
    models = None
    if engine is not None and several_models(options):  # one llama-server per resident model
        models = SpawnedModels(
            spawned_registry(options, verified),
            gateway,
            None,
            make_engine,
            max_loaded=int(options["max-loaded"]),
            budget=models_memory(options["models-memory"]),
            need=llama_server_need(options),
            stop_timeout=float(options.get("stop_timeout", DEFAULT_STOP_TIMEOUT)),
        )
        models.adopt_startup(engine)
    if models is not None:  # /bankml/usage: every resident model's llama-server, each model
        sampler = UsageSampler(reactor, models.processes, models=models.models_state)
    else:
        sampler = UsageSampler(reactor, EngineFinder(gateway))
    access = options["llama"]
    routes = ModelRoutes(models) if models is not None else None
    # CORS and the API key before any endpoint, as natively (llama-server's own checks)
    site = LoopbackSite(
        AccessControl(
            p0_root(
                gateway,
                sampler,
                routes=routes,
                described=models,
                metrics=models.metrics if models is not None else None,
            ),
            access["api_keys"],
            CorsPolicy(**access["cors"]),
        )
    )
    served = P0Service(options, gateway, site, engine)
    if models is not None:
        models.parent = served  # each model's llama-server is stopped with the service
    served.receipt_log = gateway.receipt_log  # synced and closed by the service
    return served
