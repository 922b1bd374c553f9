"""What a draw needs of the logits the GPU decode step leaves on the device, and the draw from
the top-k pairs alone.

A request's draw (``GuidedSampler.sample``) reads the logits in one of three ways:

- ``GREEDY``: the token is the first largest logit, which the step's own ``argmax_f32`` already
  chose on the device (4 bytes back). That is the chain's answer where nothing before it
  changes a logit (no grammar, reasoning budget, mirostat; penalties, DRY, XTC, typical-p,
  top-n-sigma and dynamic temperature do not act), the temperature is <= 0 (its stage keeps
  the first largest logit only) and the other stages that act keep the largest (top-k, top-p,
  min-p). With a logit bias, the first of the biased row's top-1 pair instead.
- ``TOP_K``: the chain's first stage that acts is top-k (llama-server's default chain:
  penalties, DRY and top-n-sigma come before it and do not act by default), with no grammar,
  reasoning budget or mirostat, and k <= ``device_step.TOP_K_MAX``: the chain's candidates
  after its top-k are exactly the k (id, logit) pairs ``top_k_f32`` hands back, in the same
  order, so ``draw_from_top_k`` runs the rest of the chain (the compiled tail, or the NumPy
  stages) and its one random draw on those and picks the token the whole row gives.
- ``FULL``: anything else (log-probabilities, a grammar, a chain that starts otherwise,
  mirostat, a larger k, a logit bias naming a token twice): the row comes back (V floats) and
  the host sampler runs as usual.

A logit bias (``ignore_eos`` is one) is added on the device, to a copy of the row, before the
top-k (``bias``): one f32 addition per token as ``apply_logit_bias`` makes when no token is
named twice.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy

from bankml.engine_cupy import sampler as smp
from bankml.engine_cupy.device_step import TOP_K_MAX

GREEDY, TOP_K, FULL = "greedy", "top_k", "full"
_KEEP_THE_LARGEST = ("top_k", "top_p", "min_p")  # stages that never drop the first largest


def stage_acts(name: str, p: smp.SamplerParams) -> bool:
    """Whether chain stage ``name`` can change the candidates (Sampler._stage's conditions)."""
    if name == "penalties":
        return smp._penalties_act(p)
    if name == "dry":
        return p.dry_multiplier != 0.0 and p.dry_base >= 1.0 and p.dry_penalty_last_n != 0
    if name == "top_n_sigma":
        return not p.top_n_sigma <= 0.0
    if name == "top_k":
        return p.top_k > 0
    if name == "typ_p":
        return not p.typical_p >= 1.0
    if name == "top_p":
        return not p.top_p >= 1.0
    if name == "min_p":
        return not p.min_p <= 0.0
    if name == "xtc":
        return smp._xtc_acts(p)
    if name == "temperature":
        return p.dynatemp_range > 0 or p.temperature != 1.0
    return True  # a stage this list does not know: assume it acts


def choice(guided: smp.GuidedSampler, n_probs: int, n_vocab: int) -> tuple[str, int]:
    """How the next draw reads the device's logits: (GREEDY, 0), (TOP_K, k) or (FULL, 0)."""
    p = guided.sampler.params
    if n_probs > 0 or guided.grammar is not None or guided.budget is not None:
        return FULL, 0
    if p.mirostat != 0 or bias(p) is False:
        return FULL, 0
    acting = [name for name in p.samplers if stage_acts(name, p)]
    if (
        "temperature" in acting
        and p.dynatemp_range <= 0
        and p.temperature <= 0.0
        and all(name in _KEEP_THE_LARGEST or name == "temperature" for name in acting)
    ):
        return GREEDY, 0
    if acting and acting[0] == "top_k" and min(p.top_k, n_vocab) <= TOP_K_MAX:
        return TOP_K, min(p.top_k, n_vocab)
    return FULL, 0


def bias(p: smp.SamplerParams) -> tuple[numpy.ndarray, numpy.ndarray] | None | Literal[False]:
    """The request's logit bias as (ids, f32 values) for the device; None without one; False
    where a token is named twice (the host adds those in turn)."""
    if not p.logit_bias:
        return None
    ids = numpy.asarray([b.token for b in p.logit_bias], dtype=numpy.int64)
    if len(numpy.unique(ids)) != len(ids):
        return False
    return ids, numpy.asarray([b.bias for b in p.logit_bias], dtype=smp.F32)


def draw_from_top_k(sampler: smp.Sampler, ids: numpy.ndarray, logits: numpy.ndarray) -> int:
    """The chain's draw from its first top-k's candidates (``choice`` said TOP_K): what
    ``Sampler.sample`` draws from the whole row, the same stages, the same one random number."""
    p = sampler.params
    c = smp.Candidates(
        numpy.ascontiguousarray(ids, dtype=numpy.int32),
        numpy.ascontiguousarray(logits, dtype=smp.F32),
        numpy.zeros(len(ids), dtype=smp.F32),
        sorted=True,
    )
    sampler.last = c
    plan: Any = sampler._fast
    if plan is not None and smp.FAST_CHAIN and plan.k <= smp._kernels().MAX_K:
        rnd = sampler.rng.uniform_double()
        c.ids, c.logits, c.p, selected = smp._kernels().chain_tail(
            c.logits,
            c.ids,
            numpy.arange(len(ids), dtype=numpy.int64),
            plan.codes,
            plan.ints,
            plan.floats,
            plan.min_keep,
            rnd,
        )
        return int(c.ids[int(selected)])
    first = p.samplers.index("top_k")
    for name in p.samplers[first:]:
        sampler._stage(name, c)
    smp.sample_dist(c, sampler.rng)
    return int(c.ids[c.selected])
