"""The start-up's signal set-up (bankml/serving/startup.py): SIGHUP stops bankml by the signal,
and a SIGINT ignored at start (a shell's background job) is said in the log, since Twisted then
leaves it ignored. The whole stop by each signal runs in tests/test_serve_p0.py."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.logger import capturedLogs

from bankml.serving.startup import stop_on_sighup


class _Reactor:
    def __init__(self) -> None:
        self.calls: list[Any] = []
        self._exitSignal: int | None = None

    def stop(self) -> None:
        pass

    def callFromThread(self, f: Any) -> None:
        self.calls.append(f)


@pytest.fixture
def signals_restored() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _messages(reactor: _Reactor) -> list[str]:
    with capturedLogs() as events:
        stop_on_sighup(reactor)
    return [str(e.get("log_format", "")) for e in events]


@pytest.mark.parametrize("ignored", [True, False])
def test_an_ignored_sigint_is_said_in_the_log(signals_restored: None, ignored: bool) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
    said = any("SIGINT is ignored" in m for m in _messages(_Reactor()))
    assert said == ignored


def test_sighup_stops_the_reactor_by_the_signal(signals_restored: None) -> None:
    reactor = _Reactor()
    _messages(reactor)
    handler = signal.getsignal(signal.SIGHUP)
    assert callable(handler)
    handler(signal.SIGHUP, None)
    assert reactor._exitSignal == signal.SIGHUP and reactor.calls == [reactor.stop]
