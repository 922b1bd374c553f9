"""The engine's numerics against their references, for the oracle and agreement tests.

- ggml's kernels (tests/ggml_oracle.py): ``differing`` counts the elements whose bits differ;
  ``activations`` and ``random_blocks`` make operands as a model's are; ``ggml_reference`` runs
  ggml's flash attention on the engine's layout, K, V and the mask padded to the cells ggml sees.
- the real llama-server: ``compare_next_token`` (top-10 log-probabilities of the next token) and
  ``compare_greedy`` (greedy answers), the prompt evaluated in llama-server's micro-batches
  (``prefill``); token ids come from llama-server's /tokenize.
- one path against another, on the default model or a tiny one (``tiny``: tests/tiny_models.py's
  model, loaded): ``Rows`` fills pairs of caches with the same prompts (``token_ids``) and checks
  that a ``decode_batch`` row equals its one-row forward, logits and cache bytes (``kv_bytes``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy.engine import prompt_batches
from bankml.engine_cupy.kernels import exact_kquants as ek
from bankml.engine_cupy.kv_cache import KVCache
from bankml.engine_cupy.model import Model
from bankml.engine_cupy.sampler import token_logprobs
from tests import ggml_oracle, support
from tests.tiny_models import TinySpec, write_tiny_model

F32 = numpy.float32

# --- ggml's kernels -------------------------------------------------------------------------------


def differing(a: numpy.ndarray, b: numpy.ndarray) -> int:
    """Elements whose bits differ (so -0 vs +0 and NaN payloads count)."""
    a, b = numpy.ascontiguousarray(a, F32), numpy.ascontiguousarray(b, F32)
    assert a.shape == b.shape
    return int(numpy.count_nonzero(a.view(numpy.uint32) != b.view(numpy.uint32)))


def activations(rng: numpy.random.Generator, m: int, n: int) -> numpy.ndarray:
    """Hidden-state-like rows: N(0, 1) with some rows 30x wider and some 100x narrower."""
    scale = rng.choice(numpy.array([1, 30, 0.01], F32), size=(m, 1))
    return (rng.standard_normal((m, n)) * scale).astype(F32)


def random_blocks(rng: numpy.random.Generator, qtype: T, n_out: int, n_in: int) -> numpy.ndarray:
    """Valid K-quant rows (gguf cannot quantize to K types): random quants and packed scales,
    small positive f16 super-block scales (and mins for Q4_K), as real weights have."""
    nb = n_in // ek.QK_K
    raw = rng.integers(0, 256, (n_out, nb, ek._BLOCK_BYTES[qtype]), dtype=numpy.uint8)

    def halves(scale: float) -> numpy.ndarray:
        return (
            (rng.random((n_out, nb)) * scale + 1e-5)
            .astype(numpy.float16)
            .view(numpy.uint8)
            .reshape(n_out, nb, 2)
        )

    if qtype == T.Q6_K:
        raw[:, :, 208:210] = halves(0.004)
    elif qtype == T.Q3_K:  # hmask, qs, 12 bytes of 6-bit scales, then d
        raw[:, :, 108:110] = halves(0.004)
    elif qtype == T.Q2_K:  # 16 scale|min bytes, qs, then d and dmin
        raw[:, :, 80:82], raw[:, :, 82:84] = halves(0.01), halves(0.01)
    elif qtype == T.Q5_K:
        raw[:, :, 0:2], raw[:, :, 2:4] = halves(0.005), halves(0.005)
    else:
        raw[:, :, 0:2], raw[:, :, 2:4] = halves(0.01), halves(0.01)
    return raw.reshape(n_out, -1)


def ggml_reference(
    q: numpy.ndarray,
    k: numpy.ndarray,
    v: numpy.ndarray,
    mask: numpy.ndarray,
    scale: float,
    n_kv: int,
    threads: int = 2,
) -> numpy.ndarray:
    """ggml_flash_attn_ext on q [n, head, hd], k/v [kv_head, T, hd] padded to n_kv cells."""
    n_head_kv, n_cells, hd = k.shape
    kp = numpy.zeros((n_head_kv, n_kv, hd), numpy.float16)
    vp = numpy.zeros((n_head_kv, n_kv, hd), numpy.float16)
    kp[:, :n_cells], vp[:, :n_cells] = k, v
    mp = numpy.full((q.shape[0], n_kv), -numpy.inf, numpy.float16)
    mp[:, :n_cells] = mask
    out = ggml_oracle.flash_attn_ext(
        numpy.ascontiguousarray(q.transpose(1, 0, 2)), kp, vp, mp, scale, threads=threads
    )
    return out.reshape(q.shape)


# --- the real llama-server ------------------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n    ",
    "List three colours: red,",
    "The quick brown fox",
    "Water boils at a temperature of",
    "In 1969, the first person to walk on the Moon was",
    "import numpy as np\nx = np.",
    "Translate to French: good morning ->",
    "The sum of 17 and 25 is",
    "<|im_start|>user\nWhat is the largest planet?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Write a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nGive me a recipe for pancakes.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
    "SELECT name FROM users WHERE",
    "A haiku:\n",
    "Dear diary, today I",
    "The three laws of robotics are",
    "1, 2, 3, 4, 5,",
    "Bonjour, je m'appelle",
    "<|im_start|>user\nExplain recursion in one sentence.<|im_end|>\n<|im_start|>assistant\n",
    "The most important thing about machine learning is",
    "Emoji test: 🙂 🚀 and then",
    "   indented text with    many spaces   and",
]
GREEDY_TOKENS = 48
EOG = {0, 2}  # <|endoftext|> and <|im_end|> of the SmolLM2 vocabulary (also the tiny models')


def tokenize(server: support.LlamaServer, text: str) -> list[int]:
    status, body = support.http_json(
        server.url + "/tokenize", {"content": text, "parse_special": True}
    )
    assert status == 200, body
    return body["tokens"]


def server_next_token(server: support.LlamaServer, ids: list[int]) -> dict[int, float]:
    """llama-server's top-10 log-probabilities of the next token (raw logits, greedy)."""
    status, body = support.http_json(
        server.url + "/completion",
        {
            "prompt": ids,
            "n_predict": 1,
            "n_probs": 10,
            "temperature": 0,
            "cache_prompt": False,
            "post_sampling_probs": False,
        },
    )
    assert status == 200, body
    top = body["completion_probabilities"][0]["top_logprobs"]
    return {entry["id"]: entry["logprob"] for entry in top}


