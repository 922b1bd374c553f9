"""llama-server's router routes (``bankml llama-server --models-dir DIR``): ``GET /models``
(and ``/v1/models``; ``?reload=1`` reads the directory and the preset again), ``POST /models/load``, ``POST /models/unload``, ``GET /models/sse``,
``GET /props`` (the router's, or ``?model=``'s).

Thin: the listing and the actions are the router's (native/router.py ``RouterModels``, read
through the ``Router`` Protocol here); a load or an unload runs on the engine thread, in turn
with the answers, so it never lands in the middle of one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol

from twisted.logger import Logger
from twisted.web.resource import Resource, getChildForRequest
from twisted.web.server import NOT_DONE_YET, Request

from bankml.formats.errors import ApiError, error_body
from bankml.formats.nlohmann import dumps, loads_json
from bankml.resources.llama import _write_failure
from bankml.resources.runs import read_json_object
from bankml.serving.routes import LlamaRoute, NotFound
from bankml.serving.writers import JsonResource, gone, write_json

_log = Logger(namespace="bankml.router")


class Router(Protocol):
    """What the router routes ask (native/router.py ``RouterModels``)."""

    @property
    def bridge(self) -> Any: ...

    def listing(self) -> dict[str, Any]: ...

    def reload(self) -> tuple[int, dict[str, Any]] | None: ...

    def load(self, body: Any) -> tuple[int, dict[str, Any]]: ...

    def no_room_now(self, body: Any) -> tuple[int, dict[str, Any]] | None: ...

    def unload(self, body: Any) -> tuple[int, dict[str, Any]]: ...

    def subscribe(self, listener: Any) -> Any: ...

    def props(self) -> dict[str, Any]: ...

    def model_props(self, name: str, autoload: bool | None) -> tuple[int, dict[str, Any]]: ...

    def check(self, name: str, autoload: bool | None) -> tuple[int, dict[str, Any]] | None: ...

    def before(self, action: str, name: Any) -> object: ...

    def settle(self, token: object) -> None: ...

    def beside_runs(self, action: str, name: Any) -> Callable[[], bool]: ...

    def engine_view(self, name: str, touch: bool = True) -> Any: ...

    def touch(self, name: str) -> None: ...

    def ready_view(
        self, name: str, autoload: bool | None
    ) -> tuple[tuple[int, dict[str, Any]] | None, Any]: ...

    def removable(self, name: str) -> tuple[int, dict[str, Any]]: ...


class RouterModels(JsonResource):
    """``GET /models``: every model of the directory, loaded or not; its children ``load``
    and ``unload``."""

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router
        self.putChild(b"load", RouterAction(router, "load"))
        self.putChild(b"unload", RouterAction(router, "unload"))
        self.putChild(b"sse", RouterEvents(router))

    def render_GET(self, request: Request) -> Any:
        """The listing; ``?reload=`` (any value, as llama-server reads it) reads the directory
        and the preset again first, on the engine thread, after the answers running."""
        if not request.args.get(b"reload", [b""])[-1]:
            write_json(request, 200, dumps(self.router.listing()))
            return NOT_DONE_YET

        def listed(refused: tuple[int, dict[str, Any]] | None) -> None:
            status, body = refused if refused is not None else (200, self.router.listing())
            write_json(request, status, dumps(body))

        d = self.router.bridge.call(self.router.reload)
        d.addCallback(listed)
        d.addErrback(_write_failure(request))
        return NOT_DONE_YET

    def render_POST(self, request: Request) -> Any:
        """``POST /models {"model": NAME}``: llama-server downloads NAME from its hub into its
        cache; bankml downloads nothing (it serves the pinned files it is given): 501."""
        try:
            _, body = read_json_object(request)
        except ApiError as err:
            write_json(request, err.status, err.as_bytes())
            return NOT_DONE_YET
        name = body.get("model")
        if not isinstance(name, str) or not name:
            write_json(request, 400, error_body(400, NAME_REQUIRED))
            return NOT_DONE_YET
        write_json(request, 501, error_body(501, NO_DOWNLOADS, "not_supported_error"))
        return NOT_DONE_YET

    def render_DELETE(self, request: Request) -> Any:
        """``DELETE /models?model=NAME``: llama-server removes a model of its download cache;
        bankml's models are the directory's and the preset's, none removable."""
        name = request.args.get(b"model", [b""])[-1].decode("utf-8", "replace")
        if not name:
            write_json(request, 400, error_body(400, NAME_REQUIRED))
            return NOT_DONE_YET
        status, answer = self.router.removable(name)
        write_json(request, status, dumps(answer))
        return NOT_DONE_YET


