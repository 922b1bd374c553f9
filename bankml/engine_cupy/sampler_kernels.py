"""The sampler's compiled kernels: the k largest logits of the whole vocabulary in one pass, and
the rest of a common chain on those k candidates.

``top_k_stable`` gives exactly what a stable descending sort's first k are (ties in vocabulary
order), the order ``sampler.top_k_order`` defines, without sorting or partitioning 49,152
logits for 40 of them: a sorted buffer of k is kept, and a logit enters it only when it is
strictly greater than the buffer's last, so of equal logits the earlier one wins. A NaN makes it
give up (NumPy's sorts place NaN by their own rule, which the NumPy path keeps).

``chain_tail`` runs what follows the top-k in the chains most requests use (top_k again, top_p,
min_p, temperature, then the dist draw) on the k candidates in one call, with the same float32
operations, in the same order, as the NumPy stages in sampler.py: glibc's ``expf`` (Numba's
float32 ``math.exp`` calls it, as ``kernels.exact_ops.expf`` does), float running sums where
NumPy's ``cumsum`` adds in order, the draw's cumulative sum in double and NumPy's
``searchsorted`` rule (NaN above everything).

Kept apart from sampler.py so that importing the sampler (request parsing, receipts) does not
load Numba; the sampler imports this module on its first draw.
"""

from __future__ import annotations

import math

import numpy as np

from bankml.engine_cupy.kernels.jit import njit

# Above this k, inserting into the buffer costs more than NumPy's partition (it is O(n k) when
# the logits ascend); the default chain's k is 40, a logprob request's n_probs a few.
MAX_K = 128
BLOCK = 64  # logits compared at once against the buffer's last


@njit
def top_k_stable(logits: np.ndarray, k: int) -> tuple[np.ndarray, bool]:
    """Indices of the ``k`` largest of float32 ``logits`` (1-D, contiguous), descending, ties in
    index order; ``False`` (and no indices) when a logit is NaN."""
    n = logits.shape[0]
    k = min(k, n)
    idx = np.empty(k, dtype=np.int64)
    val = np.empty(k, dtype=np.float32)
    if k <= 0:
        return idx, True
    for i in range(k):  # the first k, in order
        x = logits[i]
        if x != x:
            return idx[:0], False
        _insert(val, idx, i, x, i)
    i = k
    while i + BLOCK <= n:
        # most blocks hold no logit above the buffer's last: one branch-free pass tells (a NaN
        # counts as above, so its block takes the careful path); the fixed trip count written
        # ``range(BLOCK)`` is what LLVM vectorises
        last = val[k - 1]
        above = False
        for j in range(BLOCK):
            x = logits[i + j]
            above |= (x > last) | (x != x)
        if above and not _admit(logits, val, idx, i, i + BLOCK):
            return idx[:0], False
        i += BLOCK
    if not _admit(logits, val, idx, i, n):
        return idx[:0], False
    return idx, True


@njit
def _admit(logits: np.ndarray, val: np.ndarray, idx: np.ndarray, start: int, end: int) -> bool:
    """Insert each of ``logits[start:end]`` above the buffer's last, in order; False at a NaN."""
    k = val.shape[0]
    last = val[k - 1]
    for j in range(start, end):
        x = logits[j]
        if x <= last:
            continue
        if x != x:
            return False
        _insert(val, idx, k - 1, x, j)
        last = val[k - 1]
    return True


@njit
def _insert(val: np.ndarray, idx: np.ndarray, j: int, x: np.float32, i: int) -> None:
    """Put (x, i) at slot ``j`` or before it, after every value >= x (ties keep index order)."""
    while j > 0 and val[j - 1] < x:
        val[j] = val[j - 1]
        idx[j] = idx[j - 1]
        j -= 1
    val[j] = x
    idx[j] = i


# chain_tail's stage codes (sampler.py builds the plan that names them)
TOP_K = 0  # ints: k
TOP_P = 1  # floats: p as float32
MIN_P = 2  # floats: logf(p)
TEMPERATURE = 3  # floats: the temperature as float32 (> 0)
GREEDY = 4  # a temperature <= 0: only the first maximum keeps its logit


@njit
def chain_tail(
    logits: np.ndarray,
    ids: np.ndarray,
    order: np.ndarray,
    codes: np.ndarray,
    ints: np.ndarray,
    floats: np.ndarray,
    min_keep: int,
    rnd: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The candidates ``order`` picks (sorted by logit, descending), through the stages ``codes``
    and the dist draw with uniform ``rnd``: the final ids, logits, probabilities and the selected
    position, as sampler.py's stages leave them. At least one candidate."""
    m = order.shape[0]
    out_ids = np.empty(m, dtype=np.int32)
    out_logits = np.empty(m, dtype=np.float32)
    p = np.empty(m, dtype=np.float32)
    for i in range(m):
        out_ids[i] = ids[order[i]]
        out_logits[i] = logits[order[i]]
    n = m
    for s in range(codes.shape[0]):
        code = codes[s]
        if code == TOP_K:
            n = min(ints[s], n)
        elif code == TOP_P:
            _softmax_sorted(out_logits, p, n)
            cum = np.float32(0.0)
            last = n
            for i in range(n):
                cum = np.float32(cum + p[i])
                if cum >= floats[s] and i + 1 >= min_keep:
                    last = i + 1
                    break
            n = last
        elif code == MIN_P:
            min_logit = np.float32(out_logits[0] + floats[s])
            for i in range(1, n):
                if out_logits[i] < min_logit and i >= min_keep:
                    n = i
                    break
        elif code == TEMPERATURE:
            for i in range(n):
                out_logits[i] = np.float32(out_logits[i] / floats[s])
        elif code == GREEDY:
            first = _argmax(out_logits, n)
            keep = out_logits[first]
            for i in range(n):
                out_logits[i] = -np.inf
            out_logits[first] = keep
    if n == 1:
        p[0] = np.float32(1.0)
        return out_ids[:1], out_logits[:1], p[:1], 0
    max_l = out_logits[0]
    cum = np.empty(n, dtype=np.float64)
    total = 0.0
    for i in range(n):
        p[i] = math.exp(np.float32(out_logits[i] - max_l))
        total += np.float64(p[i])
        cum[i] = total
    key = total * rnd
    hit = n
    for i in range(n):  # searchsorted(side="left") on a non-decreasing sum, NaN last
        c = cum[i]
        if not (c < key or (key != key and c == c)):
            hit = i
            break
    selected = min(hit, n - 1)
    for i in range(n):
        p[i] = np.float32(np.float64(p[i]) / total)
    return out_ids[:n], out_logits[:n], p[:n], selected


@njit
def _softmax_sorted(logits: np.ndarray, p: np.ndarray, n: int) -> None:
    """Candidates.softmax on sorted candidates: expf of (logit - first), over their float sum."""
    max_l = logits[0]
    total = np.float32(0.0)
    for i in range(n):
        p[i] = math.exp(np.float32(logits[i] - max_l))
        total = np.float32(total + p[i])
    for i in range(n):
        p[i] = np.float32(p[i] / total)


@njit
def _argmax(x: np.ndarray, n: int) -> int:
    """np.argmax of the first n: the first maximum, or the first NaN."""
    best = x[0]
    if best != best:
        return 0
    first = 0
    for i in range(1, n):
        v = x[i]
        if v != v:
            return i
        if v > best:
            best = v
            first = i
    return first
