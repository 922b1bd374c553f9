"""Router mode with several slots (``-np 2``): at ``--models-max 1`` a request for another model
while the one resident model generates waits beside that generation, which is answered in full;
then that model is unloaded and the other one loaded and answering (a load stops no generation:
only an unload arms the stop-timeout, as llama-server's router evicts only idle models)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_llama_router_stop import room_waits_for_the_generation, stop_router


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[int]:
    """test_llama_router_stop's router with two slots (``-np 2``)."""
    with stop_router(tmp_path_factory.mktemp("router-stop-slots"), default_model, 2) as port:
        yield port


def test_with_several_slots_a_load_waits_for_the_generating_model(server: int) -> None:
    answer = room_waits_for_the_generation(server)
    assert answer["bankml_receipt"]
