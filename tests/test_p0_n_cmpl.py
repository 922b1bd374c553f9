"""P0 answers of several choices (``n``) and prompts, each with its own signed receipt.

A real ``bankml serve --spawn`` in front of the real llama-server started with ``-np 3`` (after
``--``), on the default model, asked over loopback. llama-server answers a request's prompts and
``n`` completions as tasks numbered ``p * n + j`` and seeds completion ``j`` with ``seed + j``.
Each answer's receipt names that seed (the request's, or the one bankml drew and forwarded),
the whole answer checks ``valid``, one choice's text changed is refused, and every answer
replays identically on the exact engine, one by one. On chat streams with ``include_usage``
each choice's usage event (it names no choice) carries that choice's receipt. A whole
``/v1/completions`` answer to several prompts reports the first prompt's usage only: the later
prompts' receipts name the counts bankml asked of llama-server's ``/tokenize``, the counts the
same request streamed reports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bankml.p0.answers import completion_prompts
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.keys import SigningKey, keygen
from bankml.receipts.replay import IDENTICAL, open_replay_engine, replay_in_process
from tests import support
from tests.bankml_process import post, spawned_p0
from tests.native_support import seeded_chat, sse_events
from tests.receipt_answers import edited

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

CHAT = "/v1/chat/completions"
PROMPTS = ["The capital of France is", "Once upon a time"]
# (name, path, body, answers): answers = prompts x n
CASES: list[tuple[str, str, dict[str, Any], int]] = [
    ("chat n 3 seeded", CHAT, seeded_chat(n=3), 3),
    (
        "chat n 3 seed drawn, streamed with usage",
        CHAT,
        {
            **{k: v for k, v in seeded_chat(n=3).items() if k != "seed"},
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        3,
    ),
    ("chat n 2 seeded, streamed", CHAT, seeded_chat(n=2, stream=True), 2),
    (
        "completions n 2",
        "/v1/completions",
        {"prompt": PROMPTS[0], "n": 2, "max_tokens": 8, "temperature": 0.9, "seed": 5},
        2,
    ),
    (
        "two prompts n 2, streamed",
        "/v1/completions",
        {"prompt": PROMPTS, "n": 2, "max_tokens": 8, "temperature": 0.9, "seed": 5, "stream": True},
        4,
    ),
    (
        "two prompts n 2",
        "/v1/completions",
        {"prompt": PROMPTS, "n": 2, "max_tokens": 8, "temperature": 0.9, "seed": 5},
        4,
    ),
    (
        "completion n_cmpl 2 streamed",
        "/completion",
        {
            "prompt": PROMPTS[1],
            "n_cmpl": 2,
            "n_predict": 8,
            "temperature": 0.9,
            "seed": 9,
            "stream": True,
        },
        2,
    ),
]


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return keygen(tmp_path_factory.mktemp("p0-n-key") / "receipt-key.pem")


@pytest.fixture(scope="module")
def answers(
    key: SigningKey,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> list[tuple[str, str, bytes, bytes, int]]:
    log = tmp_path_factory.mktemp("log") / "p0-n.log"
    out = []
    with spawned_p0(key, default_model, default_fork, llama_server_bin, log, ["-np", "3"]) as p0:
        for name, path, body, count in CASES:
            raw = json.dumps(body).encode()
            out.append((name, path, raw, post(p0, path, raw), count))
    return out


def receipts_of(path: str, answer: bytes) -> list[dict[str, Any]]:
    """Every receipt of the answer, in answer order."""
    if not answer.lstrip().startswith(b"data:"):
        obj = json.loads(answer)
        if isinstance(obj, list):  # /completion's array
            return [o["bankml_receipt"] for o in obj]
        found = obj["bankml_receipt"]
        return found if isinstance(found, list) else [found]
    found: dict[int, dict[str, Any]] = {}
    last = 0
    for e in sse_events(answer):
        if not isinstance(e, dict):
            continue
        choices = e.get("choices")
        if choices:
            last = choices[0]["index"]
        elif "index" in e:  # /completion's objects
            last = e["index"]
        # else a chat usage event: it follows the finish of the choice it counts
        if "bankml_receipt" in e:
            assert last not in found, "two receipts for one answer"
            found[last] = e["bankml_receipt"]
    return [found[i] for i in sorted(found)]


def change_answer_1(path: str, answer: bytes) -> bytes:
    """Answer 1's first piece of text with an X before it."""

    def edit(objects: list[dict[str, Any]]) -> None:
        for obj in objects:
            if path == "/completion":
                if obj.get("index") == 1 and obj.get("content"):
                    obj["content"] = "X" + obj["content"]
                    return
                continue
            for choice in obj.get("choices") or []:
                if choice.get("index") != 1:
                    continue
                holder = choice.get("message") or choice.get("delta") or choice
                key = "text" if "text" in holder else "content"
                if holder.get(key):
                    holder[key] = "X" + holder[key]
                    return
        raise AssertionError("answer 1 has no text to change")

    return edited(answer, edit)


def test_each_answer_has_its_receipt_naming_its_completions_seed(
    answers: list[tuple[str, str, bytes, bytes, int]],
) -> None:
    for name, path, raw, answer, count in answers:
        receipts = receipts_of(path, answer)
        assert len(receipts) == count, name
        n = json.loads(raw).get("n", json.loads(raw).get("n_cmpl", 1))
        asked = json.loads(raw).get("seed")
        first = receipts[0]["sampler"]["seed"]
        assert asked is None or first == asked, name
        assert [r["sampler"]["seed"] for r in receipts] == [
            (first + i % n) % 2**32 for i in range(count)
        ], name


def test_the_answers_are_valid_refused_when_one_changes_and_replay_identically(
    answers: list[tuple[str, str, bytes, bytes, int]],
    key: SigningKey,
    default_model: Path,
    default_fork: Path,
) -> None:
    first = receipts_of(answers[0][1], answers[0][3])[0]
    replay = open_replay_engine(str(default_model), str(default_fork), first)
    for name, path, raw, answer, count in answers:
        pem = key.public_key_pem
        verdict = check_receipt(raw, answer, pem, model_sha256=support.DEFAULT_SHA256)
        assert verdict == VALID, (name, verdict)
        changed = check_receipt(raw, change_answer_1(path, answer), pem)
        assert changed.startswith("refuse: answer 1:"), (name, changed)
        outcome = replay_in_process(raw, answer, replay)
        assert outcome.startswith(f"{IDENTICAL}: {count} answers"), (name, outcome)
        print(f"\n{name}: {count} answers valid and replayed identically")


def test_a_whole_answer_to_two_prompts_names_each_prompts_count(
    answers: list[tuple[str, str, bytes, bytes, int]],
) -> None:
    by_name = {name: receipts_of(path, answer) for name, path, _, answer, _ in answers}
    whole, streamed = by_name["two prompts n 2"], by_name["two prompts n 2, streamed"]
    counts = [r["prompt_tokens"] for r in whole]
    assert counts == [r["prompt_tokens"] for r in streamed], counts
    assert counts[0] == counts[1] and counts[2] == counts[3] and counts[0] != counts[2], counts
    assert completion_prompts(PROMPTS) == PROMPTS
    assert completion_prompts([1, "a"]) == [[1, "a"]]  # an integer in it: one mixed prompt
