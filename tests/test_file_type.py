"""The model's file type (``/props`` model_ftype, ``/v1/models`` meta.ftype) as llama-server names
it: ``general.file_type`` when the header has it, else the loader's "(guessed)" commonest type.

Side by side with the real llama-server on files that tell the two rules apart: the Q4_K_M
requantization (mixed types, general.file_type 15), tiny models without general.file_type (an
all-F32 one among them) and the default model; then bankml --native serving the Q4_K_M and the
F32 files, whose /props and /v1/models must name and measure them as llama-server does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from gguf import GGMLQuantizationType as T
from twisted.internet import reactor
from twisted.internet.defer import maybeDeferred
from twisted.internet.threads import deferToThread

from bankml.engine_cupy.file_type import GUESSED, file_ftype_name, guess_ftype
from bankml.native.service import make_native_service
from tests import support
from tests.tiny_models import TinySpec, write_tiny_model

N_CTX = 2048  # support.LlamaServer's -c

# tiny models carry no general.file_type: llama-server guesses, and says so
TINY = {
    "f32": TinySpec("qwen3", T.F32),
    "iq4_nl": TinySpec("llama", T.IQ4_NL),
    "q4_k-untied": TinySpec("llama", T.Q4_K, tied=False, out_type=T.Q6_K),
}


def test_the_guess_counts_in_the_loaders_order_and_counts_the_norms() -> None:
    # layer order (blk.2 before blk.10), then name: Q4_0 reaches two first and wins the tie
    tensors = [("blk.10.a", "Q8_0"), ("blk.2.b", "Q4_0"), ("blk.10.b", "Q8_0"), ("c", "Q4_0")]
    assert guess_ftype(tensors) == 2 | GUESSED
    assert guess_ftype(reversed(tensors)) == 2 | GUESSED  # the order given does not matter
    # F32 norms are tensors like any other: the commonest type wins even when it is F32
    assert guess_ftype([("n1", "F32"), ("n2", "F32"), ("w", "Q4_0")]) == 0 | GUESSED


@pytest.fixture(scope="module")
def model_files(
    default_model: Path, default_model_q4_k_m: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    tiny_dir = tmp_path_factory.mktemp("file-type")
    files = {"default": default_model, "q4_k_m": default_model_q4_k_m}
    for key, spec in TINY.items():
        files[key] = write_tiny_model(tiny_dir / f"{spec.name}.gguf", spec, default_model)
    return files


def reference_names(server: support.LlamaServer) -> tuple[str, str]:
    status, props = support.http_json(server.url + "/props")
    assert status == 200, props
    status, models = support.http_json(server.url + "/v1/models")
    assert status == 200, models
    return props["model_ftype"], models["data"][0]["meta"]["ftype"]


@pytest.mark.parametrize("key", ["default", "q4_k_m", *TINY])
def test_file_type_is_named_as_llama_server_names_it(
    model_files: dict[str, Path], llama_server_bin: Path, key: str
) -> None:
    with support.LlamaServer(model_files[key], binary=llama_server_bin) as server:
        props_name, models_name = reference_names(server)
    assert props_name == models_name
    assert file_ftype_name(model_files[key]) == props_name, key


SERVED = ("q4_k_m", "f32")


@pytest.fixture(scope="module")
def native_urls(
    model_files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """bankml --native on each SERVED file (pinned in a FORK.json of its own): engine addresses."""
    services: list[Any] = []
    urls = {}
    for key in SERVED:
        model = model_files[key]
        fork = tmp_path_factory.mktemp("fork") / "FORK.json"
        digest = hashlib.sha256(model.read_bytes()).hexdigest()
        fork.write_text(json.dumps({"files": [{"path": model.name, "sha256": digest}]}))
        svc = make_native_service(
            {
                "file": str(model),
                "fork": str(fork),
                "ctx": N_CTX,
                "device": "cpu",
                "listen": "127.0.0.1:0",
                "upstream": "127.0.0.1:0",
            },
            reactor,
        )
        svc.exit_at_interpreter_end = False
        svc.startService()
        pytest_twisted.blockon(svc.ready)
        services.append(svc)
        urls[key] = f"http://127.0.0.1:{svc.port_of(1)}"
    yield urls
    for svc in services:
        pytest_twisted.blockon(maybeDeferred(svc.stopService))


def names_and_meta(url: str) -> tuple[str, dict[str, Any]]:
    """/props model_ftype and /v1/models meta; blocking (run it in a thread)."""
    status, props = support.http_json(url + "/props")
    assert status == 200, props
    status, models = support.http_json(url + "/v1/models")
    assert status == 200, models
    return props["model_ftype"], models["data"][0]["meta"]


@pytest.mark.parametrize("key", SERVED)
@pytest_twisted.ensureDeferred
async def test_served_props_and_models_name_and_measure_the_file_as_llama_server(
    model_files: dict[str, Path], llama_server_bin: Path, native_urls: dict[str, str], key: str
) -> None:
    ours = await deferToThread(names_and_meta, native_urls[key])
    with support.LlamaServer(model_files[key], binary=llama_server_bin) as server:
        theirs = await deferToThread(names_and_meta, server.url)
    # the name, and vocab, n_ctx, n_ctx_train, n_embd, n_params, size, ftype
    assert ours == theirs
