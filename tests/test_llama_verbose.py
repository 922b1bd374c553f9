"""``-v``/``--verbose`` (and ``-lv`` above 9) on the drop-in: llama-server's server-wide default
of a request's ``verbose``, side by side with llama-server started with ``-v``, over real HTTP.

A request that says nothing gets ``__verbose`` on its answer, one that says ``"verbose": false``
does not, in both; the object has llama-server's keys and settings. The same pair, started with
``--tags``, lists the model's tags in /v1/models as llama-server does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bankml.serving.llama_flags import FlagError, dropin_argv, native_settings
from tests import support
from tests.dropin import call, running_dropin
from tests.native_support import assert_same_keys
from tests.support import free_port

FLAGS = ["-lv", "3", "-v", "--temp", "0", "--tags", "b, a,b"]  # the last wins: verbose


@pytest.fixture(scope="module")
def ports(
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[int, int]]:
    port = free_port()
    log = tmp_path_factory.mktemp("verbose") / "bankml.log"
    args = [
        *("--fork", str(default_fork), "-m", str(default_model)),
        *("--host", "127.0.0.1", "-t", "2", "-c", "2048", "-np", "1", "--no-webui"),
        *("--listen", f"127.0.0.1:{free_port()}"),
        *FLAGS,
    ]
    with support.LlamaServer(default_model, args=FLAGS, binary=llama_server_bin) as ref:
        with running_dropin(args, port, log):
            yield port, ref.port


CHAT: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 4,
    "cache_prompt": False,
}


def test_a_request_without_verbose_gets_llama_servers_verbose_object(
    ports: tuple[int, int],
) -> None:
    answers = [json.loads(call(port, "POST", "/v1/chat/completions", CHAT)[2]) for port in ports]
    ours, theirs = (a["__verbose"] for a in answers)
    assert_same_keys(ours, theirs)
    for key in ("content", "generation_settings", "prompt", "tokens_evaluated", "stop_type"):
        assert ours.get(key) == theirs.get(key), key


def test_a_request_may_still_turn_it_off(ports: tuple[int, int]) -> None:
    for path, body in (
        ("/v1/chat/completions", {**CHAT, "verbose": False}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "verbose": False}),
    ):
        answers = [json.loads(call(port, "POST", path, body)[2]) for port in ports]
        assert ["__verbose" in a for a in answers] == [False, False], path


def test_tags_are_listed_as_llama_servers(ports: tuple[int, int]) -> None:
    models = [json.loads(call(port, "GET", "/v1/models")[2])["data"][0] for port in ports]
    assert models[0]["tags"] == models[1]["tags"] == ["a", "b"]


def test_verbose_and_verbosity_read_as_llama_server_reads_them() -> None:
    def verbose(*flags: str) -> bool:
        argv, notes = dropin_argv(["-m", "m.gguf", *flags])
        assert notes == []
        names = [a for a in argv if a.startswith("--verbos")]
        options = {
            "verbose": "--verbose" in names,
            "verbosity": argv[argv.index("--verbosity") + 1] if "--verbosity" in names else None,
        }
        return bool(native_settings(options)["verbose"])

    assert verbose("-v") and verbose("--log-verbose") and verbose("-lv", "10")
    assert not verbose() and not verbose("-lv", "9") and not verbose("-v", "-lv", "3")
    assert verbose("--verbosity", "3", "--verbose")
    with pytest.raises(FlagError, match="not a number"):
        native_settings({"verbosity": "loud"})


def test_cache_idle_slots_as_llama_server_reads_it() -> None:
    """--cache-idle-slots (on by default; --no-cache-idle-slots and -cram 0 turn it off, the
    last of the pair given wins): with -kvu it decides which slots a request's embedding
    inputs take (Engine.clear_idle_slots, docs/modules/embeddings.md)."""

    def idle(*flags: str) -> bool:
        argv, notes = dropin_argv(["-m", "m.gguf", *flags])
        assert not notes
        names = [a.lstrip("-") for a in argv if a.startswith("--")]
        options: dict[str, Any] = {name: True for name in names}
        if "--cache-ram" in argv:
            options["cache-ram"] = argv[argv.index("--cache-ram") + 1]
        return bool(native_settings(options)["cache_idle_slots"])

    assert idle() and idle("--cache-idle-slots") and idle("-cram", "100")
    assert idle("--no-cache-idle-slots", "--cache-idle-slots")
    assert not idle("--no-cache-idle-slots") and not idle("-cram", "0")
    assert not idle("--cache-idle-slots", "--no-cache-idle-slots")
