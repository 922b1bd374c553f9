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
    every = S.partial_sort_order(logits, n) if n else np.arange(len(logits))
    order = every[:n]
    max_l = logits[order[0]] if n else logits.max()
    p = S._expf(logits - max_l)
    total = S._fsum(p[every])
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


# --- the compiled chain (sampler_kernels.chain_tail) against the NumPy stages ---------------------


@contextmanager
def numpy_chain() -> Iterator[None]:
    """The sampler with every stage after the top-k run by NumPy, as before chain_tail."""
    saved = S.FAST_CHAIN
    S.FAST_CHAIN = False
    try:
        yield
    finally:
        S.FAST_CHAIN = saved


def peaked_logits(rng: np.random.Generator, n: int) -> np.ndarray:
    logits = (rng.standard_normal(n) * 2).astype(np.float32)
    logits[int(rng.integers(0, n))] = np.float32(rng.uniform(20, 60))
    return logits


def flat_logits(rng: np.random.Generator, n: int) -> np.ndarray:
    return (np.float32(3.0) + rng.standard_normal(n) * 1e-3).astype(np.float32)


def chain_steps(rng: np.random.Generator, count: int) -> list[np.ndarray]:
    makers = (tied_logits, odd_logits, peaked_logits, flat_logits)
    return [makers[i % len(makers)](rng, N_VOCAB) for i in range(count)]


