"""The embedding endpoints' answer to a fault of bankml's own in the computation: a 500 with
the error's message, the traceback in the server's log (a refusal is the caller's and is not
logged). In process, through the resource with a stand-in engine bridge."""

from __future__ import annotations

import io
import json
from typing import Any

from twisted.internet import defer
from twisted.logger import capturedLogs
from twisted.web.test.requesthelper import DummyRequest

from bankml.formats.errors import ApiError
from bankml.resources.embeddings import Embeddings


class Bridge:
    def prepare(self, fn: Any, *args: Any) -> defer.Deferred:
        return defer.maybeDeferred(fn, *args)

    def call(self, fn: Any, *args: Any) -> defer.Deferred:
        return defer.maybeDeferred(fn, *args)


class Native:
    bridge = Bridge()

    def identity_problem(self) -> None:
        return None


class Embedder:
    native = Native()

    def __init__(self, fault: Exception) -> None:
        self.fault = fault

    def parse(self, body: Any, raw: bytes, oai: bool, started: float) -> Any:
        return body

    def compute(self, job: Any) -> Any:
        raise self.fault


def post(fault: Exception) -> tuple[DummyRequest, list[dict[str, Any]]]:
    request = DummyRequest([b"v1", b"embeddings"])
    request.method = b"POST"
    request.content = io.BytesIO(b'{"input": "Hello"}')
    with capturedLogs() as events:
        Embeddings(Embedder(fault), oai=True).render(request)
    assert request.finished
    return request, events


def test_a_fault_in_the_computation_is_a_500_and_logged_with_its_trace() -> None:
    request, events = post(TypeError("can only concatenate tuple"))
    assert request.responseCode == 500
    body = json.loads(b"".join(request.written))
    assert "can only concatenate tuple" in body["error"]["message"]
    failures = [e for e in events if "log_failure" in e]
    assert len(failures) == 1
    assert failures[0]["log_failure"].check(TypeError)


def test_a_refusal_is_answered_and_not_logged() -> None:
    request, events = post(ApiError.of(400, "input is empty"))
    assert request.responseCode == 400
    assert not [e for e in events if "log_failure" in e]
