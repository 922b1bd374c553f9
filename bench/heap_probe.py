#!/usr/bin/env python3
"""Run a Python module with glibc's heap figures sampled inside its process.

    bench/heap_probe.py OUT.jsonl -m MODULE [ARGS...]

A daemon thread appends one JSON line to OUT.jsonl every second: the wall time, RSS, and
`mallinfo2()`'s bytes in use (``uordblks``), free inside the heap (``fordblks``), the heap
(``arena``) and the mmapped blocks (``hblkhd``), all arenas summed, in MiB. bench/soak.py
starts its server through it with --heap-log, to tell a leak (bytes in use growing) from the
allocator keeping freed space (free bytes growing while those in use stay flat). glibc only.
"""

from __future__ import annotations

import ctypes
import json
import runpy
import sys
import threading
import time

MIB = 1024 * 1024


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def sample_forever(path: str, every_s: float = 1.0) -> None:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = MallInfo2
    with open(path, "a", buffering=1) as out:
        while True:
            info = mallinfo2()
            figures = {
                "at": round(time.time(), 2),
                "rss_mib": round(rss_bytes() / MIB, 1),
                "in_use_mib": round(info.uordblks / MIB, 1),
                "free_mib": round(info.fordblks / MIB, 1),
                "heap_mib": round(info.arena / MIB, 1),
                "mmapped_mib": round(info.hblkhd / MIB, 1),
            }
            out.write(json.dumps(figures) + "\n")
            time.sleep(every_s)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        raise SystemExit("usage: bench/heap_probe.py OUT.jsonl -m MODULE [ARGS...]")
    out, module, args = argv[0], argv[2], argv[3:]
    threading.Thread(target=sample_forever, args=(out,), daemon=True, name="heap-probe").start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