BIASES = (S.LogitBias(-np.inf, 2), S.LogitBias(-np.inf, 7), S.LogitBias(2.5, 11))
BASE = S.SamplerParams()
MATRIX: dict[str, S.SamplerParams] = {
    "default": BASE,
    "greedy": replace(BASE, temperature=0.0),
    "greedy negative": replace(BASE, temperature=-1.0),
    "temperature 1": replace(BASE, temperature=1.0),
    "hot": replace(BASE, temperature=2.0, top_p=0.999, min_p=0.0),
    "cold": replace(BASE, temperature=0.05),
    "top_k 1": replace(BASE, top_k=1),
    "top_k 2": replace(BASE, top_k=2),
    "top_k 128": replace(BASE, top_k=128, top_p=1.0, min_p=0.0),
    "top_k 129": replace(BASE, top_k=129),
    "no top_k": replace(BASE, top_k=0),
    "top_p 0": replace(BASE, top_p=0.0),
    "top_p 0.5": replace(BASE, top_p=0.5),
    "top_p nan": replace(BASE, top_p=float("nan")),
    "min_p 0.5": replace(BASE, min_p=0.5, top_p=1.0),
    "min_p 1": replace(BASE, min_p=1.0),
    "min_keep 5": replace(BASE, min_keep=5, top_p=0.3, min_p=0.6),
    "min_keep 50": replace(BASE, min_keep=50),
    "min_keep 1": replace(BASE, min_keep=1, top_p=0.1),
    "typical": replace(BASE, typical_p=0.7),
    "xtc": replace(BASE, xtc_probability=0.9, xtc_threshold=0.05),
    "xtc off": replace(BASE, xtc_probability=0.9, xtc_threshold=0.6),
    "top_n_sigma": replace(BASE, top_n_sigma=1.5),
    "dynatemp": replace(BASE, dynatemp_range=0.5),
    "penalties": replace(BASE, repeat_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
    "penalties greedy": replace(BASE, temperature=0.0, repeat_penalty=1.5),
    "dry": replace(BASE, dry_multiplier=0.8, dry_allowed_length=1),
    "mirostat 1": replace(BASE, mirostat=1),
    "mirostat 2": replace(BASE, mirostat=2),
    "biases": replace(BASE, logit_bias=BIASES),
    "biases greedy": replace(BASE, temperature=0.0, logit_bias=BIASES),
    "top_k twice": replace(BASE, samplers=("top_k", "temperature", "top_k", "top_p")),
    "temperature first": replace(BASE, samplers=("temperature", "top_k", "min_p", "top_p")),
    "greedy first": replace(BASE, temperature=0.0, samplers=("temperature", "top_k", "top_p")),
    "top_p first": replace(BASE, samplers=("top_p", "top_k", "min_p")),
    "typical first": replace(BASE, typical_p=0.9, samplers=("typ_p", "top_k", "top_p")),
    "sigma first": replace(BASE, top_n_sigma=2.0, samplers=("top_n_sigma", "top_k", "min_p")),
    "only top_k": replace(BASE, samplers=("top_k",)),
    "no stages": replace(BASE, samplers=()),
    "xtc after": replace(
        BASE, xtc_probability=0.5, xtc_threshold=0.01, samplers=("top_k", "xtc", "temperature")
    ),
}
# these have a compiled plan (so that the comparison compares something; "top_p first" sorts
# before its top-k, so its draws still go the NumPy way)
COMPILED = {
    "default",
    "greedy",
    "greedy negative",
    "temperature 1",
    "hot",
    "cold",
    "top_k 1",
    "top_k 2",
    "top_k 128",
    "top_p 0",
    "top_p 0.5",
    "top_p nan",
    "min_p 0.5",
    "min_p 1",
    "min_keep 5",
    "min_keep 50",
    "min_keep 1",
    "xtc off",
    "penalties",
    "penalties greedy",
    "dry",
    "biases",
    "biases greedy",
    "top_k twice",
    "temperature first",
    "greedy first",
    "top_p first",
    "typical first",
    "sigma first",
    "only top_k",
    "top_n_sigma",
}


def float_bits(a: np.ndarray) -> tuple[str, bytes]:
    return str(a.dtype), np.ascontiguousarray(a).view(np.uint32).tobytes()


def rng_state(rng: S.MT19937) -> tuple:
    name, keys, pos, *_ = rng._state.get_state()
    return name, keys.tobytes(), pos


def chain_draws(
    params: S.SamplerParams, steps: list[np.ndarray], history: list[int], grammar: bool
) -> list[tuple]:
    """Each step: the token, both generators' states, mirostat's mu, ``last`` bit for bit and the
    post-sampling logprobs; with ``grammar``, tokens not divisible by 3 are refused (a re-draw)."""
    sampler = S.Sampler(params, None, N_VOCAB)
    for t in history:
        sampler.accept(t)
    out = []
    for logits in steps:
        kept = logits.copy()
        try:
            if grammar:
                token = sampler.sample(
                    logits, lambda t: t % 3 == 0, lambda: np.arange(N_VOCAB) % 3 == 0
                )
            else:
                token = sampler.sample(logits)
        except IndexError:  # dozens of NaN logits leave NumPy's top-k empty: both fail alike
            out.append(("IndexError", rng_state(sampler.rng)))
            break
        assert np.array_equal(logits.view(np.uint32), kept.view(np.uint32))  # never written
        sampler.accept(token)
        last = sampler.last
        assert last is not None
        assert not np.may_share_memory(last.logits, logits)
        post = S.post_sampling_probs(last, 5, token)
        out.append(
            (
                token,
                rng_state(sampler.rng),
                rng_state(sampler.xtc_rng),
                bits(sampler.mu),
                str(last.ids.dtype),
                last.ids.tobytes(),
                float_bits(last.logits),
                float_bits(last.p),
                last.sorted,
                last.selected,
                entries(post.top),
                bits(post.p_token),
            )
        )
    return out


def test_the_plan_numbers_the_stages_as_the_kernel_does() -> None:
    for name in ("TOP_K", "TOP_P", "MIN_P", "TEMPERATURE", "GREEDY"):
        assert getattr(S, "_" + name) == getattr(sampler_kernels, name), name


def test_the_common_chains_take_the_compiled_path() -> None:
    for name, params in MATRIX.items():
        plan = S.fast_chain(params)
        takes = plan is not None and plan.k <= sampler_kernels.MAX_K
        if name in COMPILED:
            assert takes, name
        else:
            assert not takes, name


@pytest.mark.parametrize("name", sorted(MATRIX))
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf - inf and NaN logits, as in C
def test_compiled_chain_draws_bit_for_bit_as_the_numpy_stages(name: str) -> None:
    rng = np.random.default_rng(sorted(MATRIX).index(name) + 1000)
    for seed in range(6):
        params = replace(MATRIX[name], seed=int(rng.integers(0, 2**32 - 1)))
        steps = chain_steps(rng, 6)
        top = [int(i) for i in np.argsort(-steps[0])[:4]]
        history = [1, 2, 3, 1, 2, 3, 1, 2, *top, *top]  # repeats for DRY, top tokens for penalties
        for grammar in (False, True):
            fast = chain_draws(params, steps, history, grammar)
            with numpy_chain():
                slow = chain_draws(params, steps, history, grammar)
            assert fast == slow, (name, seed, grammar)


DEFAULT_TAIL = ("top_k", "top_p", "min_p", "temperature")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_nan_logit_hands_the_chain_to_numpy_after_the_prefix() -> None:
    """The penalties ran on the borrowed logits, the top-k kernel refuses the NaN: the NumPy
    stages go on from the top-k (on a copy), drawing once."""
    logits = flat_logits(np.random.default_rng(3), N_VOCAB)
    logits[100] = np.nan
    params = replace(BASE, seed=5, repeat_penalty=1.2, samplers=("penalties", *DEFAULT_TAIL))
    fast = chain_draws(params, [logits], [4, 5, 100], False)
    with numpy_chain():
        slow = chain_draws(params, [logits], [4, 5, 100], False)
    assert fast == slow and fast[0][0] != "IndexError"


def test_top_p_cuts_where_the_float_running_sums_reach_p() -> None:
    """top_p set to one of the running sums itself: a sum off by one ulp (another order, double
    accumulation) would cut one candidate later or earlier. The expected cut is computed here
    with the NumPy stages' own softmax on the stable top 128."""
    rng = np.random.default_rng(11)
    for case in range(60):
        logits = flat_logits(rng, N_VOCAB) if case % 2 else tied_logits(rng, N_VOCAB)
        top = S.Candidates.from_logits(logits)
        S.apply_top_k(top, 128)
        top.softmax(False)
        cum = np.cumsum(top.p, dtype=np.float32)
        j = int(rng.integers(0, 127))
        want = int(np.flatnonzero(cum >= cum[j])[0]) + 1
        params = replace(BASE, top_k=128, top_p=float(cum[j]), min_p=0.0, temperature=1.0)
        params = replace(params, seed=case)
        fast = chain_draws(params, [logits], [], False)
        with numpy_chain():
            slow = chain_draws(params, [logits], [], False)
        assert fast == slow, case
        assert len(fast[0][5]) == 4 * want, case  # int32 ids of the kept candidates
