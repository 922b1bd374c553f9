"""``--context-shift`` on the drop-in, side by side with llama-server started with the same
flags, over real HTTP on loopback.

A 256-token context on the default model: generations that run past it shift the context
(keep ``n_keep``, drop ``n_discard`` or half of the rest, move the rest down, turn the moved
keys by RoPE) and go on. Every token and every logprob must be llama-server's, past one shift
and several, for the default ``n_keep``/``n_discard`` and for given ones, streamed and not, and
for the next request that reuses the shifted slot's prefix (its cells are no longer in position
order). Without the flag the same request stops at the context with ``truncated``.
"""

from __future__ import annotations

import json
from typing import Any

from tests.dropin import Pair, pair_fixture

N_CTX = 256
FLAGS = ["-c", str(N_CTX), "--temp", "0", "--context-shift"]
PROMPT = "Write a long list of fruits, one per line, with a short note on each:\n1."
# what must be equal between the two answers (timings and the model's path differ)
COMPARED = ("content", "tokens", "truncated", "stop_type", "tokens_predicted", "tokens_cached")


pair = pair_fixture(FLAGS)
q8_pair = pair_fixture([*FLAGS, "-ctk", "q8_0", "-ctv", "q8_0"])  # keys dequantized to turn
unshifted_pair = pair_fixture([f for f in FLAGS if f != "--context-shift"])


# every logprob is compared bit for bit: a K-shift rounded differently (RoPE without its
# fused multiply-adds) once moved them by 6.5e-3 within 5 tokens


def compared(raw: bytes) -> dict[str, Any]:
    """The answer's fields that must be equal; its logprobs rounded to the tolerance's side."""
    body = json.loads(raw)
    out = {k: body[k] for k in COMPARED}
    out["logprobs"] = [
        (p["id"], [t["id"] for t in p["top_logprobs"]]) for p in body["completion_probabilities"]
    ]
    out["logprob_values"] = [p["logprob"] for p in body["completion_probabilities"]]
    return out


def assert_same(ours: bytes, theirs: bytes) -> None:
    mine, reference = compared(ours), compared(theirs)
    values, reference_values = mine.pop("logprob_values"), reference.pop("logprob_values")
    assert mine == reference
    assert values == reference_values


def streamed(raw: bytes) -> list[dict[str, Any]]:
    """The stream's events, without timings."""
    events = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            event = json.loads(line[len("data: ") :])
            for key in ("timings", "generation_settings", "model", "prompt", "bankml_receipt"):
                event.pop(key, None)
            events.append(event)
    return events


def completion(n_predict: int, **fields: Any) -> dict[str, Any]:
    return {
        "prompt": PROMPT,
        "n_predict": n_predict,
        "ignore_eos": True,
        "n_probs": 2,
        "return_tokens": True,
        **fields,
    }


def test_a_generation_past_the_context_is_llama_servers(pair: Pair) -> None:
    """Past three shifts (half of what follows the prompt's first token dropped each time)."""
    ours, theirs = pair.both("POST", "/completion", completion(500, cache_prompt=False))
    assert ours[0] == theirs[0] == 200
    mine = json.loads(ours[1])
    assert mine["truncated"] is True and mine["tokens_predicted"] == 500
    assert mine["tokens_cached"] < N_CTX  # the context shifted, more than once
    assert_same(ours[1], theirs[1])


def test_the_next_request_reuses_the_shifted_slot_as_llama_server(pair: Pair) -> None:
    """The slot's cells are out of position order after a shift: a request that continues its
    tokens reuses them, and its new tokens fill the freed cells, as llama.cpp's do."""
    first = pair.both("POST", "/completion", completion(300))
    assert_same(first[0][1], first[1][1])
    again = pair.both("POST", "/completion", completion(60))
    assert_same(again[0][1], again[1][1])


def test_given_n_keep_and_n_discard_streamed(pair: Pair) -> None:
    body = completion(300, n_keep=-1, n_discard=17, stream=True, cache_prompt=False, n_probs=0)
    ours, theirs = pair.both("POST", "/completion", body)
    assert ours[0] == theirs[0] == 200
    assert streamed(ours[1]) == streamed(theirs[1])


def test_a_seeded_sampled_generation_past_the_context(pair: Pair) -> None:
    body = completion(400, temperature=0.8, seed=42, n_keep=5, cache_prompt=False)
    ours, theirs = pair.both("POST", "/completion", body)
    assert_same(ours[1], theirs[1])


def test_a_q8_0_cache_shifts_as_llama_servers(q8_pair: Pair) -> None:
    """The q8_0 keys are dequantized, turned back from their Hadamard rotation, turned by RoPE,
    rotated and quantized again, as llama.cpp's K-shift does."""
    ours, theirs = q8_pair.both("POST", "/completion", completion(400, cache_prompt=False))
    assert json.loads(ours[1])["tokens_cached"] < N_CTX
    assert_same(ours[1], theirs[1])


def test_without_the_flag_the_context_stops_the_answer(unshifted_pair: Pair) -> None:
    ours, theirs = unshifted_pair.both("POST", "/completion", completion(500, cache_prompt=False))
    mine = json.loads(ours[1])
    assert mine["truncated"] is True and mine["tokens_predicted"] < 500
    assert_same(ours[1], theirs[1])


def test_the_openai_client_reads_a_chat_past_the_context(pair: Pair) -> None:
    import openai

    question = [{"role": "user", "content": "Count from one to two hundred in words."}]
    answers = []
    for port in pair.ports:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        answer = client.chat.completions.create(
            model="default",
            messages=question,
            max_tokens=320,
            temperature=0,
            extra_body={"ignore_eos": True, "cache_prompt": False},
        )
        answers.append((answer.choices[0].message.content, answer.usage.completion_tokens))
    assert answers[0] == answers[1]
    assert answers[0][1] == 320  # past the 256-token context