NAME_REQUIRED = "model must be a non-empty string"
NO_DOWNLOADS = (
    "bankml downloads no model: put the GGUF file and its pin (FILE.FORK.json) in --models-dir,"
    " or name it in a --models-preset section"
)


class RouterListing(RouterModels):
    """``GET /v1/models`` in router mode: the same listing, nothing below it (no POST or
    DELETE: llama-server has them at ``/models`` only)."""

    isLeaf = True

    def render_POST(self, request: Request) -> Any:
        return NotFound().render(request)

    def render_DELETE(self, request: Request) -> Any:
        return NotFound().render(request)


class RouterProps(JsonResource):
    """``GET /props`` in router mode: the router's properties; ``?model=NAME`` that model's own
    (``?autoload=`` as on the answer routes)."""

    isLeaf = True

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router

    def render_GET(self, request: Request) -> Any:
        name = request.args.get(b"model", [b""])[-1].decode("utf-8", "replace")
        if not name:
            write_json(request, 200, dumps(self.router.props()))
            return NOT_DONE_YET
        asked = request.args.get(b"autoload")
        autoload = None if not asked else asked[-1] in (b"true", b"1")
        d = self.router.bridge.call(self.router.model_props, name, autoload)
        d.addCallback(lambda answer: write_json(request, answer[0], dumps(answer[1])))
        d.addErrback(_write_failure(request))
        return NOT_DONE_YET


class RouterAction(JsonResource):
    """``POST /models/load`` or ``/models/unload`` with ``{"model": NAME}``."""

    isLeaf = True

    def __init__(self, router: Router, action: str) -> None:
        super().__init__()
        self.router = router
        self.action = action

    def render_POST(self, request: Request) -> Any:
        try:
            _, body = read_json_object(request)
        except ApiError as err:
            write_json(request, err.status, err.as_bytes())
            return NOT_DONE_YET
        refused = self.router.no_room_now(body) if self.action == "load" else None
        if refused is not None:
            write_json(request, refused[0], dumps(refused[1]))
            return NOT_DONE_YET
        job = self.router.load if self.action == "load" else self.router.unload
        # an unload: the model gets its stop-timeout, should it be generating; a load runs at
        # once, between two steps of the other models' runs, and loads or is refused then
        name = body.get("model") if isinstance(body, dict) else None
        action = "load_at_once" if self.action == "load" else self.action
        d = _router_job(self.router, action, name, job, body)
        d.addCallback(lambda answer: write_json(request, answer[0], dumps(answer[1])))
        d.addErrback(_write_failure(request))
        return NOT_DONE_YET


def _router_job(router: Router, action: str, name: Any, job: Any, *args: Any) -> Any:
    """A ``load`` or ``unload`` of model ``name`` queued on the engine thread (reactor thread):
    the stop-timeout of the model it unloads armed first (``before``), run beside the other
    slots' runs once it may (``beside_runs``), its token settled once it has run; its
    Deferred."""
    token = router.before(action, name)
    d = router.bridge.call_beside_runs(router.beside_runs(action, name), job, *args)
    d.addBoth(_settled, router, token)
    return d


def _settled(result: Any, router: Router, token: object) -> Any:
    """A router job's Deferred passed on, its ``before`` token settled (reactor thread)."""
    router.settle(token)
    return result


