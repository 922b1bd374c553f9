"""The sampler's compiled top-k (bankml/engine_cupy/sampler_kernels.py) against the NumPy path it
stands in for: the same candidates in the same order, and so the same draws, bit for bit.

Logits are drawn the way that stresses a top-k: real-sized vocabularies, values quantized so
that many are bit-equal (ties at and around the k-th place), signed zeros, infinities, NaN
(where the kernel must hand over to NumPy), and ascending runs. Whole chains (greedy, seeded
defaults, penalties, mirostat, logprobs) run twice per case, once with the kernel switched off.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest

from bankml.engine_cupy import sampler as S
from bankml.engine_cupy import sampler_kernels

N_VOCAB = 49_152


def tied_logits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Logits with many bit-equal values: a normal spread rounded to a coarse grid."""
    step = rng.choice([0.25, 0.5, 1.0, 2.0])
    logits = (np.round(rng.standard_normal(n) * 4 / step) * step).astype(np.float32)
    top = logits.max()
    for _ in range(int(rng.integers(0, 12))):  # extra copies of the largest values
        logits[int(rng.integers(0, n))] = top - step * int(rng.integers(0, 3))
    return logits


def odd_logits(rng: np.random.Generator, n: int) -> np.ndarray:
    logits = tied_logits(rng, n)
    kind = int(rng.integers(0, 6))
    picks = rng.integers(0, n, size=int(rng.integers(1, 60)))
    if kind == 0:
        logits[picks] = -np.inf  # banned tokens
    elif kind == 1:
        logits[picks] = np.inf
    elif kind == 2:
        logits[picks] = np.float32(-0.0)
        logits[picks[::2]] = np.float32(0.0)
    elif kind == 3:
        logits[picks] = np.nan
    elif kind == 4:
        logits = np.sort(logits)  # ascending: every logit enters the buffer
    else:
        logits[:] = np.float32(1.5)  # all equal
    return logits


@contextmanager
def numpy_top_k() -> Iterator[None]:
    """The sampler as it was before the kernel: every top-k by partition and stable sort."""
    saved = sampler_kernels.MAX_K
    sampler_kernels.MAX_K = 0
    try:
        yield
    finally:
        sampler_kernels.MAX_K = saved


