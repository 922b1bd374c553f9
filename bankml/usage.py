"""`/bankml/usage`: memory and CPU of bankml and its engine, and the GPUs where readable.

One sample takes two psutil readings 250 ms apart (the wait is a `deferLater`, never a sleep on
the reactor thread), and is kept for 1 s. Pollers that arrive while a sample is being taken wait
for that same sample; pollers within the second after it get the kept one. So however many
clients poll, bankml samples at most once a second.

Shape (read with psutil):
``{"source", "cores", "mem_total_bytes", "mem_available_bytes", "swap_total_bytes",
"swap_free_bytes", "rss_bytes", "cpu_percent", "interval_ms", "processes": [{"name", "pid",
"rss_bytes", "cpu_percent"}], "package_watts", "gpus", "sampled_at"}``.
CPU % is per core (100 = one core busy). `package_watts` is from Intel RAPL when readable, else
null; `gpus` is a list from `nvidia-smi` or amdgpu's sysfs files, or null when none is readable.
"""

from __future__ import annotations

import glob
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import psutil
from twisted.internet import task
from twisted.internet.defer import Deferred, inlineCallbacks, succeed
from twisted.internet.utils import getProcessOutput
from twisted.logger import Logger

_log = Logger(namespace="bankml.usage")

SAMPLE_SECONDS = 0.25
KEEP_SECONDS = 1.0
RAPL = "/sys/class/powercap/intel-rapl:0"
NVIDIA_QUERY = "index,name,utilization.gpu,memory.used,memory.total,power.draw"
MiB = 1024 * 1024

Named = list[tuple[str, int]]  # (name, pid) of the processes to report


def _cpu_seconds(proc: psutil.Process) -> float | None:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return None


def _rss(proc: psutil.Process) -> int | None:
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _rapl_uj() -> int | None:
    return _read_int(os.path.join(RAPL, "energy_uj"))


