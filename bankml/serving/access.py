"""Who may call a server, as llama-server decides it: CORS headers and the API key.

``AccessControl`` wraps a root resource; every request passes it once, before any endpoint
sees it, in llama-server's order (its pre-routing handler):

1. ``Access-Control-Allow-Origin`` is set on every answer: with ``--cors-origins *`` (the
   default) and credentials allowed (the default) it echoes the request's ``Origin`` (empty when
   there is none); with ``localhost`` it echoes an origin whose host is localhost, 127.0.0.1 or
   ::1 and sets nothing for any other; any other value is sent as it is.
2. ``OPTIONS`` (a browser's preflight, which carries no key) is answered at once: 200, an empty
   ``text/html`` body, ``Access-Control-Allow-Credentials``, ``-Methods`` and ``-Headers``.
3. With API keys, every path but ``/health``, ``/v1/health``, ``/`` and the web page's files
   (``/ui``, ``/ui/app.js``, ``/ui/style.css``: no data; the page sends the key it is given)
   needs one of them in ``Authorization`` (an exact ``Bearer `` prefix is dropped) or, when
   that header is absent,
   ``X-Api-Key``; anything else is 401 with llama-server's body. Keys are compared in constant
   time and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request

from bankml.serving.writers import write_json

# llama-server's 401 body, byte for byte (its keys in this order)
INVALID_API_KEY = (
    b'{"error":{"message":"Invalid API Key","type":"authentication_error","code":401}}'
)
PUBLIC_PATHS = frozenset(
    {b"/health", b"/v1/health", b"/", b"/ui", b"/ui/", b"/ui/app.js", b"/ui/style.css"}
)
BEARER = b"Bearer "
LOCALHOST_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class CorsPolicy:
    """llama-server's ``--cors-origins``, ``--cors-methods``, ``--cors-headers`` and
    ``--cors-credentials``, with its defaults."""

    origins: str = "*"
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = "*"
    credentials: bool = True

    def allow_origin(self, origin: bytes | None) -> bytes | None:
        """The Access-Control-Allow-Origin value for a request's Origin (None: no header)."""
        if self.credentials and self.origins == "*":
            return origin or b""
        if self.origins == "localhost":
            return origin if origin and origin_is_localhost(origin) else None
        return self.origins.encode("latin-1")


def origin_is_localhost(origin: bytes) -> bool:
    """An origin whose host is localhost, 127.0.0.1 or ::1, any port (llama-server's test)."""
    try:
        host = urlsplit(origin.decode("latin-1")).hostname
    except ValueError:
        return False
    return host in LOCALHOST_NAMES


def key_matches(given: bytes, keys: Sequence[bytes]) -> bool:
    """Whether ``given`` is one of ``keys``; each compared in constant time, all of them always."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


def presented_key(request: Request) -> bytes:
    """The key a request carries: ``Authorization`` (without an exact ``Bearer `` prefix), or
    ``X-Api-Key`` when Authorization is absent or empty."""
    given = request.getHeader(b"authorization") or request.getHeader(b"x-api-key") or b""
    if isinstance(given, str):
        given = given.encode("latin-1")
    return given[len(BEARER) :] if given.startswith(BEARER) else given


class _Preflight(Resource):
    isLeaf = True

    def __init__(self, cors: CorsPolicy) -> None:
        super().__init__()
        self.cors = cors

    def render(self, request: Request) -> bytes:
        request.setResponseCode(200)
        request.setHeader(
            b"access-control-allow-credentials", b"true" if self.cors.credentials else b"false"
        )
        request.setHeader(b"access-control-allow-methods", self.cors.methods.encode("latin-1"))
        request.setHeader(b"access-control-allow-headers", self.cors.headers.encode("latin-1"))
        request.setHeader(b"content-type", b"text/html")
        request.setHeader(b"content-length", b"0")
        return b""


class _Unauthorized(Resource):
    isLeaf = True

    def render(self, request: Request) -> Any:
        write_json(request, 401, INVALID_API_KEY)
        return NOT_DONE_YET


class AccessControl(Resource):
    """A root resource that applies CORS and the API key (module doc), then hands the request
    to ``root``."""

    def __init__(
        self, root: IResource, api_keys: Sequence[str] = (), cors: CorsPolicy | None = None
    ) -> None:
        super().__init__()
        self.root = root
        self.keys = [k.encode("utf-8") for k in api_keys]
        self.cors = cors or CorsPolicy()

    def _gate(self, request: Request) -> Resource | None:
        origin = self.cors.allow_origin(request.getHeader(b"origin"))
        if origin is not None:
            request.setHeader(b"access-control-allow-origin", origin)
        if request.method == b"OPTIONS":
            return _Preflight(self.cors)
        if self.keys and request.path not in PUBLIC_PATHS:
            if not key_matches(presented_key(request), self.keys):
                return _Unauthorized()
        return None

    def getChildWithDefault(self, path: bytes, request: Request) -> Any:
        refusal = self._gate(request)
        if refusal is not None:
            return refusal
        return self.root.getChildWithDefault(path, request)

    def render(self, request: Request) -> Any:
        refusal = self._gate(request)
        return (refusal or self.root).render(request)
