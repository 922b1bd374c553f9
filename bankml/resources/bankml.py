"""`GET /bankml`, `/bankml/key`, `/bankml/usage`, `/bankml/metrics`: what bankml verified, the
key its receipts are signed with, what it costs, and the engine's per-completion records.

- `/bankml`: the mode's description (P0's `Gateway` or native's `NativeEngine`: what was
  verified, when, the engine and its state, bankml's version), and `receipt_keyid`: the id of
  the key that signs the receipts (null when none does).
- `/bankml/key`: `{"alg": "ed25519", "keyid": "<hex>", "public_key": "<PEM>"}`, what
  `bankml check-receipt --key` takes (404 when no key signs the receipts).
- `/bankml/usage`: one shared `UsageSampler` sample (at most once a second, see usage.py).
- `/bankml/metrics`: the metrics ring. In P0 the tokens come from llama-server, which bankml
  does not measure, so the ring is empty: `{"source", "measured": false, "kept": 0, "keep": 256,
  ..., "records": []}`; natively it is the engine's per-completion records, `"measured": true`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from twisted.web.server import NOT_DONE_YET, Request

from bankml.receipts.keyring import published
from bankml.receipts.keys import SigningKey
from bankml.serving.routes import NotFound
from bankml.serving.writers import JsonResource, write_error, write_json
from bankml.usage import UsageSampler

METRICS_KEEP = 256


P0_METRICS_SOURCE = "bankml P0: llama-server's completions are not measured"


def empty_metrics(source: str) -> dict[str, Any]:
    """The metrics document with no records."""
    return {
        "source": source,
        "measured": False,
        "kept": 0,
        "keep": METRICS_KEEP,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "energy_j": None,
        "joules_per_token": None,
        "records": [],
    }


def _json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, indent=1).encode("utf-8")


class UsageResource(JsonResource):
    isLeaf = True

    def __init__(self, sampler: UsageSampler) -> None:
        super().__init__()
        self.sampler = sampler

    def render_GET(self, request: Request) -> Any:
        d = self.sampler.sample()
        d.addCallback(lambda sample: write_json(request, 200, _json(sample)))
        d.addErrback(
            lambda f: write_error(request, 500, f"usage sample failed: {f.getErrorMessage()}")
        )
        return NOT_DONE_YET


class MetricsResource(JsonResource):
    isLeaf = True

    def __init__(self, metrics: Callable[[], dict[str, Any]]) -> None:
        super().__init__()
        self.metrics = metrics

    def render_GET(self, request: Request) -> Any:
        write_json(request, 200, _json(self.metrics()))
        return NOT_DONE_YET


class KeyResource(JsonResource):
    isLeaf = True

    def __init__(self, key: SigningKey) -> None:
        super().__init__()
        self.body = _json(published(key))

    def render_GET(self, request: Request) -> Any:
        write_json(request, 200, self.body)
        return NOT_DONE_YET


class Describes(Protocol):
    """What /bankml shows: P0's Gateway and native's NativeEngine both have it, and the key
    that signs their receipts."""

    receipt_key: SigningKey | None

    def describe(self) -> dict[str, Any]: ...


class BankmlResource(JsonResource):
    """`/bankml` itself, with `usage` and `metrics` below it."""

    def __init__(
        self,
        mode: Describes,
        sampler: UsageSampler,
        metrics: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.mode = mode
        if mode.receipt_key is not None:
            self.putChild(b"key", KeyResource(mode.receipt_key))
        self.putChild(b"usage", UsageResource(sampler))
        self.putChild(
            b"metrics",
            MetricsResource(metrics or (lambda: empty_metrics(P0_METRICS_SOURCE))),
        )

    def getChild(self, path: bytes, request: Request) -> Any:
        return NotFound()

    def render_GET(self, request: Request) -> Any:
        key = self.mode.receipt_key
        described = {**self.mode.describe(), "receipt_keyid": key.keyid if key else None}
        write_json(request, 200, _json(described))
        return NOT_DONE_YET
