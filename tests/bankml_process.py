"""`bankml serve` / `twistd -n bankml` as a real subprocess, for the end-to-end tests.

Ready means: GET /bankml answers on the listen address (bankml listens only after the file has
passed verify and the engine is up). The process's log goes to a file, read on failure.
``spawned_p0`` is ``bankml serve --spawn`` signing with a given key.

The checks of the receipts its answers carry are here too: recomputed from a chat answer's bytes
(``check_streamed_receipt``, ``check_whole_receipt``), by ``bankml check-receipt``
(``check_receipt_cli``), and as the official ``openai`` client reads a stream
(``canonical_stream``, then ``check_receipt_on_last_chunk``).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support import DEFAULT_SHA256, ROOT, free_port

if TYPE_CHECKING:
    from bankml.receipts.keys import SigningKey

BIN = ROOT / ".venv" / "bin"


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class BankmlProcess:
    model: Path
    fork: Path
    engine_args: list[str]  # ["--spawn", BIN, "--upstream", ADDR] or ["--upstream", ADDR]
    log: Path
    launcher: str = "serve"  # or "twistd"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    threads: int = 2  # llama-server's -t with --spawn
    llama_args: list[str] = field(default_factory=list)  # after ``--``: llama-server's own

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = [
            str(self.model),
            "--fork",
            str(self.fork),
            *self.engine_args,
            "--listen",
            f"127.0.0.1:{self.port}",
            "--threads",
            str(self.threads),
            "--ctx",
            "2048",
        ]
        if self.llama_args:
            args += ["--", *self.llama_args]
        if self.launcher == "twistd":
            pidfile = self.log.with_suffix(".pid")
            return [str(BIN / "twistd"), "-n", "--pidfile", str(pidfile), "bankml", *args]
        return [str(BIN / "bankml"), "serve", *args]

    def launch(self) -> BankmlProcess:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                # as from a terminal: a suite started as a shell's background job ignores
                # SIGINT, bankml would inherit that, and a SIGINT test could not stop it
                preexec_fn=_sigint_default,
            )
        return self

    def wait_ready(self, timeout: float = 600) -> BankmlProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bankml exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if self.get("/bankml")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"bankml was not ready in {timeout} s:\n{self.output()}")

    def start(self) -> BankmlProcess:
        return self.launch().wait_ready()

    def wait_exit(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self._dump_stacks_and_kill()
        return self.proc.returncode

    def _dump_stacks_and_kill(self) -> None:
        """A bankml that ignored its stop signal: SIGABRT first, so faulthandler (on in `bankml
        serve`) writes every thread's stack into the log the failing test prints; then SIGKILL
        if that did not end it. The exit status shows which (-6 or -9)."""
        self.proc.send_signal(signal.SIGABRT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> BankmlProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- HTTP, plain and blocking --------------------------------------------------------------

    def connection(self, timeout: float = 120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def get(self, path: str) -> tuple[int, Any, dict[str, str]]:
        conn = self.connection(10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, json.loads(raw or b"null"), dict(resp.getheaders())
        finally:
            conn.close()

    def post(self, body: bytes) -> tuple[int, bytes, dict[str, str]]:
        conn = self.connection()
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                body=body,
                headers={"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            return resp.status, resp.read(), dict(resp.getheaders())
        finally:
            conn.close()

    def engine_pid(self) -> int | None:
        return self.get("/bankml")[1]["engine"]["pid"]


def spawned_p0(
    key: SigningKey,
    model: Path,
    fork: Path,
    llama_server_bin: Path,
    log: Path,
    llama_args: Sequence[str] = (),
) -> BankmlProcess:
    """``bankml serve --spawn`` signing with ``key`` (a context manager: stopped on exit)."""
    engine = ["--spawn", str(llama_server_bin), "--upstream", f"127.0.0.1:{free_port()}"]
    engine += ["--receipt-key", str(key.path)]
    return BankmlProcess(model, fork, engine, log, llama_args=list(llama_args))


def post(p0: BankmlProcess, path: str, body: bytes) -> bytes:
    """The answer to a POST of ``body`` to ``path``, which must be 200."""
    conn = p0.connection()
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, raw[:300]
    return raw


def chat_body(
    stream: bool, content: str = "Say hello.", max_tokens: int = 12, **extra: Any
) -> bytes:
    return json.dumps(
        {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
            **extra,
        }
    ).encode()


def sse_events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e.strip()]


def check_streamed_receipt(raw: bytes, body: bytes, model_sha256: str) -> dict[str, Any]:
    """The receipt of a streamed answer, its hashes recomputed from the events: it rides in the
    last chunk before [DONE], and every chunk is a regular one (none holds only a receipt)."""
    events = sse_events(raw)
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(event[len(b"data: ") :]) for event in events[:-1]]
    assert all("choices" in obj for obj in chunks)
    assert [i for i, obj in enumerate(chunks) if "bankml_receipt" in obj] == [len(chunks) - 1]
    receipt = chunks[-1]["bankml_receipt"]
    text = ""
    for obj in chunks:
        for choice in obj.get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
    assert receipt["response_sha256"] == sha(text.encode("utf-8"))
    assert receipt["request_sha256"] == sha(body)
    assert receipt["model_sha256"] == model_sha256 and receipt["guard"] == "play"
    assert receipt["engine"].startswith("llama-server b") and receipt["signed"] is True
    assert isinstance(receipt["ttft_ms"], int) and receipt["wall_ms"] >= receipt["ttft_ms"]
    assert receipt["completion_tokens"] >= 1 and receipt["prompt_tokens"] >= 1
    return receipt


def check_whole_receipt(raw: bytes, body: bytes, model_sha256: str) -> dict[str, Any]:
    answer = json.loads(raw)
    receipt = answer["bankml_receipt"]
    content = answer["choices"][0]["message"]["content"]
    assert receipt["response_sha256"] == sha(content.encode("utf-8"))
    assert receipt["request_sha256"] == sha(body)
    assert receipt["model_sha256"] == model_sha256 and receipt["guard"] == "play"
    assert (receipt["prompt_tokens"], receipt["completion_tokens"]) == (
        answer["usage"]["prompt_tokens"],
        answer["usage"]["completion_tokens"],
    )
    assert receipt["engine"].startswith("llama-server b") and receipt["signed"] is True
    return receipt


# What the openai client tests ask (canonical_stream's request).
MESSAGES = [{"role": "user", "content": "Say hello."}]


def canonical_stream(client: Any, include_usage: bool, **extra: Any) -> tuple[str, Any]:
    """The loop every OpenAI example shows, ``chunk.choices[0].delta.content`` on each chunk (with
    ``include_usage``: on each chunk that has choices, the usage chunk having none); the text and
    the chunks. Raises if any event is not a regular chunk."""
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    stream = client.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=12, temperature=0, stream=True, **options, **extra
    )
    text, chunks = "", []
    for chunk in stream:
        chunks.append(chunk)
        if include_usage and chunk.usage is not None:
            assert chunk.choices == []
            continue
        text += chunk.choices[0].delta.content or ""
    return text, chunks


def check_receipt_on_last_chunk(text: str, chunks: list[Any], include_usage: bool) -> dict:
    """The receipt rides in the last chunk only (kept by the client as an extra field); checked
    against the text the loop read."""
    extras = [(chunk.model_extra or {}).get("bankml_receipt") for chunk in chunks]
    assert all(r is None for r in extras[:-1]) and extras[-1] is not None
    last = chunks[-1]
    receipt = last.to_dict()["bankml_receipt"]
    assert receipt == extras[-1]
    if include_usage:  # the usage chunk is the last
        assert last.choices == [] and last.usage.completion_tokens == receipt["completion_tokens"]
    else:
        assert last.choices[0].finish_reason in ("stop", "length")
    assert text and receipt["response_sha256"] == sha(text)
    assert receipt["model_sha256"] == DEFAULT_SHA256
    return receipt


def process_gone(pid: int, within: float = 15) -> bool:
    """Whether ``pid`` has ended (gone, or a zombie), waiting up to ``within`` s for it; with 0,
    whether it has ended already."""
    import psutil

    deadline = time.monotonic() + within
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def copy_and_pin(model: Path, directory: Path, name: str = "copy.gguf") -> tuple[Path, Path]:
    """A copy of `model` under another path, pinned in its own FORK.json (the real pin untouched)."""
    import shutil

    from bankml.gate.verify import pin

    directory.mkdir(parents=True, exist_ok=True)
    copy = directory / name
    shutil.copyfile(model, copy)
    fork = directory / (name + ".FORK.json")
    pin(copy, fork)
    return copy, fork


def env_pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def check_receipt_cli(
    directory: Path, request: bytes, response: bytes, public_key_pem: str, *extra: str
) -> tuple[int, str]:
    """(exit status, output) of ``bankml check-receipt`` on a request and response as they went
    over the wire, with the PEM public key (``GET /bankml/key``)."""
    import sys
    import tempfile

    work = Path(tempfile.mkdtemp(dir=directory))
    (work / "request.json").write_bytes(request)
    (work / "response").write_bytes(response)
    (work / "key.pem").write_text(public_key_pem)
    done = subprocess.run(
        [sys.executable, "-m", "bankml", "check-receipt", "--request", str(work / "request.json")]
        + ["--response", str(work / "response"), "--key", str(work / "key.pem"), *extra],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    return done.returncode, (done.stdout + done.stderr).strip()
