"""Every signed receipt as a DSSE envelope holding an in-toto Statement v1, checked by code that is
not bankml's.

A real ``bankml serve --native`` with a receipt key answers chat, completion, Responses and
Messages requests, streamed and not. Each receipt's ``envelope`` verifies with
securesystemslib's DSSE ``Envelope`` and an ``SSlibKey`` made from the published key; its
Statement's subjects are the model file, the request and the answer (their digests the
receipt's), its predicate the receipt's fields and valid against the JSON Schema the package
ships. ``bankml check-receipt`` takes an envelope in the answer and one kept apart
(``--envelope``), and refuses, with the reason, an envelope of the wrong payload type, one
signed by another key, a truncated payload and a Statement that says another answer. The
Python and openssl commands docs/receipts.md gives for checking without bankml are run as
written.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bankml.receipts.answer import find_receipt
from bankml.receipts.check import VALID, check_envelope, check_receipt
from bankml.receipts.envelope import PAYLOAD_TYPE, envelope_of
from bankml.receipts.keys import SigningKey, keygen, load_public_key
from tests.native_server import NativeProcess, native_process
from tests.receipt_answers import edited
from tests.support import ROOT

pytestmark = pytest.mark.slow

CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
ASKED = [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True, "temperature": 0.8}),
    ("/completion", {"prompt": "Once upon a time", "n_predict": 6, "stream": True}),
    ("/v1/responses", {"input": "Say hello.", "max_output_tokens": 6}),
    ("/v1/messages", {"messages": CHAT["messages"], "max_tokens": 6, "stream": True}),
]


@pytest.fixture(scope="module")
def key(signing_key: SigningKey) -> SigningKey:
    return signing_key


@pytest.fixture(scope="module")
def native(
    key: SigningKey,
    default_model: Path,
    default_fork: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    server = native_process(default_model, default_fork, tmp_path_factory.mktemp("native"))
    server.engine_args += ["--receipt-key", str(key.path)]
    with server:
        yield server


@pytest.fixture(scope="module")
def answers(native: NativeProcess) -> list[tuple[bytes, bytes]]:
    """(request, answer) for each of ASKED."""
    out = []
    for route, body in ASKED:
        request = json.dumps(body).encode()
        asked = urllib.request.Request(
            native.engine_url + route, request, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(asked, timeout=300) as answer:
            out.append((request, bytes(answer.read())))
    return out


def test_every_envelope_verifies_with_securesystemslib(
    answers: list[tuple[bytes, bytes]], key: SigningKey, default_model: Path
) -> None:
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import SSlibKey

    schema = json.loads((ROOT / "bankml" / "receipt-predicate.schema.json").read_text())
    verifier = SSlibKey.from_crypto(load_public_key(key.public_key_pem), keyid=key.keyid)
    for request, answer in answers:
        receipt = find_receipt(answer)[1]
        envelope = Envelope.from_dict(receipt["envelope"])
        assert set(envelope.verify([verifier], 1)) == {key.keyid}
        assert envelope.payload_type == PAYLOAD_TYPE
        found = json.loads(envelope.payload)
        assert found["_type"] == "https://in-toto.io/Statement/v1"
        digests = {s["name"]: s["digest"]["sha256"] for s in found["subject"]}
        assert digests[default_model.name] == receipt["model_sha256"]
        assert digests["request"] == receipt["request_sha256"]
        assert digests["answer"] == receipt["response_sha256"]
        predicate = found["predicate"]
        assert predicate == {k: v for k, v in receipt.items() if k not in ("signature", "envelope")}
        jsonschema.Draft202012Validator(schema).validate(predicate)
        assert check_receipt(request, answer, key.public_key_pem) == VALID


def _with_envelope(edit: Callable[[dict[str, Any]], None]) -> Callable[[list[Any]], None]:
    def apply(objects: list[dict[str, Any]]) -> None:
        edit(objects[-1]["bankml_receipt"]["envelope"])

    return apply


def test_bad_envelopes_are_refused_with_the_reason(
    answers: list[tuple[bytes, bytes]], key: SigningKey, tmp_path: Path
) -> None:
    request, answer = answers[0]
    receipt = find_receipt(answer)[1]
    other = keygen(tmp_path / "other.pem")
    lie = {**receipt, "response_sha256": "0" * 64}
    cases: list[tuple[Callable[[dict[str, Any]], None], str]] = [
        (lambda e: e.update(payloadType="application/json"), "payloadType is 'application/json'"),
        (
            lambda e: e.update(envelope_of(receipt, "model.gguf", other)),
            "not signed by the key given",
        ),
        (lambda e: e.update(payload=e["payload"][:-3]), "not valid base64"),
        (
            lambda e: e.update(envelope_of(lie, "model.gguf", key)),
            "answer subject is not the receipt's response_sha256",
        ),
    ]
    for edit, reason in cases:
        verdict = check_receipt(request, edited(answer, _with_envelope(edit)), key.public_key_pem)
        assert verdict.startswith("refuse: ") and reason in verdict, (reason, verdict)
        kept = dict(receipt["envelope"])
        edit(kept)
        verdict = check_envelope(request, answer, json.dumps(kept).encode(), key.public_key_pem)
        assert verdict.startswith("refuse: "), (reason, verdict)
    # a Statement that names another answer, signed by the key, kept apart: refused by the check
    kept = envelope_of(lie, "model.gguf", key)
    verdict = check_envelope(request, answer, json.dumps(kept).encode(), key.public_key_pem)
    assert verdict.startswith("refuse: response_sha256 is not the sha256"), verdict


def test_check_receipt_takes_an_envelope_kept_apart(
    answers: list[tuple[bytes, bytes]], key: SigningKey, tmp_path: Path
) -> None:
    for index, (request, answer) in enumerate(answers):
        files = {
            "request": request,
            "response": answer,
            "key": key.public_key_pem.encode(),
            "envelope": json.dumps(find_receipt(answer)[1]["envelope"]).encode(),
        }
        args = []
        for name, data in files.items():
            path = tmp_path / f"{index}.{name}"
            path.write_bytes(data)
            args += [f"--{name}", str(path)]
        run = subprocess.run(
            [sys.executable, "-m", "bankml", "check-receipt", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert (run.returncode, run.stdout.strip()) == (0, VALID), run.stderr


def _documented(language: str) -> str:
    """The ``language`` block of docs/receipts.md's DSSE section."""
    text = (ROOT / "docs" / "receipts.md").read_text(encoding="utf-8")
    section = text.split("### As a DSSE envelope (in-toto)", 1)[1].split("\n## ", 1)[0]
    found = re.search(rf"```{language}\n(.*?)```", section, re.S)
    assert found is not None, language
    return found.group(1)


def test_the_documented_checks_without_bankml_run(
    answers: list[tuple[bytes, bytes]], key: SigningKey, tmp_path: Path
) -> None:
    request, answer = answers[0]
    (tmp_path / "request.json").write_bytes(request)
    (tmp_path / "answer.json").write_bytes(answer)
    (tmp_path / "key.pem").write_text(key.public_key_pem)
    run = subprocess.run(
        [sys.executable, "-c", _documented("python")], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.startswith("verified: "), run.stderr
    if shutil.which("jq") is None or shutil.which("openssl") is None:
        pytest.skip("jq or openssl is not installed")
    run = subprocess.run(
        ["bash", "-c", _documented("sh")], cwd=tmp_path, capture_output=True, text=True
    )
    assert "Signature Verified Successfully" in run.stdout, run.stderr
    payload = base64.b64decode(json.loads(answer)["bankml_receipt"]["envelope"]["payload"])
    assert (tmp_path / "payload.json").read_bytes() == payload
