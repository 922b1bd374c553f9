"""Route branching shared by both modes: ``Branch``, ``NotFound`` and ``LlamaRoute``.

- ``Branch``: a path segment with children only; anything else under it is a JSON 404.
- ``Loading``: every path while the model loads: llama-server's 503 ``Loading model`` (its
  key order: message, type, code), as its server-state middleware answers before it is ready.
- ``LlamaRoute``: one llama-server route around its endpoint resource. llama-server dispatches
  on method and exact path, so a method the endpoint does not answer, or anything after its
  path, is its 404 ``File Not Found`` rather than HTTP's 405 (a client written for llama-server
  sees the same answer). ``refusals`` holds the methods llama-server routes but refuses as
  started here, each ``(status, message, type)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from bankml.serving.writers import JsonResource, write_error, write_json

NOT_FOUND = "File Not Found"


def not_found(request: Request) -> None:
    write_error(request, 404, NOT_FOUND)


class NotFound(JsonResource):
    isLeaf = True

    def render(self, request: Request) -> Any:
        not_found(request)
        return NOT_DONE_YET


LOADING = b'{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'


class Loading(JsonResource):
    """Every method and path, while the model loads (see the module doc)."""

    isLeaf = True

    def getChild(self, path: bytes, request: Request) -> Any:
        return self  # below a wrapper (AccessControl) that looks a child up

    def render(self, request: Request) -> Any:
        write_json(request, 503, LOADING)
        return NOT_DONE_YET


class Branch(JsonResource):
    """A path segment with children only; anything else under it is a JSON 404."""

    def getChild(self, path: bytes, request: Request) -> Any:
        return NotFound()

    def render(self, request: Request) -> Any:
        return NotFound().render(request)


class LlamaRoute(Resource):
    """One llama-server route around its endpoint resource (see the module doc)."""

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
        method = request.method.decode("latin-1")
        if method in self.refusals:
            status, message, kind = self.refusals[method]
            write_error(request, status, message, kind=kind)
            return NOT_DONE_YET
        if (self.isLeaf and request.postpath) or not self._answers(method):
            not_found(request)
            return NOT_DONE_YET
        return self.endpoint.render(request)

    def _answers(self, method: str) -> bool:
        if hasattr(self.endpoint, f"render_{method}"):
            return True
        # twisted.web answers HEAD as GET
        return method == "HEAD" and hasattr(self.endpoint, "render_GET")
