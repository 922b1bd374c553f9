// The top-k of a sampling request on the device: the k largest of n logits, largest first,
// equal logits in index order (the order of the host sampler's stable top-k), as k (id, logit)
// pairs: out[0..k) the ids, out[k..2k) the logits' bits, out[2k] 1 where a logit is NaN (the
// host then samples from the whole row, as its own top-k falls back on one). A slot no logit
// fills (fewer than k that are not NaN) holds id -1 and -inf. One thread block of
// TOPK_THREADS; round r finds the largest pair after round r-1's in that order, so the result
// does not depend on the order of the comparisons.
#include "step_common.cuh"

#define TOPK_THREADS 1024

// (v, i) comes before (bv, bi): a larger value, or an equal one at a lower index
static __device__ __forceinline__ bool before(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS, 1)
    top_k_f32(const float *__restrict__ x, int n, int k, int *__restrict__ out) {
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    __shared__ float bests[TOPK_THREADS / WARP];
    __shared__ int ats[TOPK_THREADS / WARP];
    __shared__ float prev_v;
    __shared__ int prev_i;
    int nan_seen = 0;
    for (int i = tid; i < n; i += TOPK_THREADS) {
        nan_seen |= x[i] != x[i];
    }
    nan_seen = __syncthreads_or(nan_seen);
    if (tid == 0) {
        prev_v = __int_as_float(0x7f800000);  // +inf at index -1: every pair comes after it
        prev_i = -1;
        out[2 * k] = nan_seen;
    }
    __syncthreads();
    for (int r = 0; r < k; ++r) {
        const float pv = prev_v;
        const int pi = prev_i;
        float best = -__int_as_float(0x7f800000);
        int at = 0x7fffffff;
        for (int i = tid; i < n; i += TOPK_THREADS) {
            const float v = x[i];
            if (before(pv, pi, v, i) && before(v, i, best, at)) {
                best = v;
                at = i;
            }
        }
#pragma unroll
        for (int offset = WARP / 2; offset > 0; offset >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, offset, WARP);
            const int oa = __shfl_xor_sync(0xffffffffu, at, offset, WARP);
            if (before(ob, oa, best, at)) {
                best = ob;
                at = oa;
            }
        }
        if (lane == 0) {
            bests[warp] = best;
            ats[warp] = at;
        }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < TOPK_THREADS / WARP; ++w) {
                if (before(bests[w], ats[w], best, at)) {
                    best = bests[w];
                    at = ats[w];
                }
            }
            const bool found = at != 0x7fffffff;
            out[r] = found ? at : -1;
            out[k + r] = __float_as_int(found ? best : -__int_as_float(0x7f800000));
            prev_v = best;
            prev_i = found ? at : 0x7fffffff;
        }
        __syncthreads();
    }
}
