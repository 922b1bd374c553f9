"""``POST /infill`` on the drop-in, side by side with llama-server started with the same flags,
over real HTTP on loopback.

The default model has no fill-in-the-middle tokens of its own (llama-server finds only
``<reponame>``): both refuse /infill on it with llama-server's 501. A copy of it whose metadata
names three of its control tokens as FIM prefix, suffix and middle and ``<file_sep>`` as the file
separator (``tokenizer.ggml.fim_*_token_id``) is the model the answers are compared on, with a
small context and batch (``-c 256 -b 64``) so that the prefix, the suffix and the extra context
are cut as llama-server cuts them. Every answer's tokens, text and prompt must be llama-server's,
streamed and not, greedy and seeded; bad bodies get llama-server's status and message; the
answer's receipt verifies with ``bankml check-receipt``; ``--spm-infill`` puts the suffix first
(on a copy without the file separator, whose extra files follow ``--- snippet ---`` lines).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bankml.gate.verify import pin
from tests.bankml_process import check_receipt_cli
from tests.dropin import Pair, call, dropin_pair, pair_fixture
from tests.gguf_bytes import kv_u32, with_kvs

# -n: with llama-server's default -1 the extra context it keeps (n_ctx - n_batch + 2) and a
# full prefix and suffix overflow the context together
FLAGS = ["-c", "256", "-b", "64", "-n", "16"]
# the default model's <jupyter_start>, <jupyter_text>, <jupyter_code> and <file_sep>
FIM_IDS = {"fim_pre": 11, "fim_suf": 12, "fim_mid": 13, "fim_sep": 5}
# what differs between the two answers by nature: the time taken, bankml's receipt, the model's
# name (bankml names the file)
UNCOMPARED = ("timings", "bankml_receipt", "model")

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n"
LONG_PREFIX = "".join(f"x{i} = {i} * {i}\n" for i in range(40)) + "def square(v):\n"
LONG_SUFFIX = "\n".join(f"print(square({i}))" for i in range(30))
EXTRA = [
    {"filename": "util.py", "text": "def add(a, b):\n    return a + b\n"},
    {"filename": "main.py", "text": "from util import add\nprint(add(1, 2))\n"},
]
LONG_EXTRA = [{"filename": f"m{i}.py", "text": LONG_PREFIX} for i in range(2)] + [{"text": CODE}]


def fim_model(directory: Path, default_model: Path, ids: dict[str, int]) -> tuple[Path, Path]:
    """The default model with FIM token ids in its metadata, pinned in its own FORK.json."""
    directory.mkdir(parents=True, exist_ok=True)
    model = directory / "fim.gguf"
    extra = [kv_u32(f"tokenizer.ggml.{role}_token_id", i) for role, i in ids.items()]
    model.write_bytes(with_kvs(default_model, extra))
    fork = directory / "fim.gguf.FORK.json"
    pin(model, fork)
    return model, fork


def fim_pair(flags: list[str], ids: dict[str, int]) -> Any:
    @pytest.fixture(scope="module")
    def fixture(
        default_model: Path, llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[Pair]:
        work = tmp_path_factory.mktemp("infill")
        model, fork = fim_model(work / "model", default_model, ids)
        yield from dropin_pair(flags, model, fork, llama_server_bin, work / "bankml.log")

    return fixture


pair = fim_pair(FLAGS, FIM_IDS)
# without a file separator token: each extra file after a "--- snippet ---" line
spm_pair = fim_pair([*FLAGS, "--spm-infill"], {k: v for k, v in FIM_IDS.items() if k != "fim_sep"})
plain_pair = pair_fixture(FLAGS)  # the default model: no FIM tokens


def answer(raw: bytes) -> dict[str, Any]:
    """The answer's fields that must be equal; its logprob values apart, in ``logprobs``."""
    body = json.loads(raw)
    for key in UNCOMPARED:
        body.pop(key, None)
    values = []
    for entry in body.get("completion_probabilities", []):
        for item in [entry, *entry["top_logprobs"]]:
            values.append(item.pop("logprob"))
    body["logprobs"] = values
    return body


def assert_same(ours: bytes, theirs: bytes) -> None:
    mine, reference = answer(ours), answer(theirs)
    values, reference_values = mine.pop("logprobs"), reference.pop("logprobs")
    assert mine == reference
    assert len(values) == len(reference_values)
    assert values == reference_values


def infill(**fields: Any) -> dict[str, Any]:
    return {"n_predict": 8, "temperature": 0, "return_tokens": True, "n_probs": 2, **fields}


BODIES = {
    "prefix and suffix": infill(input_prefix=CODE, input_suffix="\nprint(fibonacci(10))\n"),
    "two files of extra context": infill(
        input_prefix="result = add(", input_suffix=")\n", input_extra=EXTRA
    ),
    "a prompt after the prefix": infill(
        input_prefix=CODE, input_suffix="\n", prompt="    return fibonacci(n - 1) +"
    ),
    "prefix, suffix and extra cut to the batch and context": infill(
        input_prefix=LONG_PREFIX, input_suffix=LONG_SUFFIX, input_extra=LONG_EXTRA
    ),
    "a prompt that is not a string (none, as llama-server reads it)": infill(
        input_prefix=CODE, input_suffix="\n", prompt=5
    ),
    "token ids among the prefix": infill(input_prefix=["x = ", 16, "1"], input_suffix=[198]),
    "seeded sampling": infill(
        input_prefix=CODE, input_suffix="\n", temperature=0.9, seed=7, n_predict=12
    ),
}


