"""`/bankml/metrics` says whether its records are measured: false in P0 (bankml forwards to
llama-server and keeps no per-completion records), true natively. The web page reads it to say
that its tokens-per-second plot is not available in P0 mode (tests/test_web_page.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from twisted.web.test.requesthelper import DummyRequest

from bankml.resources.bankml import P0_METRICS_SOURCE, BankmlResource, empty_metrics


def get(resource: Any, *path: bytes) -> tuple[int, dict[str, Any]]:
    request = DummyRequest(list(path))
    for segment in path:
        resource = resource.getChildWithDefault(segment, request)
    resource.render(request)
    assert request.finished
    return request.responseCode or 200, json.loads(b"".join(request.written))


def test_p0_metrics_are_not_measured() -> None:
    """P0's /bankml (no metrics callable) answers the empty ring, marked not measured."""
    p0 = BankmlResource(SimpleNamespace(receipt_key=None), sampler=None)  # type: ignore[arg-type]
    status, body = get(p0, b"metrics")
    assert status == 200
    assert body["measured"] is False and body == empty_metrics(P0_METRICS_SOURCE)
    assert (body["source"], body["kept"], body["records"]) == (P0_METRICS_SOURCE, 0, [])


def test_a_measured_ring_is_served_as_it_is() -> None:
    ring = {**empty_metrics("bankml native"), "measured": True, "kept": 1, "records": [{"n": 1}]}
    native = BankmlResource(
        SimpleNamespace(receipt_key=None),
        sampler=None,  # type: ignore[arg-type]
        metrics=lambda: ring,
    )
    assert get(native, b"metrics") == (200, ring)
