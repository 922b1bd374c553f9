"""Speculative decoding (``--spec-type ngram-simple`` with its default sizes; ``ngram-map-k``,
``ngram-map-k4v`` and ``ngram-mod`` with small ones so that this short answer drafts) on the
drop-in, side by side with llama-server started with the same flags, over real HTTP on
loopback. The second request's shorter prompt makes the map kinds drop what the first left.

The prompt asks for a file to be copied, so the answer repeats the prompt and the slot's
history holds drafts. Every token, the drafted and accepted counts (``draft_n``,
``draft_n_accepted``), the logprob entries (a drafted token's probability 1 with no
candidates, as llama-server's) and the stream must be llama-server's, greedy and seeded.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from bankml.engine_cupy.speculative import (
    Followers,
    NgramCache,
    NgramMap,
    NgramMod,
    NgramSimple,
    accept_draft,
    ngram_simple_draft,
)
from bankml.serving.llama_flags import FlagError, native_settings
from tests.dropin import Pair, call, dropin_pair, pair_fixture
from tests.support import compiled_probe
from tests.test_context_shift import streamed

FLAGS = {
    "ngram-simple": ["-c", "2048", "--temp", "0", "--spec-type", "ngram-simple"],
    "ngram-mod": [
        *("-c", "2048", "--temp", "0", "--spec-type", "ngram-mod"),
        *("--spec-ngram-mod-n-match", "8", "--spec-ngram-mod-n-min", "4"),
        *("--spec-ngram-mod-n-max", "16"),
    ],
    "ngram-cache": ["-c", "2048", "--temp", "0", "--spec-type", "ngram-cache"],
    "ngram-map-k": [
        *("-c", "2048", "--temp", "0", "--spec-type", "ngram-map-k"),
        *("--spec-ngram-map-k-size-n", "4", "--spec-ngram-map-k-size-m", "12"),
    ],
    "ngram-map-k4v": [
        *("-c", "2048", "--temp", "0", "--spec-type", "ngram-map-k4v"),
        *("--spec-ngram-map-k4v-size-n", "4", "--spec-ngram-map-k4v-size-m", "8"),
    ],
}
CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n"
)
PROMPT = (
    f"Here is a Python file:\n```python\n{CODE}```\nThe same file again, unchanged:\n```python\n"
)
DRAFT_KEYS = ("draft_n", "draft_n_accepted")


@pytest.fixture(scope="module", params=sorted(FLAGS))
def pair(
    request: pytest.FixtureRequest,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("speculative") / "bankml.log"
    yield from dropin_pair(FLAGS[request.param], default_model, default_fork, llama_server_bin, log)


def drafter_independent(request: pytest.FixtureRequest) -> None:
    """How drafted tokens are streamed, listed and reported does not depend on which drafter
    drafted them: checked with ngram-simple and ngram-mod, not again for the other kinds."""
    if request.node.callspec.params["pair"] in ("ngram-map-k", "ngram-map-k4v", "ngram-cache"):
        pytest.skip("drafter-independent: checked with ngram-simple and ngram-mod")


def both(pair: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    answers = []
    for port in pair.ports:
        status, _, raw = call(port, "POST", "/completion", body)
        assert status == 200
        answers.append(json.loads(raw))
    return answers


def completion(**fields: Any) -> dict[str, Any]:
    return {
        "prompt": PROMPT,
        "n_predict": 100,
        "cache_prompt": False,
        "return_tokens": True,
        **fields,
    }


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}])
def test_a_drafted_answer_is_llama_servers(pair: Any, sampling: dict[str, Any]) -> None:
    ours, theirs = both(pair, completion(**sampling))
    assert ours["tokens"] == theirs["tokens"]
    assert ours["content"] == theirs["content"]
    drafted = {k: ours["timings"][k] for k in DRAFT_KEYS}
    assert drafted == {k: theirs["timings"][k] for k in DRAFT_KEYS}
    assert drafted["draft_n_accepted"] > 0  # drafts were checked and some taken


def test_drafted_tokens_logprob_entries(pair: Any, request: pytest.FixtureRequest) -> None:
    drafter_independent(request)
    ours, theirs = both(pair, completion(n_predict=60, n_probs=2))
    mine, reference = ours["completion_probabilities"], theirs["completion_probabilities"]
    assert [(e["id"], [t["id"] for t in e["top_logprobs"]]) for e in mine] == [
        (e["id"], [t["id"] for t in e["top_logprobs"]]) for e in reference
    ]
    assert any(not e["top_logprobs"] and e["logprob"] == 0.0 for e in mine)  # drafted ones
    assert [e["logprob"] for e in mine] == [e["logprob"] for e in reference]


def test_a_drafted_stream_is_llama_servers(pair: Any, request: pytest.FixtureRequest) -> None:
    drafter_independent(request)
    body = completion(stream=True)
    ours, theirs = (call(port, "POST", "/completion", body)[2] for port in pair.ports)
    assert streamed(ours) == streamed(theirs)


def test_the_openai_client_reads_a_drafted_chat(pair: Any, request: pytest.FixtureRequest) -> None:
    drafter_independent(request)
    import openai

    question = [{"role": "user", "content": f"Copy this code exactly:\n{CODE}"}]
    answers = []
    for port in pair.ports:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        answer = client.chat.completions.create(
            model="default", messages=question, max_tokens=80, temperature=0
        )
        answers.append(answer.choices[0].message.content)
    assert answers[0] == answers[1]


def test_the_drafts_of_a_second_request_as_llama_servers(pair: Any) -> None:
    """ngram-mod's table outlives a request (one for the server); ngram-simple keeps nothing."""
    body = completion(prompt=PROMPT + CODE[:40], n_predict=48)
    ours, theirs = both(pair, body)
    assert ours["tokens"] == theirs["tokens"]
    assert {k: ours["timings"].get(k) for k in DRAFT_KEYS} == {
        k: theirs["timings"].get(k) for k in DRAFT_KEYS
    }


