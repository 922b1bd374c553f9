"""Completions on slots that share one cache (``-np 4 -kvu``, llama-server's own default ``-np``
auto), side by side with the real llama-server on the default model: each task's launch saves
the idle slots to the host prompt cache and clears them (``--cache-idle-slots``), so a
conversation continued after another one comes back from the host cache into the least
recently used slot, its cells after the other slot's, its new tokens in the cells the launch
frees before them. Without ``-kvu`` (``-np 2``) each launch saves the idle slots to the host
cache without clearing them, so another slot may load one later. The slot, the counts and the
logprobs are compared, the logprobs bit for bit."""

from __future__ import annotations

import json
from typing import Any

from tests.dropin import Pair, call, pair_fixture

kvu_pair = pair_fixture(["-np", "4", "-kvu"])
kvu_drafts_pair = pair_fixture(
    ["-np", "4", "-kvu", "--no-cache-idle-slots", "--spec-type", "ngram-simple"]
)
two_slots_pair = pair_fixture(["-np", "2"])


def completions(pair: Pair, prompt: str) -> tuple[Any, Any]:
    """The same greedy /completion on both; the two answers."""
    body = {"prompt": prompt, "n_predict": 3, "temperature": 0, "n_probs": 2}
    answers = []
    for port in pair.ports:
        status, _, raw = call(port, "POST", "/completion", body)
        assert status == 200
        answers.append(json.loads(raw))
    return answers[0], answers[1]


def logprobs(answer: Any) -> list[float]:
    return [p["logprob"] for p in answer["completion_probabilities"]]


def same_completion(pair: Pair, prompt: str) -> Any:
    """``completions``, both answers the same: text, slot, counts and logprobs bit for bit;
    llama-server's answer."""
    ours, theirs = completions(pair, prompt)
    assert ours["content"] == theirs["content"], prompt
    assert ours["id_slot"] == theirs["id_slot"], prompt
    for key in ("cache_n", "prompt_n"):
        assert ours["timings"][key] == theirs["timings"][key], (prompt, key)
    assert logprobs(ours) == logprobs(theirs), prompt
    return theirs


def test_interleaved_conversations_come_back_from_the_host_cache_as_llama_servers(
    kvu_pair: Pair,
) -> None:
    """Two prompts, then each continued: the first continuation finds every slot cleared,
    takes the least recently used one and loads its prompt from the host cache after the
    second prompt's cells; the launch then frees those, so its new tokens sit before the loaded
    ones and the attention walks them in that order. bankml takes the same slot and answers
    the same logprobs (before, it kept the first prompt in its slot: slot 3 against 1, the first
    logprob 0.03 off)."""
    cat = "Once upon a time a small cat sat on a warm mat. " * 3 + "The cat"
    owl = "An old owl lived in an oak and saw many things. " * 3 + "The owl liked"
    prompts = [cat, owl, cat + " looked at the moon and", owl + " to sing at night"]
    for n, prompt in enumerate(prompts):
        theirs = same_completion(kvu_pair, prompt)
        if n >= 2:  # the continuation reuses its prompt from the host cache
            assert theirs["timings"]["cache_n"] >= 40, n


def test_without_kvu_a_launch_saves_the_idle_slots_for_another_slot_as_llama_servers(
    two_slots_pair: Pair,
) -> None:
    """``-np 2``, no ``-kvu``: each task's launch saves the idle slots to the host prompt
    cache and leaves them as they are. A prompt that starts with the first one but is too long
    for the slot choice by similarity (14 of 194 tokens) goes to the least recently used slot,
    which holds another prompt, and loads the first one from the host cache there: 14 cached
    on both (the code before saved no idle slot: none cached, the first logprob 0.009 off)."""
    lamp = "The old lighthouse keeper climbed the stairs every evening to light the lamp."
    qubits = "Quantum computers use qubits that can exist in superpositions of states."
    storm = " Then a storm came over the sea and the waves grew tall and grey." * 12
    for prompt in [lamp, qubits, lamp + " It was", lamp + storm]:
        theirs = same_completion(two_slots_pair, prompt)
    assert (theirs["id_slot"], theirs["timings"]["cache_n"]) == (0, 14)


def test_drafts_take_the_shared_caches_cells_as_llama_servers(kvu_drafts_pair: Pair) -> None:
    """``-np 4 -kvu --no-cache-idle-slots --spec-type ngram-simple``: the idle slots keep their
    cells, so each prompt sits past the others' in the shared cache, and each check of a draft
    takes cells there that its rejected tokens give back. bankml's run follows the book as it
    drafts (Engine._set_cells_aside), so every answer is llama-server's: its tokens, the drafts
    accepted, and the logprobs of the tokens not drafted bit for bit (a drafted token has
    probability 1 on both). Before, a run that drafted was not followed: its prompt attended
    in position order, and the book was unknown after it."""
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    prompts = [
        "Once upon a time a small cat sat on a warm mat. " * 3 + "The cat",
        code * 3 + "def mul(a, b):\n",
        "An old owl lived in an oak and saw many things. " * 3 + "The owl liked",
        "Hello there, how are you doing today? I am fine, thank you.",
        # the least recently used slot (the cat's): its cells freed, fewer of them taken
        "The old lighthouse keeper climbed the stairs every evening to light the lamp.",
        # the code continued: its new tokens take cells the cat's gave back, before its own
        code * 3 + "def mul(a, b):\n    return a * b\n\n\ndef",
    ]
    accepted = 0
    for prompt in prompts:
        body = {"prompt": prompt, "n_predict": 24, "temperature": 0, "n_probs": 2}
        ours, theirs = (
            json.loads(call(port, "POST", "/completion", body)[2]) for port in kvu_drafts_pair.ports
        )
        assert ours["content"] == theirs["content"], prompt
        assert ours["id_slot"] == theirs["id_slot"], prompt
        for key in ("cache_n", "prompt_n", "draft_n", "draft_n_accepted"):
            assert ours["timings"].get(key) == theirs["timings"].get(key), (prompt, key)
        assert logprobs(ours) == logprobs(theirs), prompt
        accepted += theirs["timings"].get("draft_n_accepted", 0)
    assert accepted > 0