@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
def test_an_infill_answer_is_llama_servers(pair: Pair, body: dict[str, Any]) -> None:
    (ours_status, ours), (theirs_status, theirs) = pair.both("POST", "/infill", body)
    assert (ours_status, theirs_status) == (200, 200), (ours, theirs)
    assert_same(ours, theirs)


def test_a_cut_prompt_is_shorter_than_its_parts(pair: Pair) -> None:
    """The long body is cut: fewer tokens evaluated than its prefix, suffix and extra hold."""
    body = BODIES["prefix, suffix and extra cut to the batch and context"]
    (_, ours), _ = pair.both("POST", "/tokenize", {"content": LONG_PREFIX + LONG_SUFFIX})
    status, _, raw = call(pair.ports[0], "POST", "/infill", body)
    assert status == 200
    assert json.loads(raw)["tokens_evaluated"] < len(json.loads(ours)["tokens"])


def events(raw: bytes) -> list[bytes]:
    return [line[6:].encode() for line in raw.decode().splitlines() if line.startswith("data: ")]


def test_a_streamed_infill_is_llama_servers(pair: Pair) -> None:
    body = {**BODIES["two files of extra context"], "stream": True}
    (_, ours), (_, theirs) = pair.both("POST", "/infill", body)
    assert len(events(ours)) == len(events(theirs)) > 2
    for mine, reference in zip(events(ours), events(theirs)):
        assert_same(mine, reference)


BAD = {
    "input_extra not a list": {"input_prefix": "a", "input_suffix": "b", "input_extra": {}},
    "a chunk without text": {
        "input_prefix": "a",
        "input_suffix": "b",
        "input_extra": [{"filename": "x.py"}],
    },
    "a chunk that is not an object": {"input_prefix": "a", "input_suffix": "b", "input_extra": [5]},
    "a filename that is not a string": {
        "input_prefix": "a",
        "input_suffix": "b",
        "input_extra": [{"text": "t", "filename": 3}],
    },
    "no prefix": {"input_suffix": "b"},
    "neither prefix nor suffix": {},
    "a prefix that is a number": {"input_prefix": 3, "input_suffix": "b"},
    "an object among the suffix": {"input_prefix": "a", "input_suffix": ["b", {}]},
    "a token id past the vocabulary": {"input_prefix": [10**7], "input_suffix": "b"},
    "a bad completion field": {"input_prefix": "a", "input_suffix": "b", "n_predict": "x"},
}


@pytest.mark.parametrize("body", BAD.values(), ids=BAD.keys())
def test_a_bad_infill_body_is_refused_as_llama_server_refuses_it(
    pair: Pair, body: dict[str, Any]
) -> None:
    (ours_status, ours), (theirs_status, theirs) = pair.both("POST", "/infill", body)
    assert 400 <= ours_status < 500
    assert (ours_status, json.loads(ours)) == (theirs_status, json.loads(theirs))


def test_a_model_without_fim_tokens_is_refused_as_llama_server_refuses_it(
    plain_pair: Pair,
) -> None:
    body = {"input_prefix": "a", "input_suffix": "b"}
    (ours_status, ours), (theirs_status, theirs) = plain_pair.both("POST", "/infill", body)
    assert ours_status == 501
    assert (ours_status, json.loads(ours)) == (theirs_status, json.loads(theirs))


def test_spm_infill_puts_the_suffix_first_as_llama_server(spm_pair: Pair) -> None:
    """With --spm-infill, on a model without a file separator token."""
    body = BODIES["two files of extra context"]
    (_, ours), (_, theirs) = spm_pair.both("POST", "/infill", body)
    assert_same(ours, theirs)
    prompt = json.loads(ours)["prompt"]
    assert prompt.index("<jupyter_text>") < prompt.index("<jupyter_start>")
    assert prompt.count("--- snippet ---") == 2 and "<file_sep>" not in prompt


def test_an_infill_answer_has_a_receipt_that_verifies(pair: Pair, tmp_path: Path) -> None:
    body = BODIES["prefix and suffix"]
    request = json.dumps(body).encode()
    port = pair.ports[0]
    status, _, raw = call(port, "POST", "/infill", body)
    assert status == 200 and "bankml_receipt" in json.loads(raw)
    key = json.loads(call(port, "GET", "/bankml/key")[2])["public_key"]
    code, out = check_receipt_cli(tmp_path, request, raw, key)
    assert code == 0, out
    code, out = check_receipt_cli(
        tmp_path, request, raw.replace(b'"content":"', b'"content":"x'), key
    )
    assert code != 0, out
