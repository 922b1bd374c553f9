"""The bridge: FIFO engine thread, chunks back on the reactor, back-pressure, cancellation.

A scripted engine (``FakeEngine``, the same ``run_steps(request, cancelled)`` shape as
bankml.engine_cupy.engine.Engine) makes these fast and exact; the real Engine is driven through
the bridge at the end, and end to end over HTTP in test_native_serve.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from bankml.native.bridge import EngineBridge
from bankml.serving.run_control import ClientGone, RunControl
from bankml.serving.site import LoopbackSite, listen_loopback
from tests.events import HANG_GUARD_S, until


class FakeEngine:
    """run_steps yields ``n`` chunks of ``size`` bytes, ``delay`` seconds each, checking
    ``cancelled`` before each one as the real engine does; it records what it computed."""

    def __init__(self, delay: float = 0.0, size: int = 8) -> None:
        self.delay = delay
        self.size = size
        self.computed = 0
        self.order: list[str] = []
        self.threads: set[str] = set()
        self.stopped_by_cancel = threading.Event()

    def run_steps(self, name: str, n: int, cancelled: Callable[[], bool]) -> Iterator[bytes]:
        self.order.append(name)
        self.threads.add(threading.current_thread().name)
        for i in range(n):
            if cancelled():
                self.stopped_by_cancel.set()
                return f"{name}: cancelled at {i}"
            if self.delay:
                time.sleep(self.delay)
            self.computed += 1
            yield f"{name}:{i:05d}:".encode().ljust(self.size, b".")
        return f"{name}: done {n}"


class _WatchingCondition(threading.Condition):
    """RunControl's condition variable, noting each time the engine thread waited a whole slice
    on a paused client with nothing in flight and goes back to waiting: then the pause, and
    nothing else, holds it (a window with room would let it go on)."""

    def __init__(self, control: WatchedControl) -> None:
        super().__init__()
        self.control = control

    def wait(self, timeout: float | None = None) -> bool:
        control = self.control
        idle = control._in_flight == 0
        notified = super().wait(timeout)
        if idle and not notified and control._paused and not control._cancelled:
            control.held_at.append(control.steps)  # under the lock: the loop waits again
        return notified


class WatchedControl(RunControl):
    """A RunControl whose ``held_at`` lists the run's step count at each such wait, so a test
    sees the engine blocked by the pause as an event instead of sleeping and hoping."""

    def __init__(self, window: int) -> None:
        super().__init__(window)
        self.held_at: list[int] = []
        self._cond = _WatchingCondition(self)


async def held_twice(control: WatchedControl) -> list[int]:
    """Wait until the engine has waited out two slices on the pause; their step counts."""
    await until(lambda: len(control.held_at) >= 2, "the engine to block on the paused client")
    return control.held_at[:2]


@pytest.fixture
def bridge() -> Iterator[EngineBridge]:
    b = EngineBridge(reactor, window=4)
    yield b
    b.stop()


def steps_of(
    engine: FakeEngine, name: str, n: int
) -> Callable[[Callable[[], bool]], Iterator[bytes]]:
    return lambda cancelled: engine.run_steps(name, n, cancelled)


@pytest_twisted.ensureDeferred
async def test_runs_are_served_in_order_on_one_engine_thread(bridge: EngineBridge) -> None:
    engine = FakeEngine(delay=0.001)
    got: dict[str, list[bytes]] = {"a": [], "b": [], "c": []}
    on_reactor: list[bool] = []

    def sink(name: str) -> Callable[[bytes], None]:
        def deliver(item: bytes) -> None:
            on_reactor.append(threading.current_thread() is threading.main_thread())
            got[name].append(item)

        return deliver

    runs = [bridge.stream(steps_of(engine, name, 20), sink(name)) for name in "abc"]
    results = [await d for d in runs]
    assert results == ["a: done 20", "b: done 20", "c: done 20"]
    assert engine.order == ["a", "b", "c"]  # FIFO
    assert engine.threads == {"bankml-engine"}
    assert all(on_reactor) and len(on_reactor) == 60  # every chunk delivered on the reactor thread
    for name, items in got.items():
        assert items == [f"{name}:{i:05d}:".encode().ljust(8, b".") for i in range(20)]


@pytest_twisted.ensureDeferred
async def test_engine_calls_wait_their_turn_behind_a_run(bridge: EngineBridge) -> None:
    engine = FakeEngine(delay=0.002)
    seen: list[str] = []
    run = bridge.stream(steps_of(engine, "run", 30), lambda _: None)
    call = bridge.call(lambda: seen.append(f"call after {engine.computed}") or "ok")
    assert await call == "ok"
    assert seen == ["call after 30"]  # never in the middle of a run
    await run


@pytest_twisted.ensureDeferred
async def test_a_paused_client_blocks_the_engine_after_window_chunks(bridge: EngineBridge) -> None:
    engine = FakeEngine()
    control = WatchedControl(bridge.window)
    control.pauseProducing()  # the transport is full before the first chunk
    got: list[bytes] = []
    overruns: list[int] = []

    def deliver(item: bytes) -> None:
        got.append(item)
        if engine.computed - len(got) > control.window + 1:  # checked at every chunk
            overruns.append(engine.computed - len(got))
        if len(got) == 5:  # the transport fills again at the fifth chunk, before the run can
            # end (unpaced, the engine may send all 1000 within one poll of the test)
            control.held_at.clear()  # nothing is added while the client is not paused
            control.pauseProducing()

    d = bridge.stream(steps_of(engine, "slow", 1000), deliver, control)
    # Blocked: it computed the first chunk, waited a slice on the pause, and waits again.
    assert await held_twice(control) == [1, 1]
    assert engine.computed == 1 and got == []
    control.resumeProducing()
    await until(lambda: len(got) >= 5, "five chunks after the resume")  # paused again at five
    first, second = await held_twice(control)
    # Paused again: what was in flight was delivered, one more chunk was computed, and no
    # progress was made over a whole slice.
    assert first == second == engine.computed == len(got) + 1 < 1000
    control.resumeProducing()
    assert await d == "slow: done 1000"
    assert len(got) == 1000 and overruns == []


@pytest_twisted.ensureDeferred
async def test_cancel_stops_the_run_within_one_step(bridge: EngineBridge) -> None:
    engine = FakeEngine(delay=0.005)
    control = bridge.new_control()
    got: list[bytes] = []
    d = bridge.stream(steps_of(engine, "run", 100_000), got.append, control)
    await until(lambda: len(got) >= 10, "ten chunks")
    control.cancel()
    delivered_at_cancel = len(got)
    result = await d
    assert result.startswith("run: cancelled at")
    assert control.steps_at_cancel is not None
    assert control.steps - control.steps_at_cancel <= 1  # at most the step already under way
    # The result comes back through the same callFromThread queue as the chunks, after them:
    # every delivery the engine scheduled has run (or been dropped) by now.
    assert len(got) == delivered_at_cancel  # nothing delivered after the cancel


@pytest_twisted.ensureDeferred
async def test_a_job_whose_client_left_while_queued_is_skipped(bridge: EngineBridge) -> None:
    engine = FakeEngine()
    release = threading.Event()

    def held(cancelled: Callable[[], bool]) -> Iterator[bytes]:
        release.wait(HANG_GUARD_S)  # the first run holds the engine until the second is cancelled
        yield from engine.run_steps("first", 50, cancelled)

    first = bridge.stream(held, lambda _: None)
    control = bridge.new_control()
    second = bridge.stream(steps_of(engine, "second", 50), lambda _: None, control)
    control.cancel()
    release.set()
    await first
    with pytest.raises(ClientGone):
        await second
    assert engine.order == ["first"]


@pytest_twisted.ensureDeferred
async def test_an_engine_error_reaches_its_run_and_the_thread_lives_on(
    bridge: EngineBridge,
) -> None:
    def broken(cancelled: Callable[[], bool]) -> Iterator[int]:
        yield 1
        raise RuntimeError("kernel exploded")

    got: list[int] = []
    with pytest.raises(RuntimeError, match="kernel exploded"):
        await bridge.stream(broken, got.append)
    assert got == [1]
    assert await bridge.call(lambda: 42) == 42


@pytest_twisted.ensureDeferred
async def test_prepare_runs_while_the_engine_is_busy(bridge: EngineBridge) -> None:
    started, release, resumed = threading.Event(), threading.Event(), threading.Event()

    def held(cancelled: Callable[[], bool]) -> Iterator[bytes]:
        started.set()
        yield b"first"
        release.wait(HANG_GUARD_S)  # the run holds the engine thread until the test lets it go
        resumed.set()
        yield b"second"
        return "done"

    run = bridge.stream(held, lambda _: None)
    await deferToThread(started.wait, HANG_GUARD_S)
    # prepare answers while the run is held, not queued behind it (queued, it would run only
    # once the run resumed, and see it)
    assert await bridge.prepare(resumed.is_set) is False
    release.set()
    assert await run == "done"


def test_run_control_rejects_an_empty_window() -> None:
    with pytest.raises(ValueError):
        RunControl(0)


# --- over real HTTP: a slow reader and a client that leaves ------------------------------------------


class StreamRoot(Resource):
    """GET /stream -> the fake engine's chunks through the bridge, as the native resources do."""

    isLeaf = True

    def __init__(self, bridge: EngineBridge, engine: FakeEngine, n: int) -> None:
        super().__init__()
        self.bridge, self.engine, self.n = bridge, engine, n
        self.controls: list[WatchedControl] = []
        self.results: list[Deferred] = []

    def render_GET(self, request: Request) -> Any:
        control = WatchedControl(self.bridge.window)
        control.attach(request)
        self.controls.append(control)
        request.setHeader(b"content-type", b"text/event-stream")

        def finish(result: Any) -> Any:
            if not request.finished and not getattr(request, "_disconnected", False):
                request.unregisterProducer()
                request.finish()
            return result

        d = self.bridge.stream(steps_of(self.engine, "http", self.n), request.write, control)
        self.results.append(d.addBoth(finish))
        return NOT_DONE_YET


