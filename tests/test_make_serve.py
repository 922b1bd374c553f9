"""`make serve`, the README's first command, serves the default model from bankml's own engine:
no llama-server is started, an answer carries a native receipt, and Ctrl-C stops it cleanly.

It runs the Makefile's real recipe (on free ports through LISTEN and UPSTREAM) with
``-o .venv/bin/bankml``: the virtual environment counts as built, so the test never reinstalls
it (under `make test` it is fresh anyway). The process helpers are tests/bankml_process.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil

from tests import support
from tests.bankml_process import BankmlProcess, chat_body, process_gone, sha


class MakeServe(BankmlProcess):
    """BankmlProcess whose command is `make serve`; started in its own process group, with SIGINT
    at its default, as a shell at a terminal starts it (so Ctrl-C reaches make and bankml)."""

    def command(self) -> list[str]:
        return [
            "make",
            "--no-print-directory",
            "-o",
            ".venv/bin/bankml",
            "serve",
            f"LISTEN=127.0.0.1:{self.port}",
            f"UPSTREAM=127.0.0.1:{support.free_port()}",
        ]

    def launch(self) -> MakeServe:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=support.ROOT,
                start_new_session=True,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
        return self


def test_make_serve_is_native_answers_with_a_receipt_and_stops_on_ctrl_c(
    tmp_path: Path, default_model: Path, default_fork: Path
) -> None:
    server = MakeServe(default_model, default_fork, [], tmp_path / "make-serve.log")
    try:
        server.start()
        status, info, _ = server.get("/bankml")
        assert status == 200 and info["mode"] == "native", info
        children = psutil.Process(server.proc.pid).children(recursive=True)
        shells = ("sh", "bash", "dash")  # make may run the recipe through a shell
        bankml = [p for p in children if "--native" in p.cmdline() and p.name() not in shells]
        assert len(bankml) == 1, [p.cmdline() for p in children]
        names = [p.name() for p in children]
        assert not any("llama-server" in n for n in names), names  # nothing else serves the model

        body = chat_body(False, max_tokens=3)
        status, raw, _ = server.post(body)
        assert status == 200, raw
        answer = json.loads(raw)
        receipt = answer["bankml_receipt"]
        assert receipt["engine"].startswith("bankml ") and "native" in receipt["engine"]
        assert receipt["model_sha256"] == support.DEFAULT_SHA256 and receipt[
            "request_sha256"
        ] == sha(body)
        assert receipt["response_sha256"] == sha(answer["choices"][0]["message"]["content"])

        os.killpg(server.proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
        server.wait_exit(30)
        assert process_gone(bankml[0].pid)
        assert "Received SIGINT, shutting down." in server.output()
        assert "Traceback" not in server.output()
    finally:
        server.stop()
