"""llama-server's router routes (``bankml llama-server --models-dir DIR``): ``GET /models``
(and ``/v1/models``), ``POST /models/load``, ``POST /models/unload``, ``GET /models/sse``,
``GET /props`` (the router's, or ``?model=``'s).

Thin: the listing and the actions are the router's (native/ollama.py ``RouterModels``, read
through the ``Router`` Protocol here); a load or an unload runs on the engine thread, in turn
with the answers, so it never lands in the middle of one.
"""

from __future__ import annotations

from typing import Any, Protocol

from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from bankml.formats.errors import ApiError
from bankml.formats.nlohmann import dumps
from bankml.resources.llama import _write_failure
from bankml.resources.runs import read_json_object
from bankml.serving.writers import JsonResource, gone, write_json


class Router(Protocol):
    """What the router routes ask (native/ollama.py ``RouterModels``)."""

    @property
    def bridge(self) -> Any: ...

    def listing(self) -> dict[str, Any]: ...

    def load(self, body: Any) -> tuple[int, dict[str, Any]]: ...

    def unload(self, body: Any) -> tuple[int, dict[str, Any]]: ...

    def subscribe(self, listener: Any) -> Any: ...

    def props(self) -> dict[str, Any]: ...

    def model_props(self, name: str, autoload: bool | None) -> tuple[int, dict[str, Any]]: ...


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
        write_json(request, 200, dumps(self.router.listing()))
        return NOT_DONE_YET


class RouterListing(RouterModels):
    """``GET /v1/models`` in router mode: the same listing, nothing below it."""

    isLeaf = True


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
        job = self.router.load if self.action == "load" else self.router.unload
        d = self.router.bridge.call(job, body)
        d.addCallback(lambda answer: write_json(request, answer[0], dumps(answer[1])))
        d.addErrback(_write_failure(request))
        return NOT_DONE_YET


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
