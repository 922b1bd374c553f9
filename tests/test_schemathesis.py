"""schemathesis, driven by bankml/openapi.json, against a real `bankml serve --native`.

Every described operation gets requests generated from its described parameters and bodies
(derandomized, so every run sends the same cases). Asserted for each: no 5xx but the described
501 and 503, no traceback in a body, a JSON body wherever JSON is described, and the server
healthy with the same greedy answer at the end. Token limits are capped at a few tokens so a
case costs a short prefill, not a long answer; tests/test_fuzz.py sends the hostile values of
those fields. The number of cases run is printed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from bankml.openapi import load_description
from tests.native_server import NativeProcess, native_process

DESCRIPTION = Path(__file__).parent.parent / "bankml" / "openapi.json"
schema = schemathesis.openapi.from_path(str(DESCRIPTION))
TOKEN_LIMITS = ("n_predict", "max_tokens", "max_completion_tokens")
MAX_TOKENS = 3
CASES_PER_OPERATION = 3
GREEDY = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
SENT: list[tuple[str, str, int]] = []


@pytest.fixture(scope="module")
def server(
    default_model: Path, default_fork: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NativeProcess]:
    with native_process(default_model, default_fork, tmp_path_factory.mktemp("st")) as proc:
        status, first, _ = proc.post(json.dumps(GREEDY).encode())
        assert status == 200
        proc.greedy_before = json.loads(first)["choices"][0]["message"]["content"]  # type: ignore[attr-defined]
        yield proc


def capped(body: Any, path: str) -> Any:
    """The body with every token limit at most MAX_TOKENS (one added where it was absent)."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for name in TOKEN_LIMITS:
        if not _small(out.get(name)):
            out[name] = MAX_TOKENS
    if path.startswith("/api/"):  # Ollama's limit is an option
        options = dict(out["options"]) if isinstance(out.get("options"), dict) else {}
        if not _small(options.get("num_predict")):
            options["num_predict"] = MAX_TOKENS
        out["options"] = options
    return out


def _small(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS


def base_url(server: NativeProcess, path: str) -> str:
    return server.engine_url if path.startswith("/slots") else server.url


@schema.parametrize()
@settings(
    max_examples=CASES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_every_described_operation_answers_within_its_description(
    case: Any, server: NativeProcess
) -> None:
    if case.method.upper() == "POST" and case.body is not None:
        case.body = capped(case.body, case.path)
    response = case.call(base_url=base_url(server, case.path), timeout=120)
    SENT.append((case.method, case.path, response.status_code))
    status = response.status_code
    assert status < 500 or status in (501, 503), (case.method, case.path, status, response.text)
    assert "Traceback" not in response.text
    content_type = response.headers.get("content-type", "")
    if "application/json" in content_type:
        json.loads(response.content)  # the JSON it says it sends


def test_the_server_is_unchanged_after_the_generated_cases(server: NativeProcess) -> None:
    sent = {(method.upper(), path) for method, path, _ in SENT}
    described = {
        (method.upper(), path)
        for path, item in load_description()["paths"].items()
        for method in item
        if method.upper() in ("GET", "POST", "PUT", "DELETE", "HEAD", "PATCH")
    }
    print(f"schemathesis: {len(SENT)} requests, {len(described)} described operations")
    assert described <= sent, described - sent
    assert server.get("/health")[0] == 200
    status, raw, _ = server.post(json.dumps(GREEDY).encode())
    assert status == 200
    assert json.loads(raw)["choices"][0]["message"]["content"] == server.greedy_before  # type: ignore[attr-defined]