class RouterEvents(Resource):
    """``GET /models/sse``: llama-server's stream of the router's events, one ``data:`` line
    each (``{"model", "event", "data"}``), until the client leaves."""

    isLeaf = True

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router

    def render_GET(self, request: Request) -> Any:
        from twisted.internet import reactor

        request.setResponseCode(200)
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"x-accel-buffering", b"no")
        request.write(b"")  # the head goes now: the client sees the stream open

        def write(event: dict[str, Any]) -> None:
            if not gone(request):
                request.write(b"data: " + dumps(event) + b"\n\n")

        def listener(event: dict[str, Any]) -> None:  # on the engine thread
            reactor.callFromThread(write, event)  # type: ignore[attr-defined]

        unsubscribe = self.router.subscribe(listener)
        request.notifyFinish().addBoth(lambda _: unsubscribe())
        return NOT_DONE_YET


# llama-server's router forwards these routes to the child of the model the request names (the
# body's "model" for a POST, ``?model=`` for a GET), refusing one that names none
# (server.cpp's proxy_post, proxy_get). SELF_ROUTED: bankml's answer chooses the model it names
# itself (NativeEngine.select, with the same refusals); the others read the engine, which
# RouterGate makes the named model's first.
SELF_ROUTED = frozenset(
    (b"POST", path)
    for path in (
        b"/completion",
        b"/completions",
        b"/v1/completions",
        b"/chat/completions",
        b"/v1/chat/completions",
        b"/responses",
        b"/v1/responses",
        b"/v1/messages",
        b"/infill",
        b"/embedding",
        b"/embeddings",
        b"/v1/embeddings",
        b"/rerank",
        b"/reranking",
        b"/v1/rerank",
        b"/v1/reranking",
    )
)
ENGINE_ROUTED = frozenset(
    [
        *(
            (b"POST", path)
            for path in (
                b"/props",
                b"/tokenize",
                b"/detokenize",
                b"/apply-template",
                b"/lora-adapters",
                b"/v1/chat/completions/control",
                b"/v1/audio/transcriptions",
                b"/audio/transcriptions",
                b"/v1/messages/count_tokens",
                b"/v1/systemone",
                b"/chat/completions/input_tokens",
                b"/v1/chat/completions/input_tokens",
                b"/responses/input_tokens",
                b"/v1/responses/input_tokens",
            )
        ),
        *((b"GET", path) for path in (b"/metrics", b"/lora-adapters", b"/slots")),
    ]
)


def routed_name(request: Request) -> str | None:
    """The model a request on a forwarded route names ("" when none, as llama-server reads a
    missing, empty or non-string one); None for a POST body that is not JSON (the route's own
    answer refuses it)."""
    if request.method != b"POST":
        return request.args.get(b"model", [b""])[-1].decode("utf-8", "replace")
    content = request.content
    if content is None:
        return ""
    content.seek(0)
    raw = content.read()
    content.seek(0)
    try:
        body = loads_json(raw)
    except ValueError:
        return None
    name = body.get("model") if isinstance(body, dict) else None
    return name if isinstance(name, str) else ""


def forwarded(request: Request) -> bytes | None:
    """Which kind of forwarded route ``request`` is on: b"self", b"engine", or None."""
    key = (request.method, request.path.rstrip(b"/") or b"/")
    if key in SELF_ROUTED:
        return b"self"
    if key in ENGINE_ROUTED or (key[0] == b"POST" and key[1].startswith(b"/slots/")):
        return b"engine"
    return None


def autoload_of(request: Request) -> bool | None:
    """A request's ``?autoload=`` (true or 1 loads; any other value does not), None when
    absent (the server's --models-autoload), as llama-server's ``is_autoload``."""
    asked = request.args.get(b"autoload")
    return None if not asked else asked[-1] in (b"true", b"1")


