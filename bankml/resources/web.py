"""bankml's web page: a chat that checks every answer's receipt in the browser.

The page is three static files shipped in the package (``bankml/web``: ``index.html``,
``app.js``, ``style.css``), served as they are:

- ``/ui`` (and ``/ui/``) the page, ``/ui/app.js`` and ``/ui/style.css`` its script and style,
  on both addresses (``put_web_page``);
- natively also ``/`` of the engine address (``WebRoot``), where llama-server serves its own web
  page (``webui=False`` in ``build_native_roots`` leaves ``/`` llama-server's JSON 404 there and
  ``/ui`` unrouted).

Every file goes out with a strict Content-Security-Policy (``default-src 'self'``, no inline
script or style, no frames, no form posts), ``X-Content-Type-Options: nosniff`` and
``Referrer-Policy: no-referrer``; the page fetches nothing but its own address. Another method
than GET (or HEAD) is llama-server's JSON 404, as for every route outside /bankml. With API
keys the page's files need none (serving/access.py ``PUBLIC_PATHS``); the page sends the key
it is given with every request it makes.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

from twisted.web.resource import Resource
from twisted.web.server import Request

from bankml.serving.routes import Branch, LlamaRoute, NotFound

CONTENT_SECURITY_POLICY = (
    b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    b"connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    b"form-action 'none'; frame-ancestors 'none'"
)
FILES: dict[str, bytes] = {  # name in bankml/web -> its Content-Type
    "index.html": b"text/html; charset=utf-8",
    "app.js": b"text/javascript; charset=utf-8",
    "style.css": b"text/css; charset=utf-8",
}


@cache
def page_file(name: str) -> bytes:
    """One of the page's files as the package ships it."""
    return resources.files("bankml").joinpath("web").joinpath(name).read_bytes()


class StaticFile(Resource):
    """One file of the page, with the page's security headers (HEAD: twisted.web drops the
    body)."""

    isLeaf = True

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def render_GET(self, request: Request) -> bytes:
        body = page_file(self.name)
        request.setHeader(b"content-type", FILES[self.name])
        request.setHeader(b"content-security-policy", CONTENT_SECURITY_POLICY)
        request.setHeader(b"x-content-type-options", b"nosniff")
        request.setHeader(b"referrer-policy", b"no-referrer")
        request.setHeader(b"cache-control", b"no-cache")
        return body


class WebPage(Resource):
    """``/ui``: the page itself, with its script and style below it."""

    def __init__(self) -> None:
        super().__init__()
        self.index = StaticFile("index.html")
        self.putChild(b"", self.index)
        self.putChild(b"app.js", StaticFile("app.js"))
        self.putChild(b"style.css", StaticFile("style.css"))

    def getChild(self, path: bytes, request: Request) -> Any:
        return NotFound()

    def render_GET(self, request: Request) -> bytes:
        return self.index.render_GET(request)


def put_web_page(root: Resource) -> None:
    """``/ui``, ``/ui/app.js`` and ``/ui/style.css`` on ``root``."""
    root.putChild(b"ui", LlamaRoute(WebPage()))


class _Page(Resource):
    """``/`` itself: the page on GET (or HEAD), llama-server's JSON 404 on another method."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.index = StaticFile("index.html")

    def render(self, request: Request) -> Any:
        if request.method in (b"GET", b"HEAD") and not request.postpath:
            return self.index.render_GET(request)
        return NotFound().render(request)


class WebRoot(Branch):
    """A root whose own path ``/`` is the page (GET or HEAD; another method there is
    llama-server's JSON 404); its children are routed as a ``Branch``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.page = _Page()
        self.putChild(b"", self.page)  # twisted.web asks a root for "/" as its child b""

    def render(self, request: Request) -> Any:
        return self.page.render(request)