@pytest.fixture
def http_stream(bridge: EngineBridge) -> Iterator[tuple[StreamRoot, int]]:
    engine = FakeEngine(size=64 * 1024)  # 64 KiB chunks fill socket buffers quickly
    root = StreamRoot(bridge, engine, n=2000)  # 128 MiB if nothing pushed back
    port = listen_loopback(LoopbackSite(root), "127.0.0.1:0")
    yield root, port.getHost().port
    pytest_twisted.blockon(port.stopListening())


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    s.sendall(b"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return s


@pytest_twisted.ensureDeferred
async def test_a_client_that_does_not_read_pauses_the_engine(
    http_stream: tuple[StreamRoot, int],
) -> None:
    root, port = http_stream
    s = await deferToThread(_connect, port)
    try:
        await until(lambda: bool(root.controls), "the request to reach the resource")
        engine, control = root.engine, root.controls[0]
        first, second = await held_twice(control)  # the full transport paused it: blocked
        assert control.paused_count >= 1
        assert first == second == engine.computed < 200  # far short of the 2000 chunks
        # Reading resumes it: drain everything and the run completes.
        total = await deferToThread(_read_all, s)
        assert total > 2000 * 64 * 1024
        assert await root.results[0] == "http: done 2000"
    finally:
        s.close()


def _read_all(s: socket.socket) -> int:
    total = 0
    while True:
        data = s.recv(1 << 20)
        if not data:
            return total
        total += len(data)
        if total > 2000 * 64 * 1024 and b"0\r\n\r\n" in data[-16:]:
            return total


@pytest_twisted.ensureDeferred
async def test_a_client_that_leaves_stops_the_engine(http_stream: tuple[StreamRoot, int]) -> None:
    root, port = http_stream
    root.engine.delay = 0.002
    s = await deferToThread(_connect, port)
    await deferToThread(s.recv, 1024)  # the stream has begun
    s.close()
    result = await root.results[0]
    assert "cancelled" in result
    control = root.controls[0]
    assert control.steps - control.steps_at_cancel <= 1
    assert root.engine.computed < 2000