def server_greedy(server: support.LlamaServer, ids: list[int], n: int) -> list[int]:
    status, body = support.http_json(
        server.url + "/completion",
        {
            "prompt": ids,
            "n_predict": n,
            "temperature": 0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
        },
    )
    assert status == 200, body
    tokens = body["tokens"]
    # llama-server lists the end-of-generation token it stopped on; engine_greedy stops before it
    return tokens[:-1] if tokens and tokens[-1] in EOG else tokens


def log_softmax(logits: numpy.ndarray) -> numpy.ndarray:
    z = logits.astype(numpy.float64)
    z -= z.max()
    return z - numpy.log(numpy.exp(z).sum())


def prefill(model: Model, ids: list[int], cache: Any) -> numpy.ndarray:
    """The prompt evaluated in the micro-batches llama-server uses (engine.prompt_batches: for a
    sliding-window model the last 4 and 516 tokens go apart, which changes the kernels they
    meet); the last token's logits (a host row: a GPU model's logits are read back here)."""
    logits, start = None, cache.n_tokens
    for a, b in prompt_batches(start, start + len(ids), model.has_sliding_window):
        logits = model.forward(ids[a - start : b - start], cache)
    return numpy.asarray(logits)


def engine_greedy(
    model: Model, ids: list[int], n: int, cache_type: str | None = None, n_ctx: int | None = None
) -> list[int]:
    """Argmax decoding, stopping at an end-of-generation token as llama-server does (a cache of
    n_ctx cells, by default just the positions needed)."""
    cache = model.new_cache(n_ctx or len(ids) + n + 1, cache_type)
    logits = prefill(model, ids, cache)
    out: list[int] = []
    for _ in range(n):
        token = int(numpy.argmax(logits))
        if token in EOG:
            break
        out.append(token)
        if len(out) < n:
            logits = numpy.asarray(model.forward([token], cache))
    return out


def compare_next_token(
    model: Model,
    server: support.LlamaServer,
    prompts: list[list[int]],
    cache_type: str | None = None,
) -> tuple[float, int]:
    """(largest |logprob difference| over the server's top 10, prompts with the same top-1)."""
    worst, same_top1 = 0.0, 0
    for ids in prompts:
        theirs = server_next_token(server, ids)
        logits = prefill(model, ids, model.new_cache(len(ids) + 1, cache_type))
        ours = reported_logprobs(logits, theirs)
        worst = max(worst, max(abs(ours[t] - lp) for t, lp in theirs.items()))
        top1 = max(theirs, key=theirs.get)
        same_top1 += int(numpy.argmax(logits)) == top1
    return worst, same_top1


