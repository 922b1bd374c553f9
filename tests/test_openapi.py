"""bankml/openapi.json against the OpenAPI 3.1 meta-schema, and against a real
`bankml serve --native`: every route it answers on either address is described, every described
route answers, and real answers (the receipt included) fit the described bodies."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bankml.openapi import ADDRESSES, Route, load_description, routes
from bankml.version import __version__
from tests.native_server import NativeProcess, native_process

# llama-server's routes (build 11434) and Ollama's: the candidates a client may try. Those bankml
# does not serve must be its 404; the described ones are added below.
LLAMA_SERVER_ROUTES = [
    ("GET", "/health"), ("GET", "/v1/health"), ("GET", "/metrics"), ("GET", "/props"),
    ("POST", "/props"), ("GET", "/models"), ("GET", "/v1/models"), ("POST", "/models"),
    ("POST", "/models/load"), ("POST", "/models/unload"), ("GET", "/models/sse"),
    ("POST", "/completion"), ("POST", "/completions"), ("POST", "/v1/completions"),
    ("POST", "/chat/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions/control"), ("POST", "/v1/responses"), ("POST", "/responses"),
    ("POST", "/v1/audio/transcriptions"), ("POST", "/v1/messages"), ("POST", "/infill"),
    ("POST", "/embedding"), ("POST", "/embeddings"), ("POST", "/v1/embeddings"),
    ("POST", "/rerank"), ("POST", "/reranking"), ("POST", "/v1/rerank"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("POST", "/apply-template"),
    ("POST", "/v1/chat/completions/input_tokens"), ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses/input_tokens"), ("POST", "/responses/input_tokens"),
    ("GET", "/lora-adapters"), ("POST", "/lora-adapters"), ("GET", "/slots"),
    ("POST", "/slots/0"), ("GET", "/v1/stream"), ("GET", "/cors-proxy"), ("GET", "/tools"),
    ("GET", "/api/tags"), ("POST", "/api/chat"), ("POST", "/api/generate"),
    ("POST", "/api/show"), ("GET", "/api/version"), ("GET", "/openapi.json"),
]  # fmt: skip
METHODS = ("GET", "POST", "PUT", "DELETE")


@pytest.fixture(scope="module")
def server(
    default_model: Path, default_fork: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NativeProcess]:
    with native_process(default_model, default_fork, tmp_path_factory.mktemp("openapi")) as proc:
        yield proc


def concrete(path: str) -> str:
    """A described path with its parameters filled in (slot 0, the harmless action)."""
    return path.replace("/slots/{id}", "/slots/0?action=erase")


def request(port: int, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = b"{}" if method in ("POST", "PUT") else None
        conn.request(method, path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def answered_404(path: str, body: bytes) -> bool:
    """/api/show answers every refusal with 404, as Ollama does: its "model is required" to the
    probe's empty object is the route answering, not a missing route."""
    return path == "/api/show" and b"model is required" in body


def port_of(server: NativeProcess, address: str) -> int:
    return server.port if address == "listen" else server.engine_port


def test_the_document_is_valid_openapi_3_1() -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    doc = load_description()
    assert doc["openapi"].startswith("3.1")
    assert doc["info"]["version"] == __version__
    validator.validate(doc)


def test_every_operation_names_its_addresses_modes_and_error_bodies() -> None:
    for path, item in load_description()["paths"].items():
        for method, operation in item.items():
            assert set(operation["x-bankml-addresses"]) <= set(ADDRESSES), (method, path)
            assert operation["x-bankml-modes"], (method, path)
            for status, response in operation["responses"].items():
                if status >= "400":
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (method, path, status)


def test_p0_routes_are_listen_only() -> None:
    p0 = routes("p0")
    assert {r.address for r in p0} == {"listen"}
    assert Route("POST", "/v1/chat/completions", "listen") in p0
    with pytest.raises(ValueError):
        routes("ollama")


def test_every_answered_route_is_described_and_every_described_route_answers(
    server: NativeProcess,
) -> None:
    described = set(routes())
    candidates = {(m, p) for m, p in LLAMA_SERVER_ROUTES}
    candidates |= {(m, concrete(r.path)) for r in described for m in METHODS}
    wrong = []
    for address in ADDRESSES:
        for method, path in sorted(candidates):
            status, headers, body = request(port_of(server, address), method, path)
            # /bankml* answer another method with bankml's 405 (and Allow): not that route
            answered = status not in (404, 405) or answered_404(path, body)
            if status == 405:
                assert path.startswith("/bankml") and "Allow" in headers, (method, path)
            route = path.split("?")[0]  # the query is not part of the route
            expected = any(
                r.method == method and concrete(r.path).split("?")[0] == route
                and r.address == address
                for r in described
            )  # fmt: skip
            if answered != expected:
                wrong.append((address, method, path, status))
    assert wrong == []


def body_schema(name: str) -> dict[str, Any]:
    """A component schema as a standalone JSON Schema (2020-12, OpenAPI 3.1's dialect)."""
    return {"$ref": f"#/components/schemas/{name}", **load_description()}


def fits(instance: Any, name: str) -> None:
    jsonschema.Draft202012Validator(body_schema(name)).validate(instance)


def post_json(port: int, path: str, body: Any) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_real_answers_fit_the_described_bodies(server: NativeProcess) -> None:
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    status, answer = post_json(server.port, "/v1/chat/completions", chat)
    assert status == 200
    fits(answer, "ChatCompletion")
    fits(answer["bankml_receipt"], "Receipt")
    status, answer = post_json(server.port, "/tokenize", {"content": "hi", "with_pieces": True})
    assert status == 200
    fits(answer, "TokenizeAnswer")
    status, answer = post_json(server.port, "/completion", {"prompt": "Hi", "n_predict": 2})
    assert status == 200
    fits(answer, "LlamaCompletion")
    status, answer = post_json(server.port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200
    fits(answer, "TextCompletion")
    for path, name in (("/bankml", "BankmlDescription"), ("/bankml/metrics", "BankmlMetrics")):
        status, answer, _ = server.get(path)
        assert status == 200
        fits(answer, name)
    for path, name in (("/props", "Props"), ("/v1/models", "ModelList")):
        status, answer, _ = server.get(path)
        fits(answer, name)
    status, answer = post_json(server.engine_port, "/slots/0?action=erase", {})
    assert status == 200
    fits(answer, "SlotAnswer")
    for path, body in (("/tokenize", []), ("/v1/chat/completions", {"messages": 3})):
        status, answer = post_json(server.port, path, body)
        assert status == 400
        fits(answer, "Error")


def test_both_addresses_serve_this_very_document(server: NativeProcess) -> None:
    shipped = (Path(__file__).parent.parent / "bankml" / "openapi.json").read_bytes()
    for address in ADDRESSES:
        status, headers, body = request(port_of(server, address), "GET", "/openapi.json")
        assert (status, headers["Content-Type"]) == (200, "application/json; charset=utf-8")
        assert body == shipped, address
