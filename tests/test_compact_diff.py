"""tests/compact_diff.py: a failed ``==`` between large values is explained in a few lines,
at once, even where pytest would diff the values in full (``CI`` set)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import support
from tests.compact_diff import explain

BIG = b"\x00" * 2_000_000


def test_large_values_get_their_first_difference() -> None:
    changed = BIG[:1_234_567] + b"\x01" + BIG[1_234_568:]
    lines = explain("==", (b"same", BIG), (b"same", changed))
    assert lines is not None and len(lines) == 2
    assert "first difference at index 1" in lines[1]
    lines = explain("==", BIG, changed)
    assert lines is not None and "index 1234567: 0 != 1" in lines[1]
    lines = explain("==", {"k": BIG, "v": 1}, {"k": changed, "v": 1})
    assert lines is not None and "first different key 'k'" in lines[1]
    lines = explain("==", list(range(10_000)), list(range(10_001)))
    assert lines is not None and "lengths 10000 and 10001" in lines[1]


def test_small_values_keep_pytests_explanation() -> None:
    assert explain("==", [1, 2, 3], [1, 2, 4]) is None
    assert explain("!=", BIG, BIG) is None


def test_a_failing_comparison_of_megabytes_fails_at_once_on_ci(tmp_path: Path) -> None:
    """With CI set pytest would ndiff the reprs (hours for these); the hook answers first."""
    test = tmp_path / "test_big.py"
    test.write_text(
        "def test_big():\n"
        "    a = b'\\x00' * 2_000_000\n"
        "    assert (a, 1) == (a[:-1] + b'\\x01', 1)\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider"]
        + ["-q", "--rootdir", str(tmp_path), str(test)],
        cwd=support.ROOT,
        env=dict(os.environ, CI="true"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "(reprs of" in done.stdout and "not diffed" in done.stdout, done.stdout
    assert "first difference at index 0" in done.stdout
    assert len(done.stdout) < 20_000
