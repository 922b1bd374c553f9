"""The host prompt cache: interleaved conversations keep their context, as llama-server's --cache-ram.

Side by side with the real llama-server (its --cache-ram is on by default): conversations A and B
interleaved through one slot (A1, B1, A2, B2); on the second turns both servers report how many
prompt tokens they reused (`timings.cache_n`). Without the host cache the slot would hold the
other conversation and only the shared system prompt could be reused. An entry counts the bytes
of llama-server's saved state (checked against the slot files llama-server writes), so the
entries a small ``--cache-ram`` keeps are llama-server's, and without a byte limit the cache
holds one context's tokens, as llama-server's.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy.engine import Engine
from bankml.engine_cupy.model import Model
from bankml.engine_cupy.prompt_cache import HostPromptCache, cache_ram_limit
from tests import support
from tests.dropin import Pair, call, pair_fixture
from tests.tiny_models import TinySpec, write_tiny_model

MAX = 8


@pytest.fixture(scope="module")
def engine(default_model) -> Engine:
    return Engine.open(default_model, n_ctx=2048, device="cpu")


def _turn(messages: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
    return messages + [{"role": "assistant", "content": answer}]


def _engine_chat(engine: Engine, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    req = engine.parse_request({"messages": messages, "max_tokens": MAX, "temperature": 0}, "chat")
    steps = engine.run_steps(req)
    text = "".join(chunk.text for chunk in steps)
    return text, steps.summary.timings["cache_n"], steps.summary.prompt_tokens


def _server_chat(url: str, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    status, body = support.http_json(
        url + "/v1/chat/completions", {"messages": messages, "max_tokens": MAX, "temperature": 0}
    )
    assert status == 200, body
    return (
        body["choices"][0]["message"]["content"],
        body["timings"]["cache_n"],
        body["usage"]["prompt_tokens"],
    )


def _interleave(chat: Any) -> list[tuple[int, int]]:
    """A1, B1, A2, B2: (cache_n, prompt_tokens) of each turn."""
    a = [
        {"role": "system", "content": "Poet."},
        {"role": "user", "content": "Name three colours of the rainbow."},
    ]
    b = [
        {"role": "system", "content": "Geographer."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."},
    ]
    out = []
    a_answer, *rest = chat(a)
    out.append(tuple(rest))
    b_answer, *rest = chat(b)
    out.append(tuple(rest))
    a2 = _turn(a, a_answer) + [{"role": "user", "content": "And two more?"}]
    b2 = _turn(b, b_answer) + [{"role": "user", "content": "And of Italy?"}]
    out.append(tuple(chat(a2)[1:]))
    out.append(tuple(chat(b2)[1:]))
    return out


def test_interleaved_conversations_reuse_their_own_context(
    engine: Engine, reference_server
) -> None:
    engine.host_cache = HostPromptCache(cache_ram_limit("256"))
    ours = _interleave(lambda m: _engine_chat(engine, m))
    theirs = _interleave(lambda m: _server_chat(reference_server.url, m))
    print(f"\ncache_n, prompt_tokens per turn (A1 B1 A2 B2): bankml {ours}, llama-server {theirs}")
    (_, a1_prompt), (_, b1_prompt), (a2_cache, _), (b2_cache, _) = ours
    # the second turns reuse at least their whole first-turn prompt, not only the system prompt
    assert a2_cache >= a1_prompt and b2_cache >= b1_prompt
    assert len(engine.host_cache.entries) >= 1
    # llama-server decides the same, turn by turn (answers are MAX tokens long on both sides);
    # the first turn's reuse depends on what earlier tests left in each slot, so it is not compared
    assert ours[1:] == theirs[1:]


def test_a_shared_system_prompt_keeps_the_slot_as_llama_server_does(
    engine: Engine, reference_server
) -> None:
    """Conversations sharing SmolLM2's default system prompt share half the slot: the host cache
    does not run (LCP ≥ half the slot), exactly as llama-server decides."""
    engine.host_cache = HostPromptCache(cache_ram_limit("256"))

    def plain(chat: Any) -> list[tuple[int, int]]:
        a = [{"role": "user", "content": "Name three colours of the rainbow."}]
        b = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        a_answer, *first = chat(a)
        b_answer, *second = chat(b)
        third = chat(_turn(a, a_answer) + [{"role": "user", "content": "And two more?"}])[1:]
        return [tuple(first), tuple(second), tuple(third)]

    ours = plain(lambda m: _engine_chat(engine, m))
    theirs = plain(lambda m: _server_chat(reference_server.url, m))
    print(f"\nshared system prompt, cache_n per turn: bankml {ours}, llama-server {theirs}")
    assert [c for c, _ in ours][1:] == [c for c, _ in theirs][
        1:
    ]  # the first depends on earlier tests


def test_without_the_host_cache_only_the_shared_prefix_is_reused(engine: Engine) -> None:
    engine.host_cache = HostPromptCache(0)
    ours = _interleave(lambda m: _engine_chat(engine, m))
    (_, a1_prompt), _, (a2_cache, _), _ = ours
    assert a2_cache < a1_prompt  # the slot held B: the host cache is what made the difference


def _fresh_slot(engine: Engine) -> None:
    engine.slot_tokens, engine.cache.n_tokens = [], 0


def _kv_bytes(cache: Any) -> list[bytes]:
    """Every layer's K and V of positions 0..n_tokens-1, as bytes (quantized parts included)."""
    return [
        b"".join(np.ascontiguousarray(a).tobytes() for a in (e if isinstance(e, tuple) else (e,)))
        for e in cache.snapshot()
    ]


