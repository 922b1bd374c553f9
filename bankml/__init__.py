"""bankml: a verifying loopback gateway for local GGUF language models.

``bankml.chat(request)`` and ``bankml.chat_stream(request)`` answer an OpenAI chat request with the
native engine, with the same answer and receipt as ``POST /v1/chat/completions`` (see
``bankml.api``). They are imported lazily so ``import bankml`` stays cheap for the CLI; no module
of the package imports this one (``__version__`` lives in ``bankml.version``), so the lazy import
closes no cycle.
"""

from __future__ import annotations

from typing import Any

from bankml.version import __version__ as __version__


def __getattr__(name: str) -> Any:
    if name in ("chat", "chat_stream"):
        from bankml import api

        return getattr(api, name)
    raise AttributeError(f"module 'bankml' has no attribute {name!r}")
