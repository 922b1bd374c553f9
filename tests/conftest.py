from __future__ import annotations

from pathlib import Path

import pytest

from tests import support


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    return support.llama_server_binary()


@pytest.fixture(scope="session")
def default_model() -> Path:
    return support.default_model()


@pytest.fixture(scope="session")
def default_fork(default_model: Path) -> Path:
    return support.DEFAULT_FORK


@pytest.fixture(scope="session")
def reference_server(default_model: Path, llama_server_bin: Path):
    """One real llama-server with the default model, shared by the tests that only read from it."""
    with support.LlamaServer(default_model, binary=llama_server_bin) as server:
        yield server
