"""bankml.native.resident: a request read just before its model's keep-alive ran out runs on
the same file loaded again, never on no engine (``NativeEngine._engine_for``, the choice a run
makes on the engine thread as it starts). The states are set by hand here, as the reaper's
unload queued between a request's parse and its run leaves them; the served race itself is met
by tests/test_native_tool_calls.py's one-second keep-alive."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bankml.formats.errors import RETRY_AFTER_S, ApiError
from bankml.native.resident import NativeEngine

STARTUP = SimpleNamespace(sha256="a" * 64)
OTHER = SimpleNamespace(sha256="b" * 64)


def host_state(engine: Any, verified: Any, reloads: Any = None) -> SimpleNamespace:
    """A NativeEngine's fields that ``_engine_for`` reads; ``wake`` loads ``reloads`` (an
    engine and its file) when nothing is resident, as the Ollama host's wake loads the
    startup model."""
    state = SimpleNamespace(engine=engine, verified=verified, woken=0)

    def wake() -> None:
        state.woken += 1
        if state.engine is None and reloads is not None:
            state.engine, state.verified = reloads

    state.wake = wake
    return state


def engine_for(state: SimpleNamespace, engine: Any, read_for: Any) -> Any:
    return NativeEngine._engine_for(state, engine, read_for)  # type: ignore[arg-type]


def test_the_engine_the_request_was_read_by_runs_it() -> None:
    read_by = object()
    state = host_state(read_by, STARTUP)
    assert engine_for(state, read_by, (read_by, STARTUP)) is read_by
    assert state.woken == 0


def test_a_model_unloaded_after_the_parse_is_loaded_again_and_runs_it() -> None:
    read_by, reloaded = object(), object()
    state = host_state(None, STARTUP, reloads=(reloaded, STARTUP))  # unloaded: verified kept
    assert engine_for(state, read_by, (read_by, STARTUP)) is reloaded
    assert state.woken == 1


def test_the_same_file_loaded_again_by_another_request_runs_it() -> None:
    read_by, reloaded = object(), object()
    state = host_state(reloaded, STARTUP)
    assert engine_for(state, read_by, (read_by, STARTUP)) is reloaded


@pytest.mark.parametrize("resident", ["another model", "the startup model after another"])
def test_another_model_meanwhile_is_a_503_to_send_again(resident: str) -> None:
    read_by, other = object(), object()
    if resident == "another model":
        state = host_state(other, OTHER)
    else:  # read for OTHER, which was unloaded; waking loads the startup model
        state = host_state(None, OTHER, reloads=(other, STARTUP))
    with pytest.raises(ApiError) as refused:
        engine_for(state, read_by, (read_by, OTHER if resident != "another model" else STARTUP))
    assert (refused.value.status, refused.value.retry_after) == (503, RETRY_AFTER_S)
    assert "switched while this request waited" in refused.value.body["error"]["message"]


def test_no_model_to_load_again_is_a_503_not_a_run_on_nothing() -> None:
    state = host_state(None, STARTUP)  # unloaded, and nothing wakes it (no Ollama host)
    with pytest.raises(ApiError) as refused:
        engine_for(state, None, None)
    assert (refused.value.status, refused.value.retry_after) == (503, RETRY_AFTER_S)
