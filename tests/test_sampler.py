"""Sampler units on synthetic logits: llama.cpp's tests/test-sampling.cpp vectors, re-derived
stage by stage, the std::mt19937 stream, and request-parameter parsing.

The oracle comparisons against a real llama-server (seeded answers, 400 messages) are in
tests/test_engine.py, where the engine provides the logits.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bankml.engine_cupy import sampler as S
from bankml.engine_cupy.sampler import (
    MT19937,
    Candidates,
    DryPenalty,
    PenaltyWindow,
    Sampler,
    SamplerError,
    SamplerParams,
)
from tests.support import compiled_probe


def candidates(probs: list[float]) -> Candidates:
    with np.errstate(divide="ignore"):
        return Candidates.from_logits(np.log(np.array(probs, dtype=np.float64)).astype(np.float32))


def dist_probs(c: Candidates) -> list[float]:
    S.sample_dist(c, MT19937(0))
    return [float(x) for x in c.p]


def assert_probs(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        assert abs(g - w) < 1e-5, (got, want)


# --- the Mersenne Twister and libstdc++'s distributions ------------------------------------------------


def test_mt19937_matches_std_mt19937() -> None:
    # std::mt19937 with its default seed 5489: first outputs, and the 10000th value the C++
    # standard requires ([rand.predef]: 4123659995).
    rng = MT19937(5489)
    stream = rng.raw(10000)
    assert stream[:3] == [3499211612, 581869302, 3890346734]
    assert stream[-1] == 4123659995


def test_uniform_double_uses_two_draws_low_word_first() -> None:
    a, b = MT19937(42).raw(2)
    assert MT19937(42).uniform_double() == (a + b * 2.0**32) / 2.0**64


def test_uniform_float_rounds_the_draw_to_float() -> None:
    (a,) = MT19937(7).raw(1)
    assert MT19937(7).uniform_float() == float(np.float32(np.float32(a) / np.float32(2.0**32)))


def test_single_candidate_still_consumes_the_draw() -> None:
    # test_dist_singleton_rng: a 1-candidate draw keeps the stream aligned with a 2-candidate one
    single, control = MT19937(4242), MT19937(4242)
    S.sample_dist(Candidates.from_logits(np.zeros(1, np.float32)), single)
    S.sample_dist(Candidates.from_logits(np.zeros(2, np.float32)), control)
    for _ in range(4):
        a, b = (
            Candidates.from_logits(np.zeros(256, np.float32)),
            Candidates.from_logits(np.zeros(256, np.float32)),
        )
        S.sample_dist(a, single)
        S.sample_dist(b, control)
        assert a.selected == b.selected


# --- stages (tests/test-sampling.cpp vectors) -----------------------------------------------------------

P4 = [0.1, 0.2, 0.3, 0.4]


@pytest.mark.parametrize("temp,want", [(1.0, P4), (0.0, [0.0, 0.0, 0.0, 1.0])])
def test_temperature(temp: float, want: list[float]) -> None:
    c = candidates(P4)
    if temp != 1.0:
        S.apply_temperature(c, temp)
    assert_probs(dist_probs(c), want)


def test_dynamic_temperature_range_zero_is_plain_temperature() -> None:
    c = candidates(P4)
    S.apply_temperature(c, 0.0)
    assert_probs(dist_probs(c), [0.0, 0.0, 0.0, 1.0])


def test_dynamic_temperature_uses_entropy() -> None:
    # uniform candidates have normalized entropy 1, so the temperature is temp + range: logits stay uniform
    c = candidates([0.25] * 4)
    S.apply_dynamic_temperature(c, 1.0, 0.5, 1.0)
    assert_probs([float(x) for x in c.p], [0.25] * 4)
    # a peaked distribution gets a lower temperature and sharpens
    c = candidates([0.97, 0.01, 0.01, 0.01])
    S.apply_dynamic_temperature(c, 1.0, 0.9, 1.0)
    assert c.p[0] > 0.97


@pytest.mark.parametrize(
    "k,want", [(1, [1.0]), (3, [0.44444, 0.33333, 0.22222]), (4, [0.4, 0.3, 0.2, 0.1]), (0, P4)]
)
def test_top_k(k: int, want: list[float]) -> None:
    c = candidates(P4)
    S.apply_top_k(c, k)
    assert_probs(dist_probs(c), want)


@pytest.mark.parametrize(
    "p,want",
    [(0.0, [1.0]), (0.7, [0.571429, 0.428571]), (0.8, [0.44444, 0.33333, 0.22222]), (1.0, P4)],
)
def test_top_p(p: float, want: list[float]) -> None:
    c = candidates(P4)
    S.apply_top_p(c, p, 0)
    assert_probs(dist_probs(c), want)


@pytest.mark.parametrize(
    "p,want",
    [
        (0.00, P4),
        (0.24, P4),
        (0.26, [0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
        (0.49, [0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
        (0.51, [0.3 / 0.7, 0.4 / 0.7]),
        (0.74, [0.3 / 0.7, 0.4 / 0.7]),
        (0.76, [1.0]),
        (1.00, [1.0]),
        (1.05, [1.0]),
    ],
)
def test_min_p(p: float, want: list[float]) -> None:
    c = candidates(P4)
    S.apply_min_p(c, p, 0)
    assert_probs(dist_probs(c), want)


@pytest.mark.parametrize(
    "t,want",
    [(0.09, [0.1]), (0.19, [0.2, 0.1]), (0.29, [0.3, 0.2, 0.1]), (0.39, [0.4, 0.3, 0.2, 0.1])],
)
def test_xtc(t: float, want: list[float]) -> None:
    c = candidates([0.4, 0.3, 0.2, 0.1])
    S.apply_xtc(c, 0.99, t, 0, MT19937(0))
    assert_probs([float(x) for x in c.p], want)


@pytest.mark.parametrize(
    "probs,p,want",
    [([0.97, 0.01, 0.01, 0.01], 0.5, [0.97]), ([0.4, 0.2, 0.2, 0.2], 0.5, [0.2, 0.2, 0.2])],
)
def test_typical(probs: list[float], p: float, want: list[float]) -> None:
    c = candidates(probs)
    S.apply_typical(c, p, 0)
    assert_probs([float(x) for x in c.p], want)


@pytest.mark.parametrize(
    "last,want,rp,freq,present",
    [
        ([0], [0, 0.25, 0.25, 0.25, 0.25], 50.0, 0.0, 0.0),
        ([0, 1, 2], [0, 0, 0, 0.5, 0.5], 50.0, 0.0, 0.0),
        ([0, 1, 2, 0, 0], [0, 0, 0, 0.5, 0.5], 50.0, 0.0, 0.0),
        ([0], [0.000011, 0.249997, 0.249997, 0.249997, 0.249997], 1.0, 5.0, 5.0),
        ([0, 1, 2], [0.000023, 0.000023, 0.000023, 0.499966, 0.499966], 1.0, 5.0, 5.0),
        ([0, 1, 2, 0, 0], [0.0, 0.000023, 0.000023, 0.499977, 0.499977], 1.0, 5.0, 5.0),
    ],
)
def test_penalties(
    last: list[int], want: list[float], rp: float, freq: float, present: float
) -> None:
    window = PenaltyWindow(len(last))
    for t in last:
        window.accept(t)
    c = candidates([0.2] * 5)
    S.apply_penalties(c, window.counts, rp, freq, present)
    assert_probs(dist_probs(c), want)


def test_penalty_window_forgets_old_tokens() -> None:
    window = PenaltyWindow(2)
    for t in [5, 6, 7]:
        window.accept(t)
    assert dict(window.counts) == {6: 1, 7: 1}


@pytest.mark.parametrize(
    "probs,last,want,mult,base,allowed,last_n,breakers",
    [
        ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, []),
        ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, []),
        ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, [[3]]),
        (
            [0.2] * 5,
            [0, 1, 2, 0, 1],
            [0.241818, 0.241818, 0.032727, 0.241818, 0.241818],
            2.0,
            1.1,
            2,
            5,
            [],
        ),
        ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, []),
    ],
)
def test_dry(
    probs: list[float],
    last: list[int],
    want: list[float],
    mult: float,
    base: float,
    allowed: int,
    last_n: int,
    breakers: list[list[int]],
) -> None:
    params = SamplerParams(
        dry_multiplier=mult, dry_base=base, dry_allowed_length=allowed, dry_penalty_last_n=last_n
    )
    table: dict[int, list[tuple[int, ...]]] = {}
    for seq in breakers:
        table.setdefault(seq[0], []).append(tuple(seq[1:]))
    dry = DryPenalty(params, table)
    for t in last:
        dry.accept(t)
    c = candidates(probs)
    dry.apply(c)
    assert_probs(dist_probs(c), want)


def test_dry_breakers_from_pieces() -> None:
    # "\n" inside a piece makes a single-token breaker; a piece ending with "ab" heads the tail "c"
    pieces = [b"x", b"a\nb", b"zab", b"c", b"y"]
    table = S.dry_breaker_sequences(["\n", "abc"], pieces, lambda s: {"c": [3]}[s])
    assert table[1] == [()]
    assert table[2] == [(3,)]
    assert 0 not in table and 4 not in table


@pytest.mark.parametrize("n,want", [(1.0, [0.0, 0.0, 0.428571, 0.571429]), (0.0, P4), (3.0, P4)])
def test_top_n_sigma(n: float, want: list[float]) -> None:
    c = candidates(P4)
    S.apply_top_n_sigma(c, n)
    assert_probs(dist_probs(c), want)


def test_sampler_queue_top_k_then_top_p_then_min_p() -> None:
    # test_sampler_queue: logits log(id) over 10000 tokens; top-k keeps the k largest ids in order
    with np.errstate(divide="ignore"):
        logits = np.log(np.arange(10000, dtype=np.float64)).astype(np.float32)
    c = Candidates.from_logits(logits)
    S.apply_top_k(c, 1000)
    assert c.size == 1000 and c.ids[0] == 9999 and c.ids[-1] == 9000
    S.apply_top_p(c, 0.5, 1)
    # the kept mass is the smallest prefix of ids 9999, 9998, ... reaching half of sum(9000..9999)
    total = sum(range(9000, 10000))
    kept = list(range(9999, 9999 - c.size, -1))
    assert sum(kept) >= 0.5 * total > sum(kept[:-1])
    S.apply_min_p(c, 0.9995, 1)
    assert (c.ids >= math.ceil(9999 * 0.9995) - 1).all()


# --- mirostat ------------------------------------------------------------------------------------------------


def test_mirostat_v2_updates_mu_and_keeps_one_candidate_at_least() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    s = Sampler(
        SamplerParams(mirostat=2, mirostat_tau=0.1, mirostat_eta=0.5, temperature=1.0, seed=3),
        None,
        4,
    )
    # mu = 2 tau = 0.2 bits: every surprise is above it, so one token is kept, renormalized to p = 1
    # (surprise 0): mu moves to 0.2 - 0.5 * (0 - 0.1)
    assert s.sample(logits) == 0
    assert s.mu == pytest.approx(0.25, abs=1e-6)


def test_mirostat_v1_draws_from_the_top_tokens() -> None:
    rng = np.random.RandomState(1)
    logits = (rng.randn(1000) * 3).astype(np.float32)
    s = Sampler(SamplerParams(mirostat=1, mirostat_tau=1.0, seed=11), None, 1000)
    draws = [s.sample(logits) for _ in range(30)]
    top = set(np.argsort(-logits)[:20].tolist())
    assert set(draws) <= top


# --- the chain -----------------------------------------------------------------------------------------------


def test_seeded_chain_is_reproducible_and_seed_dependent() -> None:
    logits = (np.random.RandomState(0).randn(5000) * 2).astype(np.float32)
    runs = {}
    for seed in (1, 1, 2):
        s = Sampler(
            SamplerParams(seed=seed, temperature=1.5, top_k=100, top_p=0.99, min_p=0.0), None, 5000
        )
        runs.setdefault(seed, []).append([s.sample(logits) for _ in range(40)])
    assert runs[1][0] == runs[1][1]
    assert runs[1][0] != runs[2][0]


def test_greedy_picks_the_first_maximum() -> None:
    logits = np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32)
    s = Sampler(SamplerParams(temperature=0.0, seed=5), None, 4)
    assert [s.sample(logits) for _ in range(5)] == [1] * 5


def test_grammar_rejection_redraws_on_masked_logits() -> None:
    logits = np.array([5.0, 0.0, 0.0, 0.0], dtype=np.float32)
    s = Sampler(SamplerParams(temperature=0.0, seed=5), None, 4)
    allowed = np.array([False, False, True, True])
    assert s.sample(logits, lambda t: bool(allowed[t]), lambda: allowed) == 2


def test_token_logprobs_from_raw_logits() -> None:
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4])).astype(np.float32)
    probs = S.token_logprobs(logits, 2, 0)
    assert [t for t, _ in probs.top] == [3, 2]
    assert probs.top[0][1] == pytest.approx(0.4, abs=1e-6)
    assert probs.p_token == pytest.approx(0.1, abs=1e-6)
    assert S.logarithm(0.0) == float(np.finfo(np.float32).min)


# --- request parameters --------------------------------------------------------------------------------------


def test_defaults_are_llama_cpp_defaults() -> None:
    p = SamplerParams.from_request({})
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_last_n, p.seed) == (
        pytest.approx(0.8),
        40,
        pytest.approx(0.95),
        pytest.approx(0.05),
        64,
        0xFFFFFFFF,
    )
    assert p.dry_sequence_breakers == ("\n", ":", '"', "*")
    assert p.samplers == S.DEFAULT_ORDER


def test_clamps_and_conversions() -> None:
    p = SamplerParams.from_request(
        {
            "temperature": -1,
            "top_p": 1.5,
            "min_p": -0.2,
            "xtc_threshold": 2,
            "dry_base": 0.5,
            "seed": -1,
            "top_k": 2.9,
            "samplers": "kt",
        }
    )
    assert p.temperature == 0.0 and p.top_p == 1.0 and p.min_p == 0.0 and p.xtc_threshold == 1.0
    assert p.dry_base == pytest.approx(1.75) and p.seed == 0xFFFFFFFF and p.top_k == 2
    assert p.samplers == ("top_k", "temperature")
    assert SamplerParams.from_request(
        {"samplers": ["Top-K", "nucleus", "bogus", "temp"]}
    ).samplers == ("top_k", "top_p", "temperature")


def test_null_means_default() -> None:
    assert (
        SamplerParams.from_request({"top_k": None, "dry_sequence_breakers": None})
        == SamplerParams()
    )


@pytest.mark.parametrize(
    "body,message",
    [
        (
            {"repeat_last_n": -1},
            "Field 'repeat_last_n': Value must be between 0 <= value <= 2147483647, but got -1",
        ),
        (
            {"dry_allowed_length": -3},
            "Field 'dry_allowed_length': Value must be between 0 <= value <= 2147483647, "
            "but got -3",
        ),
        (
            {"repeat_penalty": 0},
            "Failed to initialize samplers: penalty_repeat must be finite and greater than 0",
        ),
        (
            {"dry_sequence_breakers": "\n"},
            "Field 'dry_sequence_breakers': Error: dry_sequence_breakers must be a "
            "non-empty array of strings",
        ),
        (
            {"dry_sequence_breakers": []},
            "Field 'dry_sequence_breakers': Error: dry_sequence_breakers must be a "
            "non-empty array of strings",
        ),
        (
            {"top_k": "40"},
            "Field 'top_k': [json.exception.type_error.302] type must be number, but is string",
        ),
    ],
)
def test_refusals(body: dict, message: str) -> None:
    with pytest.raises(SamplerError) as err:
        SamplerParams.from_request(body)
    assert str(err.value) == message


def test_gguf_sampling_defaults() -> None:
    p = SamplerParams.from_gguf_metadata(
        {"general.sampling.temp": 0.5, "general.sampling.top_k": 20}
    )
    assert p.temperature == 0.5 and p.top_k == 20 and p.top_p == pytest.approx(0.95)


PARTIAL_SORT_PROBE = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
struct item { int id; float logit; };
int main() {
    int n, k;
    while (scanf("%d %d", &n, &k) == 2) {
        std::vector<item> cur(n);
        for (int i = 0; i < n; i++) { cur[i].id = i; scanf("%f", &cur[i].logit); }
        std::partial_sort(cur.begin(), cur.begin() + k, cur.end(),
            [](const item & a, const item & b) { return a.logit > b.logit; });
        for (auto & t : cur) printf("%d ", t.id);
        printf("\n");
    }
}
"""


