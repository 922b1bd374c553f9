"""The P0 resource tree: bankml's own endpoints, and llama-server's behind the checks.

```
/bankml, /bankml/usage, /bankml/metrics   resources/bankml.py
/openapi.json                             resources/description.py (the API's description)
/ui, /ui/app.js, /ui/style.css            resources/web.py (the web page)
COMPLETIONS                               CompletionProxy (receipt added)
EMBEDDINGS                                EmbeddingProxy (receipts of the vectors, the ranking added)
FORWARDED, POST /slots/ID                 Forward (passed through)
NO_RECEIPT_YET                            501: answers bankml cannot vouch for yet
anything else                             404 {"error": {"code": 404, "message": "File Not Found", ...}}
```

The tables are the routes llama-server (build 11434, tools/server/server.cpp) registers for a
server started on one model file; llama-server dispatches on method and exact path, so a route
asked with another method is its 404 too (HEAD is GET without the body).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from bankml.p0.gateway import Gateway
from bankml.proxy_resource import CompletionProxy, EmbeddingProxy, Forward
from bankml.receipts.kinds import (
    CHAT,
    LLAMA_COMPLETION,
    LLAMA_EMBEDDING,
    MESSAGES,
    OAI_COMPLETION,
    OAI_EMBEDDINGS,
    RERANK,
    RESPONSES,
)
from bankml.resources.bankml import BankmlResource, Describes
from bankml.resources.description import ApiDescription
from bankml.resources.web import put_web_page
from bankml.serving.routes import Branch, LlamaRoute, not_found
from bankml.serving.writers import JsonResource, write_error
from bankml.usage import UsageSampler

COMPLETIONS: dict[str, str] = {  # POST path -> how its answers are read for the receipt
    "/completion": LLAMA_COMPLETION,
    "/completions": LLAMA_COMPLETION,
    "/infill": LLAMA_COMPLETION,
    "/v1/completions": OAI_COMPLETION,
    "/chat/completions": CHAT,
    "/v1/chat/completions": CHAT,
    "/v1/responses": RESPONSES,
    "/responses": RESPONSES,
    "/v1/messages": MESSAGES,
}

EMBEDDINGS: dict[str, str] = {  # POST path -> its shape (receipts hash each vector, the ranking)
    "/embedding": LLAMA_EMBEDDING,
    "/embeddings": LLAMA_EMBEDDING,
    "/v1/embeddings": OAI_EMBEDDINGS,
    **dict.fromkeys(["/rerank", "/reranking", "/v1/rerank", "/v1/reranking"], RERANK),
}

FORWARDED: dict[str, frozenset[str]] = {  # path -> the methods llama-server answers on it
    **dict.fromkeys(
        ["/health", "/v1/health", "/metrics", "/models", "/v1/models", "/slots"],
        frozenset({"GET"}),
    ),
    **dict.fromkeys(
        ["/props", "/lora-adapters", "/tools", "/cors-proxy"], frozenset({"GET", "POST"})
    ),
    **dict.fromkeys(
        [
            "/tokenize",
            "/detokenize",
            "/apply-template",
            "/chat/completions/input_tokens",
            "/v1/chat/completions/input_tokens",
            "/responses/input_tokens",
            "/v1/responses/input_tokens",
            "/v1/messages/count_tokens",
            "/v1/chat/completions/control",
            "/v1/systemone",
        ],
        frozenset({"POST"}),
    ),
}

# routes whose answers are model text in a shape bankml puts no receipt on yet: refused rather
# than passed through without one
NO_RECEIPT_YET = frozenset(
    {
        "/v1/audio/transcriptions",
        "/audio/transcriptions",
        "/v1/stream",
        "/v1/streams/lookup",
    }
)


class LlamaServerRoutes(JsonResource):
    """Every path outside /bankml: dispatched on method and exact path as llama-server does."""

    isLeaf = True

    def __init__(self, gateway: Gateway) -> None:
        super().__init__()
        self.forward = Forward(gateway)
        self.completions = {
            kind: CompletionProxy(gateway, kind) for kind in set(COMPLETIONS.values())
        }
        self.embeddings = {kind: EmbeddingProxy(gateway, kind) for kind in set(EMBEDDINGS.values())}

    def render(self, request: Request) -> Any:
        path = request.path.decode("utf-8", "replace")
        method = "GET" if request.method == b"HEAD" else request.method.decode("latin-1")
        if path in COMPLETIONS and method == "POST":
            return self.completions[COMPLETIONS[path]].render(request)
        if path in EMBEDDINGS and method == "POST":
            return self.embeddings[EMBEDDINGS[path]].render(request)
        if method in FORWARDED.get(path, ()) or (
            method == "POST" and path.startswith("/slots/") and path.count("/") == 2
        ):
            return self.forward.render(request)
        if path in NO_RECEIPT_YET:
            write_error(
                request,
                501,
                f"bankml does not forward {path}: every answer it passes carries a receipt, "
                "and it builds none for this API yet",
                kind="not_supported_error",
            )
            return NOT_DONE_YET
        not_found(request)
        return NOT_DONE_YET


class P0Root(Branch):
    """/bankml and /openapi.json are bankml's; every other path is llama-server's."""

    def __init__(self, routes: Resource) -> None:
        super().__init__()
        self.routes = routes

    def getChild(self, path: bytes, request: Request) -> Any:
        return self.routes

    def render(self, request: Request) -> Any:
        return self.routes.render(request)


def p0_root(
    gateway: Gateway,
    sampler: UsageSampler,
    *,
    webui: bool = True,
    routes: Resource | None = None,
    described: Describes | None = None,
    metrics: Callable[[], dict[str, Any]] | None = None,
) -> Resource:
    """The listen address's tree; ``webui`` adds the web page at ``/ui`` (resources/web.py);
    ``routes`` answers llama-server's paths (default: ``LlamaServerRoutes`` on ``gateway``);
    ``described`` and ``metrics``: what /bankml and /bankml/metrics show (default: ``gateway``'s
    model; with several models, every model's)."""
    root = P0Root(routes if routes is not None else LlamaServerRoutes(gateway))
    root.putChild(b"bankml", BankmlResource(described or gateway, sampler, metrics))
    root.putChild(b"openapi.json", LlamaRoute(ApiDescription()))
    if webui:
        put_web_page(root)
    return root
