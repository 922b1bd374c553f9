"""gemma3's sliding-window layers past llama-server's SWA cache size: bit for bit.

llama-server (-c 2048 -np 1, ubatch 512, no --swa-full) keeps gemma3's sliding-window layers in a
cache of GGML_PAD(min(2048, n_swa + 512), 256) cells (768 for the tiny model's window of 8) whose
cells are reused once their positions fall out of the window (llama_kv_cache::find_slot), so past
768 positions its cells are no longer in position order, and ggml's flash attention (an online
softmax over the cells in cell order) sums in another order. The tiny gemma3 model runs prompts
that end before, across and beyond that size and continues greedily past it; the engine's cache
must give the same logits (kv_cache.md, "The sliding-window ring").

The model's weights are F32: with quantized weights the activations are rounded to q8_0 before
each product, which hides most last-bit differences of attention (the Q5_0 tiny gemma3 gives the
same logits whatever the cell order); F32 products pass every bit on.
"""

from __future__ import annotations

from pathlib import Path

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy import kv_cache
from bankml.engine_cupy.engine import Engine, prompt_batches
from bankml.engine_cupy.model import Model
from tests import support
from tests.engine_checks import (
    engine_greedy,
    prefill,
    reported_logprobs,
    server_greedy,
    server_next_token,
)
from tests.tiny_models import TinySpec, write_tiny_model

N_CTX = 2048  # support.LlamaServer's -c
N_UBATCH = 512  # llama-server's default -ub
PROMPT_LENGTHS = (700, 760, 900, 1300)  # before, at and past the 768-cell SWA cache
GREEDY = 32


def server_prompt_batches(n: int) -> list[tuple[int, int]]:
    """The micro-batches llama-server evaluates an n-token prompt in for a sliding-window model
    (engine.prompt_batches: cut 516 and 4 tokens before the end, then 512 at a time)."""
    return prompt_batches(0, n, checkpoints=True)


def position_ordered_cache(model: Model, cache_type: str | None = None) -> kv_cache.KVCache:
    """The cache as it was before the ring: every layer's cells in position order."""
    hp = model.hp
    return kv_cache.KVCache(
        numpy,
        hp.n_layer,
        hp.n_head_kv,
        hp.head_dim,
        N_CTX,
        cache_type,
        window=hp.swa_window,
        sliding=hp.swa_layers,
        ring=False,
    )


def long_prompt(n: int, seed: int) -> list[int]:
    """n ordinary token ids (no control tokens) from the shared GPT-2 vocabulary."""
    return [int(t) for t in numpy.random.default_rng(seed).integers(300, 40000, size=n)]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    spec = TinySpec("gemma3", T.F32, n_layer=4)  # window 8, layers 0 and 2 sliding
    return write_tiny_model(tmp_path_factory.mktemp("swa") / "gemma3-swa.gguf", spec, default_model)


def test_server_prompt_batches() -> None:
    assert server_prompt_batches(10) == [(0, 6), (6, 10)]
    assert server_prompt_batches(900) == [(0, 384), (384, 896), (896, 900)]
    assert server_prompt_batches(1300) == [(0, 512), (512, 784), (784, 1296), (1296, 1300)]


