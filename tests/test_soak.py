"""bench/soak.py for one minute against its own `bankml serve --native` with an 8 MiB host
prompt cache, glibc's heap sampled inside it: no errors, and fds, threads and RSS flat between the
two quiet points (after the warm-up and after the load, each after the server's periodic heap
trim has run). RSS is taken less the memory the prompt cache holds (it fills up to its limit
by design) and less the free bytes the C heap gained (the allocator's slack, not bytes anyone
holds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

CACHE_RAM_MIB = 8  # small, so the cache is full within the warm-up


@pytest.mark.slow
def test_a_one_minute_soak_has_no_errors_and_flat_resources(
    default_model: object, tmp_path: Path
) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "1",
         "--cache-ram", str(CACHE_RAM_MIB), "--heap-log", str(tmp_path / "heap.jsonl")],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(figures))
    assert figures["requests"] > 0 and figures["samples"] >= 30
    assert figures["errors"] == 0, figures["error_examples"]
    assert figures["fd_growth"] <= 0, figures
    assert figures["thread_growth"] <= 0, figures
    # 3 % of today's ~315-350 MiB is the 2 % of ~400 MiB this bound was before the compile-only
    # memory was given back after warm-up: the same ~8-10 MiB. The free bytes glibc's heap
    # gained are taken out (bench/soak.py less_heap_slack): where the heap's top sits after a
    # trim moved a 1-minute soak's RSS by 3-6 % with its bytes in use flat
    assert figures["rss_growth_pct_less_heap_slack"] < 3.0, figures
    cache = figures["prompt_cache_end"]  # the bound the server reports is the one it was given
    assert cache["limit_bytes"] == CACHE_RAM_MIB * 1024 * 1024, cache
    assert 0 < cache["bytes"] <= cache["limit_bytes"] and cache["entries"] >= 1, cache
