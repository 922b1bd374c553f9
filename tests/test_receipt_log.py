"""The receipt log (``--receipt-log FILE``): every receipt one JSON line, chained by hash.

On signed receipts: the chain checks across rotated files; a changed receipt, a removed line, two
lines swapped, a line from another log are each refused at the line that breaks it; a last line
cut short by a crash is not counted and is cut off when the log is opened again, and the chain
goes on from the line before it. On a real ``bankml serve --native``: killed with SIGKILL under
load twice and started again on the same log, the log still checks (``bankml check-receipt
--log``) and holds no more lines than answers were given.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from bankml.receipts.check import VALID, check_receipt_log
from bankml.receipts.keys import SigningKey, keygen
from bankml.receipts.log import ReceiptLog, log_files
from bankml.receipts.sign import sign_receipt
from tests.native_server import native_process
from tests.support import ROOT


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return keygen(tmp_path_factory.mktemp("log-key") / "receipt-key.pem")


def signed(key: SigningKey, n: int) -> dict[str, Any]:
    """A signed receipt (the fields the log's check reads)."""
    fields = {"receipt_version": 2, "alg": "ed25519", "signed": True, "api": "chat", "n": n}
    return sign_receipt({**fields, "response_sha256": f"{n:064x}"}, key)


def written(path: Path, key: SigningKey, count: int, max_bytes: int = 1 << 20) -> None:
    log = ReceiptLog.open(path, max_bytes=max_bytes)
    for n in range(count):
        log.append(signed(key, n))
    log.close()


def test_the_chain_checks_across_rotated_files(key: SigningKey, tmp_path: Path) -> None:
    path = tmp_path / "receipts.jsonl"
    written(path, key, 25, max_bytes=2000)
    written(path, key, 5, max_bytes=2000)  # opened again: the chain goes on
    files = log_files(path)
    assert len(files) > 3 and files[-1] == path
    assert check_receipt_log(str(path), key.public_key_pem) == f"{VALID}: 30 receipts"
    lines = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert [entry["seq"] for entry in lines] == list(range(30))


def _edit(path: Path, change: Any) -> str:
    lines = path.read_bytes().split(b"\n")[:-1]
    change(lines)
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path.read_text()


@pytest.mark.parametrize(
    ("name", "change", "reason"),
    [
        (
            "a changed receipt",
            lambda lines: lines.__setitem__(2, lines[2].replace(b'"n":2', b'"n":7')),
            "receipts.jsonl line 3: the signature does not verify: the receipt was changed "
            "after signing",
        ),
        ("a removed line", lambda lines: lines.pop(3), "receipts.jsonl line 4: seq 4, expected 3"),
        (
            "two lines swapped",
            lambda lines: lines.insert(1, lines.pop(2)),
            "receipts.jsonl line 2: seq 2, expected 1",
        ),
        ("not JSON", lambda lines: lines.__setitem__(4, b"{"), "receipts.jsonl line 5 is not JSON"),
    ],
)
def test_a_broken_log_is_refused_at_the_line_that_breaks_it(
    key: SigningKey, tmp_path: Path, name: str, change: Any, reason: str
) -> None:
    path = tmp_path / "receipts.jsonl"
    written(path, key, 6)
    _edit(path, change)
    assert check_receipt_log(str(path), key.public_key_pem) == f"refuse: {reason}", name


def test_a_line_from_another_log_breaks_the_chain(key: SigningKey, tmp_path: Path) -> None:
    ours, theirs = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    written(ours, key, 4)
    log = ReceiptLog.open(theirs)
    for n in (10, 11, 12):
        log.append(signed(key, n))
    log.close()
    stranger = theirs.read_bytes().split(b"\n")[2]
    _edit(ours, lambda lines: lines.__setitem__(2, stranger))
    verdict = check_receipt_log(str(ours), key.public_key_pem)
    assert verdict == "refuse: a.jsonl line 3: prev is not the hash of the line before it"


def test_a_line_cut_short_by_a_crash_is_not_counted_and_is_cut_off(
    key: SigningKey, tmp_path: Path
) -> None:
    path = tmp_path / "receipts.jsonl"
    written(path, key, 4)
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"prev":"ab')  # the crash came while a line was written
    assert check_receipt_log(str(path), key.public_key_pem) == f"{VALID}: 4 receipts"
    written(path, key, 2)
    assert path.read_bytes().startswith(whole)
    assert check_receipt_log(str(path), key.public_key_pem) == f"{VALID}: 6 receipts"


ROUNDS = 2  # kills under load, each followed by a start on the same log


def _load(url: str, stop: threading.Event, done: list[int], once: bool = False) -> None:
    """Short completions, one after the other, until ``stop`` or the server is gone."""
    body = json.dumps({"prompt": "Once upon a time", "n_predict": 4}).encode()
    while not stop.is_set():
        if once:
            stop.set()
        request = urllib.request.Request(
            url + "/completion", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                answer.read()
            done.append(1)
        except OSError:
            return


@pytest.mark.slow
def test_kill_9_under_load_never_breaks_the_log(
    key: SigningKey, default_model: Path, default_fork: Path, tmp_path: Path
) -> None:
    log = tmp_path / "receipts.jsonl"
    answered = 0
    for round_ in range(ROUNDS):
        server = native_process(default_model, default_fork, tmp_path / f"round{round_}")
        server.engine_args += ["--receipt-key", str(key.path), "--receipt-log", str(log)]
        server.start()
        warm: list[int] = []
        _load(server.url, threading.Event(), warm, once=True)  # the first run compiles
        done: list[int] = list(warm)
        stop = threading.Event()

        workers = [threading.Thread(target=_load, args=(server.url, stop, done)) for _ in range(3)]
        for worker in workers:
            worker.start()
        time.sleep(2.5)  # past a sync or two
        server.stop(signal.SIGKILL)
        stop.set()
        for worker in workers:
            worker.join()
        answered += len(done)
    public = tmp_path / "key.pem"
    public.write_text(key.public_key_pem)
    check = subprocess.run(
        [sys.executable, "-m", "bankml", "check-receipt", "--log", str(log), "--key", str(public)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    kept = int(check.stdout.split()[1])
    # a kill loses at most the lines written since the last sync; a line can precede an answer
    # the kill cut off (three clients: at most three a round)
    assert 0 < kept <= answered + 3 * ROUNDS, (kept, answered)
    print(
        f"\nreceipt log after {ROUNDS} kills under load: {kept} lines checked, {answered} answers"
    )