class RouterGate(Resource):
    """A root in router mode: a request on a route llama-server's router forwards to a model's
    child is refused as the router refuses it (no model named: 400 ``model name is missing from
    the request``; unknown, refused, not loaded without autoload), and on a route that reads the
    engine the named model is made the engine's before the route answers. Anything else goes
    to ``root`` as it is."""

    def __init__(self, root: Resource, router: Router) -> None:
        super().__init__()
        self.root = root
        self.router = router

    def putChild(self, path: bytes, child: Any) -> None:  # noqa: N802 (twisted's name)
        self.root.putChild(path, child)

    def render(self, request: Request) -> Any:
        return self.root.render(request)

    def getChildWithDefault(self, path: bytes, request: Request) -> Any:  # noqa: N802
        child = self.root.getChildWithDefault(path, request)
        kind = forwarded(request)
        if kind is None:
            return child
        name = routed_name(request)
        if name is None:
            return child
        autoload = autoload_of(request)
        refused = self.router.check(name, autoload)
        if refused is not None:
            return _Answer(*refused)
        post = request.method == b"POST"
        if post:
            # llama-server's router marks a model used by every POST it forwards to it
            # (``proxy_post``: its last use, the least recently used one unloaded first),
            # whatever its child answers; a GET forwarded marks nothing (``proxy_get``)
            touched = self.router.bridge.call_beside_runs(
                self.router.beside_runs("touch", name), self.router.touch, name
            )
            touched.addErrback(lambda f: _log.failure("marking {name} used", f, name=name))
        if kind == b"self":
            return child
        view = self.router.engine_view(name, touch=post)
        if view is not None:  # the route reads that model's engine, whatever comes
            return _Pinned(child, view)
        return _WhenReady(self.router, child, name, autoload)


class _Answer(Resource):
    """A refusal written as it is, whatever lies below."""

    isLeaf = True

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__()
        self.status = status
        self.body = body

    def render(self, request: Request) -> Any:
        write_json(request, self.status, dumps(self.body))
        return NOT_DONE_YET


def with_engine(target: Any, view: Any) -> Any:
    """``target`` (a route's leaf, or the LlamaRoute around it) copied to read ``view`` (the
    engine the gate resolved for this request) in place of the server's current one: the
    copy's jobs, run later on the prepare or engine thread, read that engine alone."""
    if isinstance(target, LlamaRoute):
        out = copy.copy(target)
        out.endpoint = with_engine(target.endpoint, view)
        return out
    if hasattr(target, "native"):
        out = copy.copy(target)
        out.native = view
        return out
    return target


def _render(target: Any, request: Request) -> None:
    out = target.render(request)
    if out is not NOT_DONE_YET and not gone(request):
        request.write(out)
        request.finish()


class _Pinned(Resource):
    """The route below answered with the engine of the model its request names (the
    engine's current one when the request came)."""

    isLeaf = True

    def __init__(self, child: Any, view: Any) -> None:
        super().__init__()
        self.child = child
        self.view = view

    def render(self, request: Request) -> Any:
        target = with_engine(getChildForRequest(self.child, request), self.view)
        _render(target, request)
        return NOT_DONE_YET


class _WhenReady(Resource):
    """The named model made ready (on the engine thread: loaded if need be, made the
    engine's, marked as used), then the route below answers with its engine."""

    isLeaf = True

    def __init__(self, router: Router, child: Any, name: str, autoload: bool | None) -> None:
        super().__init__()
        self.router = router
        self.child = child
        self.name = name
        self.autoload = autoload

    def render(self, request: Request) -> Any:
        d = _router_job(
            self.router, "load", self.name, self.router.ready_view, self.name, self.autoload
        )

        def go_on(answer: tuple[tuple[int, dict[str, Any]] | None, Any]) -> None:
            refused, view = answer
            if refused is not None:
                write_json(request, refused[0], dumps(refused[1]))
                return
            target = getChildForRequest(self.child, request)
            _render(with_engine(target, view) if view is not None else target, request)

        d.addCallback(go_on)
        d.addErrback(_write_failure(request))
        return NOT_DONE_YET