def test_the_logprob_sum_follows_the_standard_librarys_partial_sort(tmp_path: Path) -> None:
    """get_token_probabilities sums the softmax in the order std::partial_sort leaves the whole
    vocabulary (top n first, the rest as the heap selection moved them): partial_sort_order
    gives that order, ties included, as a program compiled here with the system's C++ standard
    library (the one llama-server is built with) gives it."""
    probe = compiled_probe(tmp_path, PARTIAL_SORT_PROBE)
    rng = np.random.default_rng(11)
    cases = []
    for n, k in [(1, 1), (2, 1), (5, 5), (40, 1), (40, 2), (300, 7), (3000, 10), (49152, 3)]:
        cases.append((rng.normal(size=n).astype(np.float32), k))
        cases.append((rng.integers(0, 4, size=n).astype(np.float32), k))  # many ties
    given = "\n".join(f"{len(x)} {k} " + " ".join(repr(float(v)) for v in x) for x, k in cases)
    lines = subprocess.run(
        [str(probe)], input=given, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(lines) == len(cases)
    for (x, k), line in zip(cases, lines):
        assert S.partial_sort_order(x, k).tolist() == [int(t) for t in line.split()], (len(x), k)


def test_the_samplers_exp_and_log_are_glibcs() -> None:
    """llama.cpp's samplers and llama-server's logprobs call glibc's expf and logf; the
    sampler's are those (NumPy's float32 log differs from logf on about a fifth of inputs, a
    double exp or log rounded to float on about one in a thousand or a hundred)."""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    for name in ("expf", "logf"):
        getattr(libm, name).restype = ctypes.c_float
        getattr(libm, name).argtypes = [ctypes.c_float]
    rng = np.random.default_rng(5)
    x = rng.random(20000).astype(np.float32)
    want = np.array([libm.logf(float(t)) for t in x], np.float32)
    assert np.array_equal(S._logf(x).view(np.uint32), want.view(np.uint32))
    assert S.logarithm(float(x[0])) == float(want[0]) and S.logarithm(0.0) < -3e38
    y = (-rng.random(20000) * 30).astype(np.float32)
    want = np.array([libm.expf(float(t)) for t in y], np.float32)
    assert np.array_equal(S._expf(y).view(np.uint32), want.view(np.uint32))