def same_order(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("n", [7, 256, 300, N_VOCAB])
def test_kernel_order_equals_the_stable_partial_sort(n: int) -> None:
    rng = np.random.default_rng(n)
    for case in range(300 if n < N_VOCAB else 120):
        logits = odd_logits(rng, n) if case % 3 == 0 else tied_logits(rng, n)
        for k in (1, 2, 3, 40, 41, sampler_kernels.MAX_K, n - 1, n, n + 5):
            if k <= 0:
                continue
            got = S.top_k_order(logits, k)
            want = S._top_k_order_numpy(logits, k)
            assert same_order(got, want), (n, case, k)


def test_kernel_gives_up_on_nan_and_the_numpy_path_answers() -> None:
    logits = np.arange(1000, dtype=np.float32)
    logits[500] = np.nan
    order, ok = sampler_kernels.top_k_stable(logits, 40)
    assert not ok and len(order) == 0
    assert same_order(S.top_k_order(logits, 40), S._top_k_order_numpy(logits, 40))


def test_ties_at_the_kth_place_keep_vocabulary_order() -> None:
    logits = np.zeros(N_VOCAB, dtype=np.float32)
    logits[[9, 40_000, 3, 77]] = 2.0
    order = S.top_k_order(logits, 6)
    assert order.tolist() == [3, 9, 77, 40_000, 0, 1]


CHAINS = {
    "greedy": S.SamplerParams(temperature=0.0),
    "seeded": S.SamplerParams(),
    "hot": S.SamplerParams(temperature=1.5, top_k=100, top_p=0.99, min_p=0.0),
    "penalties": S.SamplerParams(repeat_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
    "typical": S.SamplerParams(typical_p=0.7, top_k=60),
    "xtc": S.SamplerParams(xtc_probability=0.8, xtc_threshold=0.05),
    "mirostat1": S.SamplerParams(mirostat=1),
    "mirostat2": S.SamplerParams(mirostat=2),
    "eog ban": S.SamplerParams(temperature=0.0, logit_bias=(S.LogitBias(-np.inf, 2),)),
    "top_k 128": S.SamplerParams(top_k=128),
    "top_k 129": S.SamplerParams(top_k=129),
}


def bits(value: float) -> bytes:
    """A float as its bytes, so that a NaN equals itself (as a +inf logit makes)."""
    return np.float64(value).tobytes()


def entries(top: list[tuple[int, float]]) -> list[tuple[int, bytes]]:
    return [(token, bits(p)) for token, p in top]


def draws(params: S.SamplerParams, steps: list[np.ndarray]) -> list[tuple]:
    """Each step's token, the candidates the draw chose from and the logprob entries."""
    sampler = S.Sampler(params, None, N_VOCAB)
    out = []
    for t in range(5):
        sampler.accept(t)
    for logits in steps:
        token = sampler.sample(logits)
        sampler.accept(token)
        last = sampler.last
        assert last is not None
        raw = S.token_logprobs(logits, 5, token)
        post = S.post_sampling_probs(last, 5, token)
        out.append(
            (
                token,
                last.ids.tobytes(),
                last.logits.tobytes(),
                last.p.tobytes(),
                last.sorted,
                entries(raw.top),
                bits(raw.p_token),
                entries(post.top),
                bits(post.p_token),
            )
        )
    return out


@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # +inf - +inf, as in C
def test_whole_chains_draw_the_same_with_and_without_the_kernel(chain: str) -> None:
    rng = np.random.default_rng(sorted(CHAINS).index(chain))
    for seed in range(12):
        params = replace(CHAINS[chain], seed=int(rng.integers(0, 2**32 - 1)))
        steps = [
            odd_logits(rng, N_VOCAB) if i % 4 == 3 else tied_logits(rng, N_VOCAB) for i in range(6)
        ]
        steps = [s for s in steps if not np.isnan(s).any()]  # a NaN logit is not a distribution
        fast = draws(params, steps)
        with numpy_top_k():
            slow = draws(params, steps)
        assert fast == slow, (chain, seed)


def test_draws_start_from_shared_read_only_vocabulary_arrays() -> None:
    """The ids and zero probabilities are made once per vocabulary size and never written."""
    logits = np.zeros(N_VOCAB, dtype=np.float32)
    a, b = S.Candidates.from_logits(logits), S.Candidates.from_logits(logits)
    assert a.ids is b.ids and not a.ids.flags.writeable and not a.p.flags.writeable
    assert a.logits is not logits and a.logits is not b.logits  # the logits are the draw's own


def token_logprobs_dividing_all(logits: np.ndarray, n_probs: int, token: int) -> S.TokenProbs:
    """token_logprobs as it was: every probability of the vocabulary divided, then picked."""
    logits = np.asarray(logits, dtype=np.float32)
    n = min(max(n_probs, 0), len(logits))
    order = S._top_k_order_numpy(logits, n) if n else np.zeros(0, dtype=np.int64)
    max_l = logits[order[0]] if n else logits.max()
    p = S._expf(logits - max_l)
    rest = np.ones(len(logits), dtype=bool)
    rest[order] = False
    total = S._fsum(np.concatenate([p[order], p[rest]]))
    probs = (p / total).astype(np.float32)
    return S.TokenProbs([(int(i), float(probs[i])) for i in order], float(probs[token]))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def test_logprobs_equal_the_whole_vocabulary_division() -> None:
    rng = np.random.default_rng(7)
    for case in range(150):
        logits = odd_logits(rng, N_VOCAB) if case % 3 == 0 else tied_logits(rng, N_VOCAB)
        if np.isnan(logits).any():  # not a model's output: neither path takes it
            continue
        token = int(rng.integers(0, N_VOCAB))
        for n in (0, 1, 5, 20):
            got = S.token_logprobs(logits, n, token)
            want = token_logprobs_dividing_all(logits, n, token)
            assert entries(got.top) == entries(want.top), (case, n)
            assert bits(got.p_token) == bits(want.p_token), (case, n)


def test_warm_up_compiles_the_kernel_for_writable_and_read_only_logits() -> None:
    S.warm_up()
    assert len(sampler_kernels.top_k_stable.signatures) >= 2
    frozen = np.arange(300, dtype=np.float32)
    frozen.flags.writeable = False
    assert S.top_k_order(frozen, 3).tolist() == [299, 298, 297]
