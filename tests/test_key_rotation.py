"""Rotating and revoking the receipt key (``bankml keygen --rotate``, ``--revoke``).

Receipts signed before a rotation still check with the published key document (``GET
/bankml/key``'s body: the current key and the retired ones with their validity), those signed
after with the new key; a retired key's receipt dated after its retirement, a receipt of a key
the document does not list, and every receipt of a revoked key are refused with the reason. The
commands run as a user runs them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bankml.receipts.canonical import timestamp
from bankml.receipts.check import VALID, check_receipt_log
from bankml.receipts.keyring import TrustedKeys, published, read_keyring, rotate
from bankml.receipts.keys import SigningKey, keygen, load_key
from bankml.receipts.log import ReceiptLog
from bankml.receipts.sign import sign_receipt
from tests.support import ROOT


def signed(key: SigningKey, at: float) -> dict[str, Any]:
    fields = {"receipt_version": 2, "alg": "ed25519", "signed": True, "api": "chat"}
    return sign_receipt({**fields, "timestamp": timestamp(at)}, key)


def logged(path: Path, receipts: list[dict[str, Any]]) -> str:
    log = ReceiptLog.open(path)
    for receipt in receipts:
        log.append(receipt)
    log.close()
    return str(path)


def keygen_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bankml", "keygen", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_receipts_of_a_retired_key_check_while_it_was_current(tmp_path: Path) -> None:
    path = tmp_path / "receipt-key.pem"
    first = keygen(path)
    before = signed(first, 1_000_000.0)
    second = rotate(path, now=2_000_000.0)
    assert load_key(path).keyid == second.keyid != first.keyid
    after = signed(second, 3_000_000.0)
    document = json.dumps(published(second))
    [entry] = json.loads(document)["previous"]
    assert (entry["keyid"], entry["not_before"]) == (first.keyid, None)
    assert entry["not_after"] == timestamp(2_000_000.0)
    log = logged(tmp_path / "log.jsonl", [before, after])
    assert check_receipt_log(log, document) == f"{VALID}: 2 receipts"
    # the new key alone does not know the old one
    verdict = check_receipt_log(log, second.public_key_pem)
    assert verdict == (
        f"refuse: log.jsonl line 1: signed by key {first.keyid}, not by the key given "
        f"({second.keyid})"
    )
    # a receipt the retired key signed after its retirement: refused
    late = logged(tmp_path / "late.jsonl", [signed(first, 2_500_000.0)])
    verdict = check_receipt_log(late, document)
    assert verdict.startswith(f"refuse: late.jsonl line 1: signed at {timestamp(2_500_000.0)}")
    assert f"valid from its start to {timestamp(2_000_000.0)}" in verdict
    # the current key's receipt dated before it took over: refused
    early = logged(tmp_path / "early.jsonl", [signed(second, 1_500_000.0)])
    assert "which signs only since" in check_receipt_log(early, document)


def test_a_revoked_key_refuses_every_receipt_it_signed(tmp_path: Path) -> None:
    path = tmp_path / "receipt-key.pem"
    first = keygen(path)
    old = signed(first, 1_000_000.0)
    run = keygen_cli("--key", str(path), "--rotate")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["keyid"] == load_key(path).keyid != first.keyid
    run = keygen_cli("--key", str(path), "--revoke", first.keyid, "--reason", "the key leaked")
    assert run.returncode == 0, run.stderr
    assert read_keyring(path)[0]["revoked"]["reason"] == "the key leaked"
    document = json.dumps(published(load_key(path)))
    verdict = check_receipt_log(logged(tmp_path / "log.jsonl", [old]), document)
    assert verdict.startswith(f"refuse: log.jsonl line 1: signed by key {first.keyid}, revoked")
    assert verdict.endswith(": the key leaked")
    # the current key cannot be revoked, and --revoke needs its reason
    current = load_key(path).keyid
    run = keygen_cli("--key", str(path), "--revoke", current, "--reason", "x")
    assert run.returncode == 2 and "rotate it first" in run.stderr
    assert keygen_cli("--key", str(path), "--revoke", current).returncode == 1


def test_the_checker_reads_a_pem_or_the_published_document(tmp_path: Path) -> None:
    key = keygen(tmp_path / "k.pem")
    for given in (key.public_key_pem, json.dumps(published(key))):
        assert TrustedKeys.of(given).keyid == key.keyid
    assert published(key)["previous"] == [] and published(key)["since"] is None