@pytest.mark.llama_server
@pytest.mark.slow
def test_past_the_sliding_window_cache_as_llama_server(
    tiny_gemma3: Path, llama_server_bin: Path
) -> None:
    model = Model.load(tiny_gemma3, device="cpu", progress=False)
    prompts = [long_prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]
    worst, same_top1, same, notes = 0.0, 0, 0, []
    worst_plain = 0.0
    with support.LlamaServer(tiny_gemma3, binary=llama_server_bin) as server:
        for ids in prompts:
            theirs = server_next_token(server, ids)
            logits = prefill(model, ids, model.new_cache(N_CTX))
            worst = max(worst, logprob_gap(logits, theirs))
            same_top1 += int(numpy.argmax(logits)) == max(theirs, key=theirs.get)
            plain = prefill(model, ids, position_ordered_cache(model))
            worst_plain = max(worst_plain, logprob_gap(plain, theirs))
            want = server_greedy(server, ids, GREEDY)
            got = engine_greedy(model, ids, GREEDY, n_ctx=N_CTX)
            same += got == want
            if got != want:
                at = next(
                    (i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                    min(len(got), len(want)),
                )
                notes.append(f"{len(ids)}-token prompt differs at generated token {at}")
    print(
        f"\ngemma3 past the SWA cache: largest top-10 logprob difference {worst:.3e}, same "
        f"top-1 {same_top1}/{len(prompts)}, greedy {GREEDY} tokens {same}/{len(prompts)} "
        f"identical {notes}; cells in position order (before the ring): {worst_plain:.3e}"
    )
    assert same_top1 == len(prompts)
    assert worst <= 1e-5
    assert same == len(prompts)
    # the check can fail: the cache in position order sums in another order past 768 cells
    assert worst_plain > 1e-5


@pytest.mark.llama_server
@pytest.mark.slow
def test_the_engine_cuts_prompts_as_llama_server(tiny_gemma3: Path, llama_server_bin: Path) -> None:
    """Engine.run_steps (what bankml serve runs) splits a sliding-window model's prompt where
    llama-server does (its context checkpoints 516 and 4 tokens before the end), so the last
    tokens go through the same attention kernel: same answer, same top log-probabilities."""
    engine = Engine.open(tiny_gemma3, n_ctx=N_CTX, device="cpu")
    worst, same = 0.0, 0
    lengths = (100, 900)  # one cut (4 before the end), and both cuts past the 768-cell ring
    with support.LlamaServer(tiny_gemma3, binary=llama_server_bin) as server:
        for seed, n in enumerate(lengths):
            body = {
                "prompt": long_prompt(n, 20 + seed),
                "n_predict": GREEDY,
                "temperature": 0,
                "n_probs": 5,
                "cache_prompt": False,
            }
            status, theirs = support.http_json(
                server.url + "/completion", dict(body, return_tokens=True)
            )
            assert status == 200, theirs
            steps = engine.run_steps(engine.parse_request(dict(body), "completion"))
            chunks = list(steps)
            same += steps.summary.tokens == theirs["tokens"]  # the end-of-generation token too
            for mine, their in zip(chunks, theirs["completion_probabilities"]):
                top = {e["id"]: e["logprob"] for e in their["top_logprobs"]}
                for e in mine.entry["top_logprobs"]:
                    worst = max(worst, abs(e["logprob"] - top.get(e["id"], -numpy.inf)))
    print(
        f"\ngemma3 served prompts cut as llama-server: greedy {same}/{len(lengths)} identical, "
        f"largest top-5 logprob difference {worst:.3e}"
    )
    assert same == len(lengths)
    # uncut prompts were 7.1e-3 and 1.7e-2 off
    assert worst == 0.0


@pytest.mark.llama_server
@pytest.mark.slow
def test_q8_0_cache_past_the_sliding_window(tiny_gemma3: Path, llama_server_bin: Path) -> None:
    """The ring holds q8_0 blocks as well (--cache-type-k/v q8_0: Hadamard-turned, quantized)."""
    model = Model.load(tiny_gemma3, device="cpu", progress=False)
    worst, worst_plain, same = 0.0, 0.0, 0
    args = ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"]
    with support.LlamaServer(tiny_gemma3, binary=llama_server_bin, args=args) as server:
        for seed, n in ((2, 900), (3, 1300)):
            ids = long_prompt(n, seed)
            theirs = server_next_token(server, ids)
            worst = max(
                worst, logprob_gap(prefill(model, ids, model.new_cache(N_CTX, "q8_0")), theirs)
            )
            worst_plain = max(
                worst_plain,
                logprob_gap(prefill(model, ids, position_ordered_cache(model, "q8_0")), theirs),
            )
            same += engine_greedy(
                model, ids, GREEDY, cache_type="q8_0", n_ctx=N_CTX
            ) == server_greedy(server, ids, GREEDY)
    print(
        f"\nq8_0 cache past the SWA cache: largest top-10 logprob difference {worst:.3e}, "
        f"greedy {GREEDY} tokens {same}/2 identical; in position order: {worst_plain:.3e}"
    )
    assert worst <= 1e-5
    assert same == 2
    assert worst_plain > 1e-5


def logprob_gap(logits: numpy.ndarray, theirs: dict[int, float]) -> float:
    ours = reported_logprobs(logits, theirs)
    return max(abs(ours[t] - lp) for t, lp in theirs.items())


# --- the ring's bookkeeping, against llama_kv_cache's rules (no llama-server) -----------------


def test_ring_size_as_llama_kv_cache_iswa() -> None:
    assert kv_cache.ring_size(2048, 8) == 768  # llama-server logs "SWA KV cache, size = 768 cells"
    assert kv_cache.ring_size(4096, 512) == 1024  # gemma3's real window
    assert kv_cache.ring_size(300, 8) == 512  # n_ubatch capped by n_ctx, n_ctx padded to 256
    assert kv_cache.ring_size(2048, 4096) == 2048


def test_cells_reused_as_find_slot() -> None:
    cells = kv_cache.Cells(768, 8)
    placed = [cells.place(numpy.arange(a, b)) for a, b in server_prompt_batches(900)]
    assert list(placed[1][-128:]) == list(range(128))  # positions 768..895 wrap to cells 0..127
    assert cells.head == 132 and cells.n_kv() == 768 and cells.used_max_p1 == 768
    for p in range(900, 1700):  # decoding: position p in cell p mod 768
        assert cells.place(numpy.array([p]))[0] == p % 768
    mask = cells.mask(numpy.array([1699]))
    assert sorted(cells.pos[mask[0] == 0]) == list(range(1692, 1700))
    cells.remove_from(1650)  # seq_rm: cells of 1650.. emptied, the head back to the first freed
    assert cells.head == 1650 % 768 and (cells.pos < 1650).all()
    assert cells.place(numpy.array([1650]))[0] == 1650 % 768


def test_which_caches_keep_a_ring(tiny_gemma3: Path) -> None:
    model = Model.load(tiny_gemma3, device="cpu", progress=False)
    assert model.new_cache(500).cells is None  # its 512-cell SWA cache holds every position
    assert model.new_cache(N_CTX).cells.size == 768
    assert (
        Model.load(tiny_gemma3, device="cpu", progress=False, exact=False).new_cache(N_CTX).cells
        is None
    )


def test_restore_lays_the_ring_out_again(tiny_gemma3: Path) -> None:
    """A snapshot restore (and a slot restore, which sets n_tokens) fills the ring as llama.cpp
    reads a saved sequence back: state_write keeps only the cells not masked for the last
    position (its window), state_read places them from the first free cell. The steps after it
    attend over the same window, in another cell order and n_kv: close, not the same bits."""
    model = Model.load(tiny_gemma3, device="cpu", progress=False)
    ids = long_prompt(900, 5)
    cache = model.new_cache(N_CTX)
    prefill(model, ids, cache)
    saved = cache.snapshot()
    assert cache.pos_min == 900 - 768  # what llama-server checks before reusing a prefix
    assert list(cache.ring_positions()) == list(range(892, 900))  # in cells 124..131
    first = [model.forward([t], cache) for t in (11, 12, 13)]
    cache.truncate(0)
    cache.restore(saved, 900)
    assert list(cache.cells.pos[:8]) == list(range(892, 900)) and (cache.cells.pos[8:] < 0).all()
    assert cache.pos_min == 892
    again = [model.forward([t], cache) for t in (11, 12, 13)]
    assert all(numpy.abs(a - b).max() < 1e-3 for a, b in zip(first, again))
    cache.truncate(901)  # the window of 901 is still in the ring: only seq_rm
    assert cache.cells.holds(894, 901) and not (cache.cells.pos >= 901).any()


def test_ring_attention_is_ggml_flash_attention(
    tiny_gemma3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each attention of a 900-token prompt (the ring wraps inside its 512-row batch) equals
    ggml's own flash_attn_ext on the same cells, mask and n_kv (tests/ggml_oracle.py)."""
    from bankml.engine_cupy.kernels import exact_attention
    from tests.engine_checks import ggml_reference

    model = Model.load(tiny_gemma3, device="cpu", progress=False)
    # this checks the general path's calls; the fused decode step is checked equal to it,
    # ring included, in tests/test_decode_fast_path.py
    model.fused_decode = False
    calls = []
    kernel = exact_attention.flash_attn_f16

    def recorded(q, k, v, mask, scale, n_kv=None, n_threads=2, parallel=None):
        out = kernel(q, k, v, mask, scale, n_kv=n_kv, n_threads=n_threads, parallel=parallel)
        calls.append(
            (
                q.copy(),
                numpy.asarray(k, numpy.float16),
                numpy.asarray(v, numpy.float16),
                mask,
                scale,
                n_kv,
                out,
            )
        )
        return out

    monkeypatch.setattr(exact_attention, "flash_attn_f16", recorded)
    cache = model.new_cache(N_CTX)
    prefill(model, long_prompt(900, 9), cache)
    model.forward([7], cache)
    ring_calls = [c for c in calls if c[1].shape[1] == cache.cells.size]
    assert len(ring_calls) == 6  # 2 sliding layers x (512 rows, 4 rows, 1 row)
    for q, k, v, mask, scale, n_kv, out in calls:
        if mask is None:
            mask = numpy.zeros((q.shape[0], k.shape[1]), numpy.float32)
        want = ggml_reference(q, k, v, mask.astype(numpy.float16), scale, n_kv)
        assert (out.view(numpy.uint32) == want.view(numpy.uint32)).all(), (q.shape, k.shape, n_kv)
