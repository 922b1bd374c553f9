"""The sampler's one compiled kernel: the k largest logits of the whole vocabulary in one pass.

``top_k_stable`` gives exactly what a stable descending sort's first k are (ties in vocabulary
order), the order ``sampler.top_k_order`` defines, without sorting or partitioning 49,152
logits for 40 of them: a sorted buffer of k is kept, and a logit enters it only when it is
strictly greater than the buffer's last, so of equal logits the earlier one wins. A NaN makes it
give up (NumPy's sorts place NaN by their own rule, which the NumPy path keeps).

Kept apart from sampler.py so that importing the sampler (request parsing, receipts) does not
load Numba; the sampler imports this module on its first draw.
"""

from __future__ import annotations

import numpy as np

from bankml.engine_cupy.kernels.jit import njit

# Above this k, inserting into the buffer costs more than NumPy's partition (it is O(n k) when
# the logits ascend); the default chain's k is 40, a logprob request's n_probs a few.
MAX_K = 128
BLOCK = 32  # logits compared at once against the buffer's last


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
    last = val[k - 1]
    i = k
    while i < n:
        end = min(i + BLOCK, n)
        # most blocks hold no logit above the buffer's last: one branch-free pass tells (a NaN
        # fails ``<=`` too, so its block takes the careful path)
        above = False
        for j in range(i, end):
            above |= not logits[j] <= last
        if above:
            for j in range(i, end):
                x = logits[j]
                if x <= last:
                    continue
                if x != x:
                    return idx[:0], False
                _insert(val, idx, k - 1, x, j)
                last = val[k - 1]
        i = end
    return idx, True


@njit
def _insert(val: np.ndarray, idx: np.ndarray, j: int, x: np.float32, i: int) -> None:
    """Put (x, i) at slot ``j`` or before it, after every value >= x (ties keep index order)."""
    while j > 0 and val[j - 1] < x:
        val[j] = val[j - 1]
        idx[j] = idx[j - 1]
        j -= 1
    val[j] = x
    idx[j] = i