def _watts(before: int | None, after: int | None, seconds: float) -> float | None:
    if before is None or after is None or seconds <= 0:
        return None
    delta = after - before
    if delta < 0:  # the counter wrapped
        span = _read_int(os.path.join(RAPL, "max_energy_range_uj"))
        if span is None:
            return None
        delta += span
    return round(delta / 1e6 / seconds, 2)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_nvidia_smi(output: bytes) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-gpu=NVIDIA_QUERY --format=csv,noheader,nounits`."""
    gpus = []
    for row in output.decode("utf-8", "replace").splitlines():
        cols = [c.strip() for c in row.split(",")]
        if len(cols) != 6:
            continue
        used, total = _number(cols[3]), _number(cols[4])
        gpus.append(
            {
                "card": f"nvidia{cols[0]}",
                "driver": "nvidia",
                "name": cols[1],
                "busy_percent": _number(cols[2]),
                "vram_used_bytes": None if used is None else int(used * MiB),
                "vram_total_bytes": None if total is None else int(total * MiB),
                "gtt_used_bytes": None,
                "gtt_total_bytes": None,
                "watts": _number(cols[5]),
            }
        )
    return gpus


def amdgpu_sysfs() -> list[dict[str, Any]]:
    """amdgpu's figures from /sys/class/drm/cardN/device."""
    gpus = []
    for dev in sorted(glob.glob("/sys/class/drm/card[0-9]*/device")):
        busy = _read_int(os.path.join(dev, "gpu_busy_percent"))
        if busy is None:
            continue
        gpus.append(
            {
                "card": dev.split("/")[4],
                "driver": "amdgpu",
                "busy_percent": busy,
                "vram_used_bytes": _read_int(os.path.join(dev, "mem_info_vram_used")),
                "vram_total_bytes": _read_int(os.path.join(dev, "mem_info_vram_total")),
                "gtt_used_bytes": _read_int(os.path.join(dev, "mem_info_gtt_used")),
                "gtt_total_bytes": _read_int(os.path.join(dev, "mem_info_gtt_total")),
            }
        )
    return gpus


def listener_pid(host: str, port: int) -> int | None:
    """The pid listening on host:port (the `--upstream` llama-server bankml did not start), or
    None. One scan of the system's TCP sockets (~15 ms): callers keep the answer while the pid
    lives."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None
    for c in conns:
        if (
            c.status == psutil.CONN_LISTEN
            and c.laddr
            and c.laddr.port == port
            and c.pid
            and c.laddr.ip in (host, "0.0.0.0", "::")
        ):
            return c.pid
    return None


class EngineFinder:
    """(name, pid) pairs for the sampler: bankml itself and the engine, spawned or upstream."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway
        self.upstream_pid: int | None = None

    def __call__(self) -> Named:
        named = [("bankml serve", os.getpid())]
        pid = self.gateway.pid
        if pid is None and self.gateway.mode == "upstream":
            if self.upstream_pid is None or not psutil.pid_exists(self.upstream_pid):
                self.upstream_pid = listener_pid(*self.gateway.upstream)
            pid = self.upstream_pid
        if pid:
            named.append(("llama-server", pid))
        return named


class UsageSampler:
    """Samples at most once per `keep` seconds; concurrent callers share one sample."""

    def __init__(
        self,
        reactor: Any,
        processes: Callable[[], Named],
        interval: float = SAMPLE_SECONDS,
        keep: float = KEEP_SECONDS,
        prompt_cache: Callable[[], dict[str, Any]] | None = None,
        models: Callable[[], dict[str, Any] | None] | None = None,
    ) -> None:
        self.reactor = reactor
        self.processes = processes
        self.prompt_cache = prompt_cache  # native: the host prompt cache's size and bound
        # native with several models resident: each one's memory and counts (None: one model)
        self.models = models
        self.interval = interval
        self.keep = keep
        self.samples_taken = 0
        self._kept: dict[str, Any] | None = None
        self._kept_at = float("-inf")
        self._waiters: list[Deferred[dict[str, Any]]] | None = None
        self._nvidia_smi = shutil.which("nvidia-smi")

    def sample(self) -> Deferred[dict[str, Any]]:
        if self._kept is not None and self.reactor.seconds() - self._kept_at < self.keep:
            return succeed(self._kept)
        d: Deferred[dict[str, Any]] = Deferred()
        if self._waiters is not None:  # a sample is being taken: wait for it
            self._waiters.append(d)
            return d
        self._waiters = [d]
        self._take().addCallbacks(self._deliver, self._deliver_failure)
        return d

    def _deliver(self, result: dict[str, Any]) -> None:
        self._kept, self._kept_at = result, self.reactor.seconds()
        waiters, self._waiters = self._waiters or [], None
        for d in waiters:
            d.callback(result)

    def _deliver_failure(self, failure: Any) -> None:
        waiters, self._waiters = self._waiters or [], None
        for d in waiters:
            d.errback(failure)

    @inlineCallbacks
    def _take(self) -> Any:
        self.samples_taken += 1
        procs = []
        for name, pid in self.processes():
            try:
                procs.append((name, psutil.Process(pid)))
            except psutil.Error:
                continue  # gone: a dead pid is dropped
        cpu_before = [_cpu_seconds(p) for _, p in procs]
        energy_before = _rapl_uj()
        gpus_d = self._gpus()
        t0 = time.monotonic()
        yield task.deferLater(self.reactor, self.interval, lambda: None)
        elapsed = time.monotonic() - t0
        cpu_after = [_cpu_seconds(p) for _, p in procs]
        watts = _watts(energy_before, _rapl_uj(), elapsed)
        gpus = yield gpus_d
        return self._report(procs, cpu_before, cpu_after, elapsed, watts, gpus)

    def _gpus(self) -> Deferred[list[dict[str, Any]] | None]:
        if self._nvidia_smi:
            d = getProcessOutput(
                self._nvidia_smi,
                [f"--query-gpu={NVIDIA_QUERY}", "--format=csv,noheader,nounits"],
                env=os.environ,
                reactor=self.reactor,
            )
            d.addCallback(lambda out: parse_nvidia_smi(out) or None)
            d.addErrback(lambda f: _log.debug("nvidia-smi: {e}", e=f.getErrorMessage()) and None)
            return d
        return succeed(amdgpu_sysfs() or None)

    def _report(
        self,
        procs: list[tuple[str, psutil.Process]],
        before: list[float | None],
        after: list[float | None],
        elapsed: float,
        watts: float | None,
        gpus: list[dict[str, Any]] | None,
    ) -> dict[str, Any]:
        rows = []
        for (name, proc), b, a in zip(procs, before, after):
            rss = _rss(proc)
            if rss is None or b is None or a is None:
                continue
            rows.append(
                {
                    "name": name,
                    "pid": proc.pid,
                    "rss_bytes": rss,
                    "cpu_percent": round(max(a - b, 0.0) / elapsed * 100, 1),
                }
            )
        mem, swap = psutil.virtual_memory(), psutil.swap_memory()
        out = {
            "source": "bankml usage.py (psutil)",
            "cores": psutil.cpu_count(),
            "mem_total_bytes": mem.total,
            "mem_available_bytes": mem.available,
            "swap_total_bytes": swap.total,
            "swap_free_bytes": swap.free,
            "rss_bytes": sum(r["rss_bytes"] for r in rows),
            "cpu_percent": round(sum(r["cpu_percent"] for r in rows), 1),
            "interval_ms": round(elapsed * 1000),
            "processes": rows,
            "package_watts": watts,
            "gpus": gpus,
            # native: the host prompt cache; null in P0 (llama-server's is not visible)
            "prompt_cache": self.prompt_cache() if self.prompt_cache else None,
            "sampled_at": round(time.time(), 3),
        }
        models = self.models() if self.models is not None else None
        if models is not None:  # only with several models: one model's document is unchanged
            out["models"] = models
        return out