def reported_logprobs(logits: numpy.ndarray, theirs: dict[int, float]) -> dict[int, float]:
    """Our log-probabilities of the tokens llama-server listed, normalised as llama-server does
    (float softmax over the sorted logits, sampler.token_logprobs), so that the difference
    measures the logits and not two ways of summing 49,152 exponentials."""
    probs = token_logprobs(logits, len(theirs), 0)
    listed = dict(probs.top)
    full = log_softmax(logits)
    return {t: math.log(listed[t]) if listed.get(t, 0) > 0 else float(full[t]) for t in theirs}


def compare_greedy(
    model: Model,
    server: support.LlamaServer,
    prompts: list[list[int]],
    n: int,
    cache_type: str | None = None,
) -> tuple[int, list[str]]:
    same, notes = 0, []
    for ids in prompts:
        theirs = server_greedy(server, ids, n)
        ours = engine_greedy(model, ids, n, cache_type)
        if ours == theirs:
            same += 1
        else:
            split = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                min(len(ours), len(theirs)),
            )
            notes.append(f"prompt of {len(ids)} tokens differs at token {split}")
    return same, notes


# --- one path against another ---------------------------------------------------------------------


def token_ids(model: Model, n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in numpy.random.default_rng(seed).integers(3, model.n_vocab, n)]


def tiny(spec: TinySpec, tiny_dir: Path, default_model: Path) -> Model:
    """``spec``'s model written in ``tiny_dir`` (the default model's vocabulary), loaded on the CPU."""
    path = write_tiny_model(tiny_dir / f"{spec.name}.gguf", spec, default_model)
    return Model.load(path, device="cpu", progress=False)


def kv_bytes(cache: KVCache, n_layer: int) -> list[bytes]:
    """Every byte a decode step may write: the whole position stores (or, for q8_0, the
    positions held), the ring's stores and the sliding-window cells' bookkeeping."""
    out: list[bytes] = []
    for il in range(n_layer):
        if cache.fused_decode:
            out += [a.tobytes() for a in cache.f16_cells(il)]
            if cache.in_ring(il):  # the ring's stores, whatever the last micro-batch's size
                out += [cache._ring_k[il].tobytes(), cache._ring_v[il].tobytes()]
    if not cache.fused_decode:
        for entry in cache.snapshot():
            parts = entry if isinstance(entry, tuple) else (entry,)
            out += [numpy.ascontiguousarray(p).tobytes() for p in parts]
    for cells in (cache.cells, cache.swa):  # the ring's (or the window's) bookkeeping
        if cells is not None:
            out += [cells.pos.tobytes(), int(cells.head).to_bytes(8, "little", signed=True)]
    return out


class Rows:
    """Pairs of caches filled by the same prompts: ``batch`` advanced by decode_batch, ``single``
    by one-row forwards."""

    def __init__(
        self,
        model: Model,
        lengths: Sequence[int],
        n_ctx: Sequence[int],
        cache_types: Sequence[str | None] | None = None,
    ):
        self.model = model
        cache_types = cache_types or [None] * len(lengths)
        self.batch = [model.new_cache(c, t) for c, t in zip(n_ctx, cache_types)]
        self.single = [model.new_cache(c, t) for c, t in zip(n_ctx, cache_types)]
        self.next = []
        for row, n in enumerate(lengths):
            prompt = token_ids(model, n, seed=row)
            for i in range(0, n, 512):
                model.forward(prompt[i : i + 512], self.batch[row])
                logits = model.forward(prompt[i : i + 512], self.single[row])
            self.next.append(int(numpy.argmax(logits)))

    def step(self, rows: Sequence[int]) -> None:
        """One decode_batch over ``rows`` against a forward per row; the next tokens greedy."""
        model = self.model
        tokens = [self.next[r] for r in rows]
        batched = model.decode_batch(tokens, [self.batch[r] for r in rows])
        assert batched.shape == (len(rows), model.n_vocab) and batched.dtype == numpy.float32
        for i, r in enumerate(rows):
            self.agree(r, [tokens[i]], batched[i])

    def agree(self, r: int, tokens: list[int], got: numpy.ndarray) -> None:
        """Row r's ``tokens`` by one forward on its single twin: the same logits as ``got``
        and the same cache bytes; its next token greedy."""
        single = self.model.forward(tokens, self.single[r])
        assert got.tobytes() == single.tobytes(), (
            f"row {r} ({len(tokens)} tokens to position {self.single[r].n_tokens - 1}): "
            f"largest difference {numpy.abs(got - single).max()}"
        )
        assert self.batch[r].n_tokens == self.single[r].n_tokens
        assert kv_bytes(self.batch[r], self.model.n_layer) == kv_bytes(
            self.single[r], self.model.n_layer
        ), f"row {r}: the caches differ"
        self.next[r] = int(numpy.argmax(single))