def test_the_slots_say_they_speculate(pair: Any, request: pytest.FixtureRequest) -> None:
    drafter_independent(request)
    for port in pair.ports:
        status, _, raw = call(port, "GET", "/slots")
        assert status == 200 and json.loads(raw)[0]["speculative"] is True


two_slots = pair_fixture(["-c", "2048", "-np", "2", "--temp", "0", "--spec-type", "ngram-simple"])


# Two prompts of one length (89 tokens): llama-server, with a KV stream per slot, cuts a batch
# into micro-batches with as many rows of each slot (split_equal). Prompts of unequal lengths sent
# at once would leave the longer one's last rows to a micro-batch of their own, under 64 rows, so
# on its one-row attention path: an answer that depends on the requests' arrival. Of equal
# lengths, both run whole on the tiled path (and a prompt that arrives a step late loses only its
# first row to a micro-batch beside the other slot's token, where attention over one cell is
# exact on either path), as each would alone.
LONGER_CODE = CODE + "\n\ndef div(a, b):\n    return a / b\n\n\ndef neg(a):\n    return -a\n"
TWO_PROMPTS = [
    PROMPT.replace(CODE, LONGER_CODE),
    PROMPT.replace(CODE, LONGER_CODE).replace("Python", "Ruby"),
]


def test_two_slots_drafting_at_once_answer_as_llama_server(two_slots: Pair) -> None:
    """Two requests at once on two slots, each drafting from its own history: the check passes
    run beside the other slot's steps, and each answer is still llama-server's."""
    bodies = [completion(prompt=prompt, n_predict=60) for prompt in TWO_PROMPTS]
    answers = []
    for port in two_slots.ports:
        with ThreadPoolExecutor(2) as pool:
            done = list(pool.map(call, [port] * 2, ["POST"] * 2, ["/completion"] * 2, bodies))
        assert all(status == 200 for status, _, _ in done)
        answers.append([json.loads(raw) for _, _, raw in done])
    ours, theirs = answers
    for mine, reference in zip(ours, theirs):
        assert mine["tokens"] == reference["tokens"]
        assert mine["timings"].get("draft_n_accepted") == reference["timings"].get(
            "draft_n_accepted"
        )
    assert {a["id_slot"] for a in ours} == {0, 1}  # both slots ran
    assert all(a["timings"]["draft_n_accepted"] > 0 for a in ours)  # and both drafted


