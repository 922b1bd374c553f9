"""Signed receipts from a live ``bankml serve --native`` (a real subprocess on loopback, the default
model), checked the way a third party checks them: ``bankml check-receipt`` with the public key
from ``GET /bankml/key``.

Every answer of every native endpoint (chat, ``/v1/completions``, ``/completion`` and its
``/completions`` alias; streamed and not; greedy, seeded, and with a seed bankml drew) is
``valid``, and a changed request or answer is refused; an answer whose seed bankml drew replays
identically on the exact engine; a restarted server signs with the same key; a rotated key's old
receipts still verify with the old public key (and only with it); a key file others may read, or
that does not parse, is refused before anything listens.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from bankml.receipts.answer import find_receipt
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.keys import keygen
from bankml.receipts.sign import engine_source_digest
from tests import support
from tests.bankml_process import check_receipt_cli
from tests.native_server import NativeProcess
from tests.receipt_answers import edited, text_slots

pytestmark = pytest.mark.slow

DRAWN = 4294967295  # llama.cpp's "draw a seed": never what a receipt names
MESSAGES = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The three primary colors are"

# (name, path, body): every native endpoint, streamed and not, greedy, seeded, seed drawn
EXCHANGES: list[tuple[str, str, dict[str, Any]]] = [
    (
        "chat greedy",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 8, "temperature": 0},
    ),
    (
        "chat greedy stream, logprobs",
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    (
        "chat seeded stream",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.9, "seed": 7, "stream": True},
    ),
    (
        "chat seed drawn",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "cache_prompt": False},
    ),
    (
        "completion greedy stream",
        "/completion",
        {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "stream": True},
    ),
    (
        "completion seeded, n_probs",
        "/completion",
        {"prompt": PROMPT, "n_predict": 8, "temperature": 0.9, "seed": 5, "n_probs": 2},
    ),
    (
        "completions alias, seed drawn stream",
        "/completions",
        {"prompt": PROMPT, "n_predict": 8, "temperature": 1.0, "stream": True},
    ),
    (
        "oai completion greedy",
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
    ),
    (
        "oai completion seeded stream",
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.9, "seed": 3, "stream": True},
    ),
]
API_OF = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "oai_completion",
    "/completion": "llama_completion",
    "/completions": "llama_completion",
}


def native_server(directory: Path, key: Path | None) -> NativeProcess:
    directory.mkdir(parents=True, exist_ok=True)
    engine_port = support.free_port()
    args = ["--native", "--upstream", f"127.0.0.1:{engine_port}"]
    if key is not None:
        args += ["--receipt-key", str(key)]
    return NativeProcess(
        support.default_model(),
        support.DEFAULT_FORK,
        args,
        directory / "bankml.log",
        engine_port=engine_port,
    )


def post(server: NativeProcess, path: str, body: bytes) -> tuple[int, bytes]:
    conn = server.connection()
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def public_key(server: NativeProcess) -> dict[str, str]:
    status, doc, _ = server.get("/bankml/key")
    assert status == 200, doc
    return doc


def ask(server: NativeProcess, path: str, body: dict[str, Any]) -> tuple[bytes, bytes]:
    raw = json.dumps(body).encode()
    status, answer = post(server, path, raw)
    assert status == 200, answer[:300]
    return raw, answer


def changed_text(api: str, response: bytes) -> bytes:
    """The answer with one character of its text changed (the receipt left as signed)."""

    def edit(objects: list[dict[str, Any]]) -> None:
        for holder, key in text_slots(api, objects):
            if holder.get(key):
                holder[key] = ("X" if holder[key][0] != "X" else "Y") + holder[key][1:]
                return
        raise AssertionError("an answer with no text")

    return edited(response, edit)


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory):
    """A native server on a key file that does not exist yet (made at its first start)."""
    base = tmp_path_factory.mktemp("served-receipts")
    server = native_server(base / "first", base / "keys" / "receipt-key.pem")
    server.start()
    server.key_path = base / "keys" / "receipt-key.pem"  # type: ignore[attr-defined]
    yield server
    server.stop()


def test_the_first_start_makes_the_key_and_says_where(first: NativeProcess) -> None:
    path: Path = first.key_path  # type: ignore[attr-defined]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = public_key(first)
    assert doc["alg"] == "ed25519" and doc["public_key"].startswith("-----BEGIN PUBLIC KEY-----")
    assert re.fullmatch(r"[0-9a-f]{64}", doc["keyid"])
    assert f"receipt key {path} (created), key id {doc['keyid']}" in first.output()
    assert first.get("/bankml")[1]["receipt_keyid"] == doc["keyid"]


def test_every_native_answer_is_valid_by_check_receipt_and_a_changed_one_is_refused(
    first: NativeProcess, tmp_path: Path
) -> None:
    pem = public_key(first)["public_key"]
    n_ctx = first.get("/props")[1]["default_generation_settings"]["n_ctx"]
    counts = {"valid": 0, "refused": 0}
    for name, path, body in EXCHANGES:
        raw, answer = ask(first, path, body)
        code, out = check_receipt_cli(
            tmp_path, raw, answer, pem, "--model-sha256", support.DEFAULT_SHA256
        )
        assert (code, out) == (0, VALID), name
        counts["valid"] += 1
        receipt = find_receipt(answer)[1]
        assert receipt["receipt_version"] == 2 and receipt["api"] == API_OF[path], name
        assert receipt["stream"] is (body.get("stream") is True), name
        seed = receipt["sampler"]["seed"]
        assert seed == body["seed"] if "seed" in body else seed != DRAWN, name
        assert (receipt["n_ctx"], receipt["cache_type"]) == (n_ctx, "f16"), name
        assert receipt["engine_digest"] == engine_source_digest(), name
        assert re.fullmatch(r"[0-9a-f]{64}", receipt["prompt_tokens_sha256"]), name
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", receipt["timestamp"])
        # one character of the answer, one field of the request: refused
        for request, response in (
            (raw, changed_text(API_OF[path], answer)),
            (json.dumps({**body, "temperature": 0.5}).encode(), answer),
        ):
            verdict = check_receipt(request, response, pem)
            assert verdict.startswith("refuse: "), (name, verdict)
            counts["refused"] += 1
    code, out = check_receipt_cli(tmp_path, raw, changed_text(API_OF[path], answer), pem)
    assert code == 2 and out.startswith("refuse: response_sha256"), out
    print(f"served receipts: {counts['valid']} valid, {counts['refused']} changed ones refused")


def test_an_answer_with_a_drawn_seed_replays_identically(
    first: NativeProcess, tmp_path: Path
) -> None:
    name, path, body = next(e for e in EXCHANGES if e[0] == "chat seed drawn")
    raw, answer = ask(first, path, body)
    model, fork = str(support.default_model()), str(support.DEFAULT_FORK)
    code, out = check_receipt_cli(
        tmp_path, raw, answer, public_key(first)["public_key"], "--replay", model, "--fork", fork
    )
    assert code == 0 and out.splitlines()[0] == VALID, out
    assert out.splitlines()[1].startswith("replay: identical"), out


def test_a_restarted_server_keeps_its_key_and_a_rotated_keys_receipts_verify_with_the_old_key(
    first: NativeProcess, tmp_path: Path
) -> None:
    old = public_key(first)
    name, path, body = EXCHANGES[0]
    before = ask(first, path, body)
    first.stop()
    key_path: Path = first.key_path  # type: ignore[attr-defined]
    with native_server(tmp_path / "restarted", key_path) as again:
        assert public_key(again) == old
        assert f"receipt key {key_path} (loaded), key id {old['keyid']}" in again.output()
        after = ask(again, path, body)
    assert check_receipt(*after, old["public_key"]) == VALID
    rotated = tmp_path / "keys" / "receipt-key-2.pem"
    keygen(rotated)
    with native_server(tmp_path / "rotated", rotated) as third:
        new = public_key(third)
        latest = ask(third, path, body)
    assert new["keyid"] != old["keyid"]
    assert check_receipt(*latest, new["public_key"]) == VALID
    assert check_receipt(*before, old["public_key"]) == VALID  # the old receipts: the old key
    for exchange, wrong in ((before, new), (latest, old)):
        assert check_receipt(*exchange, wrong["public_key"]).startswith("refuse: signed by key")


def _refused_at_start(tmp_path: Path, key: Path) -> str:
    server = native_server(tmp_path / "refused", key).launch()
    assert server.wait_exit(120) == 2, server.output()
    with socket.socket() as probe:  # nothing listened
        assert probe.connect_ex(("127.0.0.1", server.port)) != 0
    return server.output()


def test_a_key_file_others_may_read_is_refused_before_anything_listens(tmp_path: Path) -> None:
    key = tmp_path / "loose.pem"
    keygen(key)
    os.chmod(key, 0o644)
    out = _refused_at_start(tmp_path, key)
    assert f"refuse: --receipt-key {key}: permissions 0644" in out, out


def test_a_key_file_that_does_not_parse_is_refused_before_anything_listens(tmp_path: Path) -> None:
    key = tmp_path / "garbage.pem"
    key.write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    os.chmod(key, 0o600)
    out = _refused_at_start(tmp_path, key)
    assert f"refuse: --receipt-key {key}: not a PEM private key" in out, out
