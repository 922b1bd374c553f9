"""P0's ``--models-memory`` reckoning of a model: its file and the KV cache its llama-server
allocates, checked against the size the real llama-server reports for that cache (its
``llama_kv_cache: size = ... MiB`` line) on the same file, context and cache types."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from bankml.p0.models import llama_server_need
from bankml.registry.pins import discover
from tests.registry_support import pin_into
from tests.support import free_port
from tests.tiny_models import TinySpec, write_tiny_model

SIZE = re.compile(rb"llama_kv_cache: size = +([0-9.]+) MiB")


def reported_kv_mib(binary: Path, model: Path, args: list[str], log: Path) -> float:
    """The KV cache size llama-server reports at start for ``model`` with ``args``."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(binary), "-m", str(model), "--port", str(free_port()), "-t", "1", "-v", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        for _ in range(300):
            found = SIZE.search(log.read_bytes())
            if found:
                return float(found.group(1))
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        raise AssertionError(log.read_text())
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(
    ("ctx", "after"),
    [(1000, ["-ctk", "q8_0"]), (0, ["--cache-type-k", "q4_0", "-ctv", "q8_0"])],
)
def test_a_model_needs_its_file_and_the_kv_cache_llama_server_allocates(
    tmp_path: Path, default_model: Path, llama_server_bin: Path, ctx: int, after: list[str]
) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf", TinySpec("qwen3", T.Q4_0), default_model, 2)
    pin_into(tmp_path, model)
    pin = next(p for p in discover(str(tmp_path)).pins if p.path)
    need = llama_server_need({"ctx": ctx, "engine_args": after})(pin)
    kv = need - model.stat().st_size
    mib = reported_kv_mib(llama_server_bin, model, ["-c", str(ctx), *after], tmp_path / "l.log")
    assert kv > 0 and round(kv / 2**20, 2) == mib
