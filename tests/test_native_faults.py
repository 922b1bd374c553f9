"""Faults injected into a real `bankml serve --native`: the model file truncated, replaced or
removed while serving, SIGTERM during a stream, and a crash.

- A file that is no longer the one verified answers every generating endpoint 503 with
  ``FILE_CHANGED`` and no receipt, streamed or not, and nothing is computed from it; a restart
  verifies the file again before anything listens (a truncated file is refused, the
  restored bytes answer again).
- SIGTERM during a stream ends it without a receipt for the partial answer, and bankml exits by
  the signal (128 + 15).
- A crash (SIGSEGV, as a fault in a compiled kernel raises) leaves each thread's Python stack in
  the log before the process ends by the signal.
- A slot save into a directory the server may not write to is 500 ``Unable to save slot:
  Permission denied``, as llama-server's 500 with the reason; the directory holds what it held
  and the slot saves, once the directory is writable again, the bytes it saved before. Run as
  root (which writes anywhere), the server is started without CAP_DAC_OVERRIDE, so the
  directory's mode binds it as it binds any other user.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bankml.gate.verify import pin
from bankml.receipts.vouch import FILE_CHANGED
from tests import support
from tests.native_server import NativeProcess, native_process

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0}
GENERATING = [
    ("/v1/chat/completions", CHAT),
    ("/completion", {"prompt": "Hi", "n_predict": 3}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 3}),
]


@pytest.fixture
def own_copy(default_model: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the default model, pinned in its own FORK.json: the tests may damage it."""
    model = tmp_path / default_model.name
    shutil.copyfile(default_model, model)
    fork = tmp_path / "FORK.json"
    pin(model, fork)
    return model, fork


@pytest.fixture
def server(own_copy: tuple[Path, Path], tmp_path: Path) -> Iterator[NativeProcess]:
    model, fork = own_copy
    with native_process(model, fork, tmp_path / "run") as proc:
        yield proc