# --- the parts, without a server --------------------------------------------------------------


def test_the_draft_is_what_followed_the_last_occurrence() -> None:
    config = NgramSimple(size_n=2, size_m=3)
    history = [9, 1, 2, 3, 4, 5, 6, 7, 1]
    assert ngram_simple_draft(config, history, 2) == [3, 4, 5]  # [1, 2] seen at 1
    assert ngram_simple_draft(config, history, 8) == []  # [1, 8] never seen
    assert ngram_simple_draft(config, [1, 2, 3, 4, 5], 2) == []  # too short a history
    # the match at position 0 never counts
    assert ngram_simple_draft(config, [1, 2, 3, 4, 5, 6, 7, 1], 2) == []


def test_a_draft_is_taken_until_a_draw_differs() -> None:
    def run(draws: list[int], draft: list[int]) -> tuple[list[int], list[int]]:
        rows = list(range(len(draft) + 1))
        seen: list[int] = []
        taken = accept_draft(lambda row: draws[row], seen.append, rows, draft, lambda t: t == 0)
        return taken, seen

    assert run([5, 6, 9], [5, 6]) == ([5, 6, 9], [5, 6, 9])  # all taken, one more drawn
    assert run([5, 7, 9], [5, 6]) == ([5, 7], [5, 7])  # the second differs
    assert run([0, 6, 9], [0, 6]) == ([0], [0])  # an end of generation ends the draft
    assert run([5, 0, 9], [5, 0]) == ([5, 0, 9], [5, 0, 9])  # unless it is the last drafted


def test_the_spec_flags_read_as_llama_servers() -> None:
    assert native_settings({})["speculative"] is None
    assert native_settings({"spec-type": "ngram-simple"})["speculative"] == {
        "ngram-simple": {"size_n": 12, "size_m": 48}
    }
    sizes = {"spec-type": "none,ngram-simple,ngram-mod", "spec-ngram-simple-size-n": "4"}
    assert native_settings(sizes)["speculative"] == {
        "ngram-simple": {"size_n": 4, "size_m": 48},
        "ngram-mod": {"n_match": 24, "n_max": 64, "n_min": 48},
    }
    assert native_settings({"spec-type": "ngram-map-k4v", "spec-ngram-map-k4v-min-hits": "3"})[
        "speculative"
    ] == {"ngram-map-k4v": {"size_n": 12, "size_m": 48, "min_hits": 3}}
    for refused in (
        {"spec-type": "ngram-lookup"},
        {"spec-type": "ngram-map-k", "spec-ngram-map-k-size-n": "0"},
        {"spec-type": "ngram-map-k4v", "spec-ngram-map-k4v-min-hits": "0"},
        {"spec-type": "ngram-mod", "spec-ngram-mod-n-match": "0"},
        {"spec-type": "ngram-mod", "spec-ngram-mod-n-max": "1025"},
        {"spec-type": "ngram-simple", "spec-ngram-simple-size-m": "0"},
        {"spec-type": "ngram-simple", "spec-ngram-simple-min-hits": "0"},
    ):
        with pytest.raises(FlagError):
            native_settings(refused)


def test_ngram_mod_follows_its_table_and_empties_after_five_poor_checks() -> None:
    mod = NgramMod(n_match=2, n_max=4, n_min=2, size=1 << 12)
    mod.begin(0, [5, 6, 7, 8, 9, 5, 6])  # 5 6 -> 7, 6 7 -> 8, 7 8 -> 9, 8 9 -> 5, 9 5 -> 6
    assert mod.draft(0, [1, 5], 6) == [7, 8, 9, 5]  # from [5, 6], four at most
    assert mod.draft(0, [1, 2], 3) == []  # [2, 3] never seen
    for _ in range(5):  # a quarter accepted or less, five times in a row
        assert mod.draft(0, [1, 5], 6)
        mod.accept(0, 0, is_other=False)
    assert mod.used == 0 and mod.draft(0, [1, 5], 6) == []


