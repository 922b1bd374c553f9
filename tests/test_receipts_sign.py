"""Receipt keys and version-2 signing: the key file's rules, the key id, the canonical bytes
(jq's and openssl's view of them), rotation, reloading, and what signing costs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from bankml.receipts.answer import find_receipt
from bankml.receipts.canonical import CONTEXT, canonical_json, signed_bytes
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.keys import (
    KeyRefused,
    SigningKey,
    default_key_path,
    ensure_key,
    key_document,
    keygen,
    load_key,
    raw_public_bytes,
)
from bankml.receipts.sign import build_receipt_v2, pin_seed
from bankml.receipts.tally import Tally, receipt
from tests.receipt_answers import (  # noqa: F401  (fixtures, found by their names)
    MESSAGES,
    Exchange,
    as_served,
    exchanges_fixture,
    native_engine_fixture,
    receipt_key_fixture,
)


def _todays_fields() -> list[str]:
    tally = Tally(request_body=b"{}")
    tally.add_logprobs([])
    return list(receipt(tally, engine="e", model_sha256="m"))


TODAYS_FIELDS = _todays_fields()  # with logprobs_sha256, which a receipt has only with logprobs
needs_jq = pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed")
needs_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="openssl is not installed"
)


# --- the key file ---------------------------------------------------------------------------------


def test_keygen_writes_0600_atomically_and_never_over_a_key(tmp_path: Path) -> None:
    path = tmp_path / "new" / "receipt-key.pem"
    key = keygen(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert os.listdir(path.parent) == ["receipt-key.pem"]  # no temporary file left behind
    assert load_key(path).keyid == key.keyid
    before = path.read_bytes()
    with pytest.raises(KeyRefused, match="already there"):
        keygen(path)
    assert path.read_bytes() == before


def test_load_key_refuses_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "k.pem"
    keygen(path)
    path.chmod(0o644)
    with pytest.raises(KeyRefused, match="permissions 0644"):
        load_key(path)
    path.chmod(0o600)
    load_key(path)

    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n")
    garbage.chmod(0o600)
    with pytest.raises(KeyRefused, match="not a PEM private key"):
        load_key(garbage)

    other = tmp_path / "rsa.pem"
    pem = rsa.generate_private_key(65537, 2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    other.write_bytes(pem)
    other.chmod(0o600)
    with pytest.raises(KeyRefused, match="not an Ed25519 key"):
        load_key(other)

    with pytest.raises(KeyRefused, match="No such file"):
        load_key(tmp_path / "missing.pem")


def test_ensure_key_creates_once_then_loads(tmp_path: Path) -> None:
    path = default_key_path(tmp_path)
    assert path == tmp_path / ".local/share/bankml/receipt-key.pem"
    first, created = ensure_key(path)
    again, created_again = ensure_key(path)
    assert (created, created_again) == (True, False)
    assert first.keyid == again.keyid


@needs_openssl
def test_key_id_and_document(tmp_path: Path) -> None:
    key = keygen(tmp_path / "k.pem")
    raw = raw_public_bytes(key.private.public_key())
    assert key.keyid == hashlib.sha256(raw).hexdigest()
    (tmp_path / "pub.pem").write_text(key.public_key_pem)
    der = subprocess.run(
        ["openssl", "pkey", "-pubin", "-in", str(tmp_path / "pub.pem"), "-outform", "DER"],
        check=True,
        capture_output=True,
    ).stdout
    assert hashlib.sha256(der[-32:]).hexdigest() == key.keyid  # the documented shell recipe
    doc = key_document(key)
    assert doc == {"alg": "ed25519", "keyid": key.keyid, "public_key": key.public_key_pem}
    assert doc["public_key"].startswith("-----BEGIN PUBLIC KEY-----")


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="no sha256sum")
def test_engine_digest_is_the_documented_shell_recipe() -> None:
    from bankml.receipts.sign import ENGINE_SOURCES, engine_source_digest

    recipe = "find engine_cupy -name '*.py' | LC_ALL=C sort | xargs sha256sum | sha256sum"
    out = subprocess.run(
        ["sh", "-c", recipe], cwd=ENGINE_SOURCES.parent, capture_output=True, text=True, check=True
    )
    assert out.stdout.split()[0] == engine_source_digest()


# --- the receipt ---------------------------------------------------------------------------------


def openai_client_reads(ex: Exchange) -> list[Any]:
    """The official openai client's objects for an answer's exact bytes (served to it by an
    httpx transport, so the client's own response parsing runs)."""
    import httpx
    import openai

    def serve(request: httpx.Request) -> httpx.Response:
        kind = "text/event-stream" if ex.stream else "application/json"
        return httpx.Response(200, content=ex.response, headers={"content-type": kind})

    client = openai.OpenAI(
        api_key="none",
        base_url="http://127.0.0.1:9/v1",
        http_client=httpx.Client(transport=httpx.MockTransport(serve)),
    )
    body = json.loads(ex.request)
    if ex.api == "chat":
        out = client.chat.completions.create(model="m", messages=body["messages"], stream=ex.stream)
    else:
        out = client.completions.create(model="m", prompt=body["prompt"], stream=ex.stream)
    return list(out) if ex.stream else [out]


@pytest.mark.slow  # the engine's answers
def test_version_2_keeps_todays_fields_and_clients_parse(exchanges: list[Exchange]) -> None:
    for ex in exchanges:
        r = find_receipt(ex.response)[1]
        today = [f for f in TODAYS_FIELDS if f != "logprobs_sha256" or f in r]
        assert list(r)[: len(today)] == today, ex.name  # today's fields first, in today's order
        assert r["signed"] is True and r["receipt_version"] == 2 and r["alg"] == "ed25519"
        assert r["sampler"]["seed"] != 0xFFFFFFFF  # the seed actually used
        if ex.api in ("chat", "oai_completion"):
            objects = openai_client_reads(ex)
            assert objects[-1].model_extra["bankml_receipt"] == r, ex.name
            assert all("bankml_receipt" not in o.model_extra for o in objects[:-1])


@pytest.mark.slow  # the engine's answers
def test_pin_seed_records_a_drawn_seed(native_engine: Any) -> None:
    engine = native_engine.engine
    drawn = pin_seed(engine.parse_request({"messages": MESSAGES}, "chat"))
    assert drawn.sampler.seed != 0xFFFFFFFF
    given = engine.parse_request({"messages": MESSAGES, "seed": 9}, "chat")
    assert pin_seed(given) is given


def integral_floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value] if value.is_integer() else []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [f for v in items for f in integral_floats(v)]