def post(port: int, path: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def assert_refused_everywhere(server: NativeProcess, reason: str) -> None:
    for address in (server.port, server.engine_port):
        for path, body in GENERATING:
            for stream in (False, True):
                status, raw = post(address, path, {**body, "stream": stream})
                assert status == 503, (path, stream, raw[:200])
                assert json.loads(raw)["error"]["message"] == reason, (path, stream)
                assert b"bankml_receipt" not in raw


def test_a_file_truncated_replaced_or_removed_while_serving_answers_503_without_receipt(
    server: NativeProcess, own_copy: tuple[Path, Path], tmp_path: Path
) -> None:
    model, fork = own_copy
    intact = tmp_path / "intact.gguf"
    shutil.copyfile(model, intact)
    status, raw = post(server.port, "/v1/chat/completions", CHAT)
    assert status == 200 and b"bankml_receipt" in raw
    answered = server.get("/bankml/metrics")[1]["kept"]

    copy = model.with_suffix(".copy")
    shutil.copyfile(model, copy)
    os.replace(copy, model)  # the same bytes under another inode
    assert_refused_everywhere(server, FILE_CHANGED)

    with open(model, "r+b") as f:  # cut in place: same inode, another size
        f.truncate(model.stat().st_size // 2)
    assert_refused_everywhere(server, FILE_CHANGED)

    model.unlink()
    assert_refused_everywhere(server, f"{FILE_CHANGED} (No such file or directory)")
    assert server.get("/bankml/metrics")[1]["kept"] == answered, "something was computed"
    assert server.stop() == 128 + signal.SIGTERM

    # a restart verifies again before anything listens: the cut file is refused ...
    shutil.copyfile(intact, model)
    with open(model, "r+b") as f:
        f.truncate(model.stat().st_size // 2)
    cut = native_process(model, fork, tmp_path / "cut").launch()
    assert cut.wait_exit(120) in (2, 3), cut.output()
    assert "refuse: " in cut.output()
    # ... and the restored bytes answer again
    shutil.copyfile(intact, model)
    with native_process(model, fork, tmp_path / "again") as again:
        status, raw = post(again.port, "/v1/chat/completions", CHAT)
        assert status == 200 and b"bankml_receipt" in raw


def test_sigterm_during_a_stream_ends_it_without_a_receipt(server: NativeProcess) -> None:
    body = {**CHAT, "max_tokens": 400, "stream": True, "messages": [
        {"role": "user", "content": "Write a long story about the sea."}]}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: "), first  # the answer has begun
    server.proc.send_signal(signal.SIGTERM)
    rest = b""
    try:
        while chunk := resp.read1(65536):
            rest += chunk
    except (http.client.IncompleteRead, ConnectionError) as cut:
        rest += getattr(cut, "partial", b"")
    conn.close()
    assert b"bankml_receipt" not in first + rest, "a receipt for a partial answer"
    assert b"[DONE]" not in rest
    assert server.wait_exit(60) == 128 + signal.SIGTERM


def test_a_crash_leaves_every_threads_stack_in_the_log(
    default_model: Path, default_fork: Path, tmp_path: Path
) -> None:
    """A fault in compiled code (a kernel, a native library) ends the process by its signal; the
    log then holds Python's stack of each thread, not nothing (tap._trace_crashes)."""
    with native_process(default_model, default_fork, tmp_path) as server:
        server.proc.send_signal(signal.SIGSEGV)
        assert server.wait_exit(60) == -signal.SIGSEGV
        log = server.output()
    assert "Fatal Python error: Segmentation fault" in log, log[-2000:]
    assert "most recent call first" in log and "twisted" in log, log[-2000:]


PR_CAPBSET_DROP = 24  # <linux/prctl.h>
CAP_DAC_OVERRIDE = 1  # <linux/capability.h>: root's right to write whatever the modes say


def without_dac_override() -> None:
    """In the child before exec: CAP_DAC_OVERRIDE out of the bounding set, so the program it
    execs has it in no set, even as root."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


def unwritable_for_children(directory: Path) -> None:
    """Skip unless a child started like the server (as root: without CAP_DAC_OVERRIDE) really
    cannot create a file in ``directory`` at mode 0555."""
    preexec = without_dac_override if os.geteuid() == 0 else None
    probe = directory / "probe"
    directory.chmod(0o555)
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import sys; open(sys.argv[1], 'x')", str(probe)],
            preexec_fn=preexec, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except subprocess.SubprocessError as err:  # prctl refused: no CAP_SETPCAP here
        pytest.skip(f"cannot start a process without CAP_DAC_OVERRIDE here: {err}")
    finally:
        directory.chmod(0o755)
    if done.returncode == 0:
        probe.unlink()
        pytest.skip("a 0555 directory is writable for this machine's processes")
    assert "PermissionError" in done.stderr, done.stderr


def slot_save(server: NativeProcess, filename: str) -> tuple[int, dict]:
    status, raw = post(server.engine_port, "/slots/0?action=save", {"filename": filename})
    return status, json.loads(raw)


def listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_save_into_a_read_only_slot_directory_is_500_and_leaves_the_slot_and_files(
    default_model: Path, tmp_path: Path
) -> None:
    server = native_process(default_model, support.DEFAULT_FORK, tmp_path / "run")
    slot_dir = tmp_path / "run" / "slots"
    unwritable_for_children(slot_dir)
    if os.geteuid() == 0:
        server.preexec = without_dac_override
    with server:
        if os.geteuid() == 0:  # the server really is without it
            status_lines = Path(f"/proc/{server.proc.pid}/status").read_text().splitlines()
            effective = next(line for line in status_lines if line.startswith("CapEff:"))
            assert not int(effective.split()[1], 16) & (1 << CAP_DAC_OVERRIDE)
        status, raw = post(server.port, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
        assert status == 200, raw
        status, before = slot_save(server, "before.bin")
        assert status == 200, before
        files = listing(slot_dir)
        slot_dir.chmod(0o555)
        try:
            status, refused = slot_save(server, "read-only.bin")
            files_while_read_only = listing(slot_dir)
        finally:
            slot_dir.chmod(0o755)
        assert status == 500, refused
        assert refused["error"]["message"] == "Unable to save slot: Permission denied"
        assert files_while_read_only == files, "a file was left (or changed) in the directory"
        assert listing(slot_dir) == files
        status, after = slot_save(server, "after.bin")
        assert status == 200 and after["n_saved"] == before["n_saved"], after
        assert (slot_dir / "after.bin").read_bytes() == files["before.bin"]
