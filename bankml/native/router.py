"""llama-server's router mode over the native engine: ``RouterModels``, what the router routes
ask (bankml/resources/router.py: ``GET /models``, ``POST /models/load``, ``POST /models/unload``,
``GET /models/sse``, ``GET /props``), over an Ollama host's catalog and residency
(native/ollama.py ``OllamaHost``).

``GET /models?reload=1`` reads the models directory and the preset again, as llama-server's
router does on that query: a model added (a file newly pinned included) is listed, unloaded; a
model whose file is gone, no longer pinned, pinned to other bytes, or whose options changed is
unloaded if it was resident and listed as it is now; the others stay resident. A preset that no
longer reads, or gives a model a setting bankml refuses, is answered 400 with the reason and the
router stays as it was (llama-server answers such a reload with an error too). The event
``models_reload`` (model ``*``) goes to ``GET /models/sse`` as llama-server sends it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bankml.formats.errors import error_object
from bankml.formats.llama import props_object
from bankml.formats.ollama import OllamaError
from bankml.formats.openai import model_info
from bankml.serving import llama_flags, router_status
from bankml.serving.presets import PresetError

if TYPE_CHECKING:
    from bankml.native.ollama import OllamaHost
    from bankml.registry.pins import Pin


class RouterModels:
    """What ``bankml llama-server --models-dir DIR`` answers on llama-server's router routes,
    over an Ollama host's catalog and residency (resources/router.py writes it)."""

    def __init__(self, host: OllamaHost, directory: str | None) -> None:
        self.host = host
        self.directory = directory
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        host.router_events = self
        # status.args and status.preset (serving/router_status.py): the router's command line
        # (the drop-in's llama-server flags), the command that serves a model (bankml's own, as
        # llama-server's unified binary renders its subcommand after it), and where a loaded
        # model answers (the router's own port: bankml starts no child)
        self.cli = router_status.cli_options(host.options.get("router-argv") or [])
        self.binary = [sys.executable, "-m", "bankml", "llama-server"]
        given_port = self.cli.get(router_status.BY_ENV["LLAMA_ARG_PORT"])
        self.port = (
            int(given_port) if given_port and given_port.isdigit() else llama_flags.DEFAULT_PORT
        )

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """``GET /models/sse``'s: ``listener`` is called with each event (on the thread that
        loads or unloads); the returned function ends it."""
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener) if listener in self.listeners else None

    def notify(self, name: str, event: str, data: dict[str, Any] | None) -> None:
        """One router event, as llama-server's ``notify_sse``: ``model_status`` (loading),
        ``status_change`` (loaded, with the model's ``info``; unloaded, with ``exit_code``),
        ``models_reload`` (model ``*``, no data)."""
        event_body: dict[str, Any] = {"model": name, "event": event}
        if data is not None:
            event_body["data"] = data
        for listener in list(self.listeners):
            listener(event_body)

    def info(self, name: str, engine: Any, verified: Any) -> dict[str, Any]:
        """A loaded model's ``info`` in a ``status_change`` event (its child's /v1/models
        entry in llama-server: the id its alias)."""
        facts = model_info(self.host.native.facts_of(engine, verified))
        model = self.host.router.models.get(name) if self.host.router is not None else None
        return {
            "id": name,
            "aliases": [name],
            "tags": model.tags if model is not None else [],
            "object": "model",
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "created": int(self.host.clock()),
            "owned_by": "llamacpp",
            "meta": facts["meta"],
        }

    @property
    def bridge(self) -> Any:
        return self.host.bridge

    def listing(self) -> dict[str, Any]:
        """``GET /models``: every model of the router (serving/presets.py: DIR's files and the
        preset's sections) as llama-server's router lists it, sorted by id: ``status.value``
        ``loaded`` or ``unloaded``, ``status.preset`` (its section), a loaded one's ``meta``;
        a model whose file no fork pins listed as failed, with bankml's reason
        (``bankml_refused``)."""
        host = self.host
        created = int(host.clock())
        out = []
        router = host.router
        assert router is not None
        for name in sorted(router.models):
            model = router.models[name]
            pin = host.router_pins.get(name)
            here = host.residency.get(pin.name) if pin is not None else None
            entry = _router_entry(name, created, here is not None, model.source)
            entry["aliases"], entry["tags"] = model.aliases, model.tags
            port = self.port if here is not None else 0  # llama-server's child's: 0 until loaded
            entry["status"]["args"], entry["status"]["preset"] = model.status(
                self.cli, port, self.binary
            )
            if name in host.router_refused:
                entry["status"]["failed"] = True
                entry["status"]["bankml_refused"] = host.router_refused[name]
            elif here is None and name in host.router_failed:  # its last load failed
                entry["status"]["exit_code"] = host.router_failed[name]
                entry["status"]["failed"] = True
            if here is not None:
                entry["meta"] = model_info(host.native.facts_of(here.handle, here.verified))["meta"]
            out.append(entry)
        return {"data": out, "object": "list"}

    def reload(self) -> tuple[int, dict[str, Any]] | None:
        """On the engine thread: ``GET /models?reload=1``'s reload (``OllamaHost.reload_router``);
        the refusal (400 with the reason, nothing changed), or None."""
        try:
            unloaded = self.host.reload_router()
        except PresetError as err:
            return 400, error_object(400, f"reload: {err}", "invalid_request_error")
        for name in unloaded:
            self.host.log(f"reload: unloaded {name} (its source was updated or removed)")
        return None

    def props(self) -> dict[str, Any]:
        """``GET /props`` without ``?model=``: llama-server's router properties (its web page's
        placeholders for a model: ``model_path`` ``none``, no generation settings)."""
        options = self.host.options
        bound = options.get("models-max")
        return {
            "role": "router",
            "max_instances": int(bound) if bound is not None else 4,
            "models_autoload": bool(options.get("autoload", True)),
            "model_alias": "llama-server",
            "model_path": "none",
            "default_generation_settings": {"params": None, "n_ctx": 0},
            "ui_settings": {},
            "build_info": self.host.native.build_info,
            "cors_proxy_enabled": False,
        }

    def model_props(self, name: str, autoload: bool | None) -> tuple[int, dict[str, Any]]:
        """On the engine thread: ``GET /props?model=NAME`` (an id or an alias): that model's
        own ``/props`` (its child's in llama-server: ``model_alias`` its id), loaded first when
        autoload allows (the request's ``?autoload=``, else the server's); refused as
        llama-server's router refuses a request naming a model."""
        refused = self.ready(name, autoload)
        if refused is not None:
            return refused
        out = props_object(self.host.native.props())
        out["model_alias"] = self.host.router_names[name]
        return 200, out

    def check(self, name: str, autoload: bool | None) -> tuple[int, dict[str, Any]] | None:
        """The refusal of a request naming ``name`` (an id or an alias) as llama-server's
        router refuses it before it forwards the request (``router_validate_model``): none
        named, an unknown one, a refused one, one not loaded without autoload; None when it
        may go on."""
        host = self.host
        if not name:
            message = "model name is missing from the request"
            return 400, error_object(400, message, "invalid_request_error")
        routed = host.router_names.get(name)
        if routed is None:
            return 400, error_object(400, f"model '{name}' not found", "invalid_request_error")
        if routed in host.router_refused:
            return 400, error_object(400, host.router_refused[routed], "invalid_request_error")
        pin = host.router_pins[routed]
        if host.residency.get(pin.name) is None and not host._autoload(autoload):
            return 400, error_object(400, "model is not loaded", "invalid_request_error")
        return None

    def engine_view(self, name: str, touch: bool = True) -> Any:
        """On the reactor thread: the engine a route reads for a request naming ``name`` (an
        id or an alias) when nothing is to be loaded or swapped first: the NativeEngine pinned
        to it (``NativeEngine.pinned``), so a run for another model swapped in meanwhile cannot
        change it. A request that marks its model used (``touch``: a POST) gets it when the
        model is the engine's current one (the most recently used: ``touch`` refreshes its
        keep-alive); one that does not (a GET, as llama-server's router's ``proxy_get``) when
        the model is resident and its file unchanged, read without making it current or used.
        None otherwise (the gate makes it ready first, ``ready_view``)."""
        view = self._view(name)
        if view is None:
            return None
        if not touch:
            host = self.host
            here = host.residency.get(host.router_pins[host.router_names[name]].name)
            return view if here is not None and host.residency.unchanged(here) else None
        return view if view.engine is self.host.native.engine else None

    def touch(self, name: str) -> None:
        """On the engine thread, for every POST the gate forwards to a model (llama-server's
        router sets the model's last use in ``proxy_request``, whatever its child answers): a
        resident model (an id or an alias) made the most recently used (and the engine's
        current one) and its keep-alive started again; nothing when it is not resident (a load
        marks it) or its file changed (the request's own answer says so)."""
        host = self.host
        pin = self._pin_of(name)
        if pin is None or host.residency.get(pin.name) is None:
            return
        try:
            host._acquire(pin)
        except OllamaError:
            return
        host.residency.touch(pin.name, host.keep_alive, host.clock())

    def _pin_of(self, name: Any) -> Pin | None:
        """The pin of the model ``name`` names (an id or an alias); None: unknown, refused."""
        host = self.host
        routed = host.router_names.get(name) if isinstance(name, str) else None
        return host.router_pins.get(routed) if routed is not None else None

    def ready_view(self, name: str, autoload: bool | None) -> tuple[Any, Any]:
        """On the engine thread: ``ready`` (loaded if need be, made the engine's, marked as
        used), then the model's pinned view: (the refusal or None, the view or None)."""
        refused = self.ready(name, autoload)
        return refused, (self._view(name) if refused is None else None)

    def _view(self, name: str) -> Any:
        host = self.host
        pin = self._pin_of(name)
        here = host.residency.get(pin.name) if pin is not None else None
        if here is None or here.handle is None:
            return None
        return host.native.pinned(here.handle, here.verified)

    def ready(self, name: str, autoload: bool | None) -> tuple[int, dict[str, Any]] | None:
        """On the engine thread: ``check``, then the model made the engine's (loaded first,
        verified again, when it is not resident), as llama-server's router makes the model's
        child ready before it forwards a request; the refusal, or None."""
        refused = self.check(name, autoload)
        if refused is not None:
            return refused
        host = self.host
        pin = host.router_pins[host.router_names[name]]
        try:
            host._acquire(pin)
        except OllamaError as err:
            return err.status, error_object(err.status, err.message)
        host.residency.touch(pin.name, host.keep_alive, host.clock())
        return None

    def removable(self, name: str) -> tuple[int, dict[str, Any]]:
        """``DELETE /models?model=NAME`` (an id, as llama-server looks it up): llama-server
        removes only a model of its download cache, bankml has none; its messages, a 400 (not
        removable) or a 404 (no such model) where llama-server answers 500."""
        router = self.host.router
        if router is None or name not in router.models:
            return 404, error_object(404, f"model name={name} is not found", "not_found_error")
        message = f"model name={name} is not removable (not from cache)"
        return 400, error_object(400, message, "invalid_request_error")

    def _named(self, body: Any) -> str | None:
        """The model id a body names (by its id or an alias), None when none."""
        name = body.get("model") if isinstance(body, dict) else None
        return self.host.router_names.get(name) if isinstance(name, str) else None

    def load(self, body: Any) -> tuple[int, dict[str, Any]]:
        """On the engine thread: ``POST /models/load``; (status, body)."""
        name = self._named(body)
        if name is None:
            return 404, error_object(404, "model is not found", "not_found_error")
        if name in self.host.router_refused:
            return 400, error_object(400, self.host.router_refused[name], "invalid_request_error")
        pin = self.host.router_pins[name]
        if self.host.residency.get(pin.name) is not None:
            return 400, error_object(400, "model is already running", "invalid_request_error")
        refused = self.no_room_now(body)
        if refused is not None:
            return refused
        try:
            self.host._acquire(pin)
        except OllamaError as err:
            return err.status, error_object(err.status, err.message)
        self.host.residency.touch(pin.name, self.host.keep_alive, self.host.clock())
        return 200, {"success": True}

    def no_room_now(self, body: Any) -> tuple[int, dict[str, Any]] | None:
        """``POST /models/load``'s refusal while every model it could replace is answering
        (the bound reached, none idle): llama-server's router refuses such a load at once with
        its 500 (a request naming the model waits for the room instead). Asked on the reactor
        thread before the load is queued (with one slot the job would wait behind the running
        answer) and again as it runs; None: the load may go on."""
        name = self._named(body)
        pin = self.host.router_pins.get(name) if name is not None else None
        if pin is None or self.host.residency.room_now(pin, self.host.need(pin)):
            return None
        return 500, error_object(500, "model limit reached, try again later")

    def load_on_startup(self) -> list[str]:
        """On the engine thread, before the server answers: each ``load-on-startup`` model
        loaded (verified again); the lines that say which could not be. No other model is
        loaded: the router starts with none open (``resident.idle_served``), as llama-server's."""
        router = self.host.router
        startup = router.startup() if router is not None else []
        problems = []
        for name in startup:
            status, body = self.load({"model": name})
            if status not in (200,) and "already running" not in str(body):
                problems.append(f"{name}: not loaded at start: {body['error']['message']}")
        return problems

    def before(self, action: str, name: Any) -> object:
        """On the reactor thread, before an ``unload`` of model ``name`` (an id or an alias) is
        queued on the engine thread: that model's stop-timeout armed when it is generating, or
        starts to before the job runs (``OllamaHost.arm_stop``), so the unload never waits on
        a generation longer. A ``load`` arms nothing: the least recently used model it puts
        away for room is an idle one, as llama-server's router evicts only idle instances.
        The job's token: ``settle`` it once the job has run."""
        token = object()
        pin = self._pin_of(name)
        if pin is not None and action == "unload":
            here = self.host.residency.get(pin.name)
            if here is not None:
                self.host.arm_stop(here, "POST /models/unload", token)
        return token

    def beside_runs(self, action: str, name: Any) -> Callable[[], bool]:
        """When a router job for model ``name`` (an id or an alias) may run beside the runs
        of the scheduler's other slots (``EngineBridge.call_beside_runs``): a request's
        ``load`` once its room can be made from idle models, an ``unload`` once its model is
        idle, ``POST /models/load`` (``load_at_once``: it loads or is refused then) and a
        ``touch`` at once (it reorders the models, no slot is touched); an unknown model at
        once (it is refused)."""
        pin = self._pin_of(name)
        if pin is None or action in ("touch", "load_at_once"):
            return lambda: True
        return self.host.idle_ready(pin) if action == "unload" else self.host.room_ready(pin)

    def settle(self, token: object) -> None:
        """On the reactor thread, once the job ``before`` gave ``token`` to has run."""
        self.host.settle(token)

    def unload(self, body: Any) -> tuple[int, dict[str, Any]]:
        """On the engine thread: ``POST /models/unload``; (status, body)."""
        name = self._named(body)
        pin = self.host.router_pins.get(name) if name is not None else None
        if name is None:
            return 400, error_object(400, "model is not found", "invalid_request_error")
        if pin is None or not self.host.residency.unload(pin.name):
            return 400, error_object(400, "model is not running", "invalid_request_error")
        return 200, {"success": True}


def _router_entry(
    model_id: str, created: int, loaded: bool, source: str = "models_dir"
) -> dict[str, Any]:
    """One model of ``GET /models`` in router mode, in llama-server's key order (``args`` and
    the ``preset`` after it: ``RouterModels.listing``)."""
    return {
        "id": model_id,
        "aliases": [],
        "tags": [],
        "object": "model",
        "owned_by": "llamacpp",
        "created": created,
        "status": {"value": "loaded" if loaded else "unloaded", "args": []},
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "source": source,
        "can_remove": False,
    }
