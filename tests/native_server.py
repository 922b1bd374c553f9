"""A real `bankml serve --native` subprocess on free loopback ports, both addresses, a slot
directory, and the environment a test gives it (the fuzz, OpenAPI and soak tests use it)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.bankml_process import BankmlProcess
from tests.support import ROOT, free_port


@dataclass
class NativeProcess(BankmlProcess):
    engine_port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    preexec: Callable[[], None] | None = None  # run in the child before exec (tests' faults)

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    def command(self) -> list[str]:
        # the running interpreter, so the tree under test is the one imported
        return [sys.executable, "-m", "bankml", *super().command()[1:]]

    def launch(self) -> NativeProcess:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, **self.env},
                preexec_fn=self.preexec,
            )
        return self


def native_process(
    model: Path, fork: Path, directory: Path, env: dict[str, str] | None = None
) -> NativeProcess:
    """Not started: `with native_process(...) as server:` starts it and stops it (SIGTERM)."""
    slot_dir = directory / "slots"
    slot_dir.mkdir(parents=True, exist_ok=True)
    engine_port = free_port()
    return NativeProcess(
        model,
        fork,
        [
            *("--native", "--upstream", f"127.0.0.1:{engine_port}", "--slot-dir", str(slot_dir)),
            "--metrics",  # llama-server's: /metrics answers
        ],
        directory / "bankml.log",
        engine_port=engine_port,
        env=env or {},
    )
