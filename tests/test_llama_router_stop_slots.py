"""Router mode's stop-timeout with several slots (``-np 2``): at ``--models-max 1`` a request for
another model while the one resident model generates arms that model's stop-timeout, as
llama-server's router stops its least recently used instance to make room; its generation ends
with a 503 once the timeout runs out, then the model is unloaded and the other one is loaded
and answers (rather than the load waiting however long the generation runs)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_llama_router_stop import OTHER, state, stop_router, stopped_for_another_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[int]:
    """test_llama_router_stop's router with two slots (``-np 2``)."""
    with stop_router(tmp_path_factory.mktemp("router-stop-slots"), default_model, 2) as port:
        yield port


def test_with_several_slots_a_load_stops_the_generating_model_after_its_stop_timeout(
    server: int,
) -> None:
    stopped, why = stopped_for_another_model(server)
    assert stopped == 503, why
    error = json.loads(why)["error"]
    assert error["code"] == 503
    assert "another model was asked for" in error["message"]
    assert "stop-timeout of 1 s ran out" in error["message"]
    assert "bankml_receipt" not in json.loads(why)
    assert state(server) == "unloaded" and state(server, OTHER) == "loaded"