@pytest.mark.slow  # the engine's answers
@needs_jq
def test_canonical_bytes_are_what_jq_writes(exchanges: list[Exchange]) -> None:
    for ex in exchanges:
        r = find_receipt(ex.response)[1]
        jq = subprocess.run(
            ["jq", "-cjS", "del(.signature, .envelope)"],
            input=json.dumps(r).encode(),
            capture_output=True,
            check=True,
        ).stdout
        assert CONTEXT + jq == signed_bytes(r), ex.name
        assert not integral_floats(r), (ex.name, integral_floats(r))  # sent in canonical form
    odd = {"b": [1.0, -1.0, 0.5, 1e-05, 2**40], "a": "tab\there \x7f \u00e9 \x01"}
    jq = subprocess.run(
        ["jq", "-cjS", "."], input=json.dumps(odd).encode(), capture_output=True
    ).stdout
    assert jq == canonical_json(odd)


def last_data_line(response: bytes) -> bytes:
    if not response.lstrip().startswith(b"data:"):
        return response
    lines = [line for line in response.splitlines() if line.startswith(b"data: {")]
    return lines[-1][len(b"data: ") :]


@pytest.mark.slow  # the engine's answers
@needs_openssl
@needs_jq
def test_openssl_alone_verifies(
    exchanges: list[Exchange], receipt_key: SigningKey, tmp_path: Path
) -> None:
    """docs/modules/receipts.md's recipe: jq pulls the receipt apart, openssl verifies."""
    (tmp_path / "pub.pem").write_text(receipt_key.public_key_pem)
    script = (
        "jq -r .bankml_receipt.signature obj.json | base64 -d > sig.bin && "
        "{ printf 'bankml-receipt-v2\\n'; jq -cjS '.bankml_receipt | del(.signature, .envelope)' obj.json; } > signed.bin && "
        "openssl pkeyutl -verify -pubin -inkey pub.pem -rawin -in signed.bin -sigfile sig.bin"
    )
    for ex in exchanges:
        (tmp_path / "obj.json").write_bytes(last_data_line(ex.response))
        ok = subprocess.run(["sh", "-c", script], cwd=tmp_path, capture_output=True, text=True)
        assert ok.returncode == 0 and "Signature Verified Successfully" in ok.stdout, (ex.name, ok)
    forged = json.loads(last_data_line(exchanges[0].response))
    forged["bankml_receipt"]["completion_tokens"] += 1
    (tmp_path / "obj.json").write_text(json.dumps(forged))
    bad = subprocess.run(["sh", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode != 0


@pytest.mark.slow  # the engine's answers
def test_rotated_key_old_receipts_verify_with_the_old_key(
    native_engine: Any, tmp_path: Path
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    old = keygen(tmp_path / "2026-01.pem")
    before = as_served(native_engine, old, "before", "chat", body, False)
    new = keygen(tmp_path / "2026-02.pem")  # rotation: a new file, the old public key kept
    after = as_served(native_engine, new, "after", "chat", body, False)
    assert check_receipt(before.request, before.response, old.public_key_pem) == VALID
    assert check_receipt(after.request, after.response, new.public_key_pem) == VALID
    assert check_receipt(before.request, before.response, new.public_key_pem).startswith(
        "refuse: signed by key"
    )
    assert check_receipt(after.request, after.response, old.public_key_pem).startswith(
        "refuse: signed by key"
    )


@pytest.mark.slow  # the engine's answers
def test_a_key_reloaded_from_its_file_signs_receipts_that_verify(
    native_engine: Any, tmp_path: Path
) -> None:
    """As a restarted server: the key read back from the file it wrote at first start."""
    path = tmp_path / "receipt-key.pem"
    first, _ = ensure_key(path)
    reloaded = load_key(path)
    assert reloaded is not first and reloaded.keyid == first.keyid
    ex = as_served(
        native_engine,
        reloaded,
        "reloaded",
        "llama_completion",
        {"prompt": "Hi", "n_predict": 4},
        True,
    )
    assert check_receipt(ex.request, ex.response, first.public_key_pem) == VALID


@pytest.mark.slow  # the engine's answers
def test_signing_cost(exchanges: list[Exchange], receipt_key: SigningKey) -> None:
    """Printed, not asserted: what signing adds to an answer."""
    ratios = [ex.sign_s / ex.wall_s for ex in exchanges]
    base = {k: v for k, v in find_receipt(exchanges[0].response)[1].items() if k in TODAYS_FIELDS}
    from bankml.receipts.sign import ReplayFacts

    facts = ReplayFacts(
        "chat",
        False,
        {"seed": 1, "temperature": 0.8},
        -1,
        4096,
        "f16",
        "cpu",
        "v",
        "d",
        list(range(40)),
        list(range(12)),
        0,
        "stop",
    )
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        build_receipt_v2(base, facts, receipt_key)
        times.append(time.perf_counter() - t0)
    print(
        f"\nsigning a receipt: median {statistics.median(times) * 1e6:.0f} us over 300; in the answers: "
        f"median {statistics.median(ex.sign_s for ex in exchanges) * 1e6:.0f} us, "
        f"{statistics.median(ratios) * 100:.3f}% of the answer's wall time (median), "
        f"{max(ratios) * 100:.3f}% at most "
        f"(answers {min(ex.wall_s for ex in exchanges) * 1e3:.0f}-{max(ex.wall_s for ex in exchanges) * 1e3:.0f} ms)"
    )
    assert (
        check_receipt(exchanges[0].request, exchanges[0].response, receipt_key.public_key_pem)
        == VALID
    )