def _one_token(engine: Engine, tokens: list[int]) -> np.ndarray:
    """The logits of the last token evaluated again on the first len - 1 positions held."""
    engine.cache.truncate(len(tokens) - 1)
    return engine.model.forward(tokens[-1:], engine.cache)


def test_a_restored_entry_answers_as_a_fresh_prefill(engine: Engine) -> None:
    """The KV moved back from the host equals, bit for bit, the KV a fresh run of the same
    conversation computes on an empty slot, and one more token evaluated on each gives the same
    logits bit for bit."""
    # system prompts of their own: the default one would be a shared half, which keeps the slot
    a = [
        {"role": "system", "content": "Poet."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ]
    b = [
        {"role": "system", "content": "Counter."},
        {"role": "user", "content": "Count from one to five."},
    ]
    engine.host_cache = HostPromptCache(0)
    _fresh_slot(engine)
    _engine_chat(engine, a)
    a_tokens = list(engine.slot_tokens)
    assert engine.cache.n_tokens == len(a_tokens)
    fresh_kv = _kv_bytes(engine.cache)
    fresh_logits = _one_token(engine, a_tokens)

    engine.host_cache = HostPromptCache(cache_ram_limit("256"))
    _fresh_slot(engine)
    _engine_chat(engine, a)
    _engine_chat(engine, b)  # A's slot goes to the host, B's KV overwrites the slot
    assert [e.tokens for e in engine.host_cache.entries] == [a_tokens]
    engine._use_host_cache(engine.slots[0], a_tokens + [1])  # the engine's own path brings A back
    assert engine.slot_tokens == a_tokens and engine.cache.n_tokens == len(a_tokens)
    restored = _kv_bytes(engine.cache)
    differing = [i for i, (x, y) in enumerate(zip(restored, fresh_kv)) if x != y]
    assert len(restored) == len(fresh_kv) and not differing, f"K/V arrays not equal: {differing}"
    assert np.array_equal(_one_token(engine, a_tokens), fresh_logits)


def test_cache_ram_limits() -> None:
    assert cache_ram_limit("0") == 0
    assert cache_ram_limit("-1") is None
    assert cache_ram_limit("3") == cache_ram_limit(3) == 3 << 20
    assert 1 << 20 <= cache_ram_limit(None) <= 8192 << 20
    assert 1 << 20 <= cache_ram_limit("") <= 8192 << 20
    with pytest.raises(ValueError):
        cache_ram_limit("lots")


def test_an_entry_larger_than_the_limit_is_not_kept(engine: Engine) -> None:
    cache = HostPromptCache(1)  # one byte
    engine.slot_tokens, engine.cache.n_tokens = [], 0
    engine.model.forward([1, 2, 3], engine.cache)
    cache.save([1, 2, 3], engine.cache)
    assert cache.entries == []


# the state sizes llama-server's slot files hold: (flags, streams its cache has, cache type)
STATE_CASES = [
    ("-np 1", 1, None),
    ("-np 2", 2, None),
    ("-np 2 -kvu", 1, None),
    ("-ctk q8_0 -ctv q8_0", 1, "q8_0"),
]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def _saved_state(model: Path, flags: str, tmp_path: Path) -> tuple[int, int]:
    """A greedy completion on llama-server started with ``flags``, its slot saved: the file's
    state bytes (past the magic, version and tokens) and the cells of its first cache."""
    args = [*flags.split(), "--slot-save-path", str(tmp_path)]
    with support.LlamaServer(model, args=args) as ref:
        body = {"prompt": PROMPT, "n_predict": 4, "temperature": 0}
        status, answer = support.http_json(ref.url + "/completion", body)
        assert status == 200, answer
        status, saved = support.http_json(
            f"{ref.url}/slots/{answer['id_slot']}?action=save", {"filename": "slot.bin"}
        )
        assert status == 200, saved
    data = (tmp_path / "slot.bin").read_bytes()
    n_tokens = struct.unpack_from("<I", data, 8)[0]
    state = data[12 + 4 * n_tokens :]
    n_streams = struct.unpack_from("<I", state, 0)[0]
    cells = struct.unpack_from(f"<{n_streams}I", state, 4)
    return len(state), max(cells)


@pytest.mark.parametrize("flags,n_streams,cache_type", STATE_CASES)
def test_an_entrys_bytes_are_llama_servers_saved_state(
    engine: Engine, default_model: Path, flags: str, n_streams: int, cache_type: Any, tmp_path: Path
) -> None:
    """``KVCache.state_nbytes`` is llama_state_seq_get_size: the state in llama-server's slot
    file, byte for byte, for one stream or one per slot, f16 or q8_0 cells."""
    nbytes, cells = _saved_state(default_model, flags, tmp_path)
    cache = engine.model.new_cache(2048, cache_type)
    cache.n_tokens = cells
    assert cells > 30 and cache.state_nbytes(n_streams) == nbytes


def test_a_sliding_window_entrys_bytes_are_llama_servers(
    default_model: Path, tmp_path: Path
) -> None:
    """gemma3: the full layers' cells, then the sliding layers' within the window."""
    path = write_tiny_model(tmp_path / "gemma3.gguf", TinySpec("gemma3", T.F32, 4), default_model)
    nbytes, cells = _saved_state(path, "-np 1", tmp_path)
    cache = Model.load(path, device="cpu", progress=False).new_cache(2048)
    cache.n_tokens = cells
    window = cache.swa.window
    assert cells > window and len(cache.swa.held()) == window
    assert cache.state_nbytes(1) == nbytes
    assert cache.state_nbytes(1, window_only=True) < nbytes // 4


# one slot, a 1 MiB cache: about 45 tokens of the default model's state (23 KiB a token)
small_cram_pair = pair_fixture(["-np", "1", "-cram", "1"])
# no byte limit: the token limit, the context's 256 positions
unlimited_cram_pair = pair_fixture(["-np", "1", "-cram", "-1", "-c", "256"])


def _cache_n_side_by_side(pair: Pair, prompt: str) -> int:
    body = {"prompt": prompt, "n_predict": 2, "temperature": 0}
    counts = []
    for port in pair.ports:
        status, _, raw = call(port, "POST", "/completion", body)
        assert status == 200, raw
        counts.append(json.loads(raw)["timings"]["cache_n"])
    assert counts[0] == counts[1], counts
    return int(counts[0])


def test_a_small_cache_ram_keeps_llama_servers_entries(small_cram_pair: Pair) -> None:
    """Three prompts of about 15 tokens through one slot, then the second continued: the
    entries saved on the way (about a third of a MiB each as llama-server counts them) fit
    in 1 MiB together, so the second comes back (its cells reused); counted as bankml holds
    them (f32, twice the bytes) saving the third would have pushed it out."""
    prompts = [
        "Alpha: the first conversation is about the sea and its tides.",
        "Beta: the second conversation is about mountains and snow.",
        "Gamma: the third conversation is about deserts and sand dunes.",
    ]
    assert [_cache_n_side_by_side(small_cram_pair, p) for p in prompts] == [0, 0, 0]
    assert _cache_n_side_by_side(small_cram_pair, prompts[1] + " And rivers?") > 10


def test_without_a_byte_limit_the_cache_holds_one_context(unlimited_cram_pair: Pair) -> None:
    """``-cram -1 -c 256``: two prompts of about 140 tokens fill more than the context, so
    the first entry goes when the second is saved, and is not there to come back."""
    first = "One two three four five six seven eight nine ten. " * 12
    second = "Red orange yellow green blue indigo violet pink. " * 14
    third = "A short third prompt."
    for prompt in (first, second, third):
        assert _cache_n_side_by_side(unlimited_cram_pair, prompt) == 0
    assert _cache_n_side_by_side(unlimited_cram_pair, first + " Eleven.") == 0
    # the second is still there (with the third and the first continued, over the limit
    # only once it has been taken back)
    assert _cache_n_side_by_side(unlimited_cram_pair, second + " Black.") > 100