def test_ngram_map_k_drafts_as_much_as_its_key_last_had_accepted() -> None:
    keys = NgramMap(key_only=True, size_n=2, size_m=3)
    history = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1]
    keys.begin(0, history)
    assert keys.draft(0, history, 2) == [3, 4, 5]  # [1, 2] seen at 1
    keys.accept(0, 1, is_other=False)
    assert keys.draft(0, history, 2) == [3]  # one accepted last time: one drafted
    keys.accept(0, 0, is_other=False)
    assert keys.draft(0, history, 2) == []
    assert keys.draft(0, history, 7) == []  # [1, 7] never seen


def test_ngram_map_k4v_drafts_the_clearly_most_frequent_continuation() -> None:
    # after [1, 2]: [3, 3] twice, [4, 4] once; the key must be hit twice first
    history = [9, 1, 2, 3, 3, 1, 2, 4, 4, 1, 2, 3, 3, 0, 0, 0, 0, 0, 1]
    values = NgramMap(key_only=False, size_n=2, size_m=2, min_hits=2)
    values.begin(0, history)
    assert values.draft(0, history, 2) == []  # first hit of the key: under min_hits
    # second hit: [3, 3] twice, [4, 4] once: twice the others, so drafted
    assert values.draft(0, history, 2) == [3, 3]
    tied = NgramMap(key_only=False, size_n=2, size_m=2)
    tie = [9, 1, 2, 3, 3, 1, 2, 4, 4, 0, 0, 0, 0, 0, 1]
    tied.begin(0, tie)
    assert tied.draft(0, tie, 2) == []  # two continuations, once each
    clear = [9, 1, 2, 3, 3, 1, 2, 3, 3, 1, 2, 3, 3, 1, 2, 4, 4, 0, 0, 0, 0, 0, 1]
    dominant = NgramMap(key_only=False, size_n=2, size_m=2)
    dominant.begin(0, clear)
    assert dominant.draft(0, clear, 2) == [4, 4]  # drafts what followed the match found


ORDER_PROBE = r"""
#include <cstdio>
#include <unordered_map>
int main() {
    int n;
    while (scanf("%d", &n) == 1) {
        std::unordered_map<int, int> followers;
        for (int i = 0; i < n; i++) {
            int token;
            scanf("%d", &token);
            auto it = followers.find(token);
            if (it == followers.end()) followers.emplace(token, 1); else it->second++;
        }
        std::unordered_map<int, int> copy = followers;
        for (auto & p : copy) printf("%d ", p.first);
        printf("| %zu\n", copy.bucket_count());
    }
}
"""


def test_ngram_cache_followers_are_in_the_standard_librarys_order(tmp_path: Path) -> None:
    """A tie between two followers goes to the first in the C++ map's iteration order: the
    order kept here is the one the system's C++ standard library gives (the one llama-server
    is built with), through its rehashes, compared with a program compiled here."""
    import random

    probe = compiled_probe(tmp_path, ORDER_PROBE)
    rng = random.Random(7)
    runs = [[rng.randrange(60000) for _ in range(rng.randrange(1, 150))] for _ in range(20)]
    runs += [[rng.randrange(40) for _ in range(200)] for _ in range(5)]
    given = "\n".join(f"{len(r)} " + " ".join(map(str, r)) for r in runs)
    lines = subprocess.run(
        [str(probe)], input=given, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(lines) == len(runs)
    for run, line in zip(runs, lines):
        followers = Followers()
        for token in run:
            followers.add(token)
        order, buckets = line.split("|")
        assert followers.order == [int(t) for t in order.split()]
        assert followers.buckets == int(buckets)


def test_ngram_cache_drafts_the_clear_followers() -> None:
    cache = NgramCache()
    history = [5, 1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2]
    # after [.., 1, 2] the sampled 3: 3 -> 4 -> 9 -> 1 -> 2 -> 3 ... each seen twice
    assert cache.draft(0, history, 3) == [4, 9, 1, 2, 3, 4, 9, 1]
    assert NgramCache().draft(0, [7], 8) == []  # nothing seen twice
