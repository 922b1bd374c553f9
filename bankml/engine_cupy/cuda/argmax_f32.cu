// The greedy choice on the device: the index of the largest of n logits (the lowest index among
// equals), written to id[0]; the step's position pos[0] moves on by one. One thread block of
// ARGMAX_THREADS. The result does not depend on the order of the comparisons.
#include "step_common.cuh"

#define ARGMAX_THREADS 1024

static __device__ __forceinline__ void argmax_row(const float *__restrict__ x, int n,
                                                  int *__restrict__ id, int *__restrict__ pos) {
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    float best = -__int_as_float(0x7f800000);
    int at = 0x7fffffff;
    for (int i = tid; i < n; i += ARGMAX_THREADS) {
        if (x[i] > best) {
            best = x[i];
            at = i;
        }
    }
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, offset, WARP);
        const int oa = __shfl_xor_sync(0xffffffffu, at, offset, WARP);
        if (ob > best || (ob == best && oa < at)) {
            best = ob;
            at = oa;
        }
    }
    __shared__ float bests[ARGMAX_THREADS / WARP];
    __shared__ int ats[ARGMAX_THREADS / WARP];
    if (lane == 0) {
        bests[warp] = best;
        ats[warp] = at;
    }
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < ARGMAX_THREADS / WARP; ++w) {
            if (bests[w] > best || (bests[w] == best && ats[w] < at)) {
                best = bests[w];
                at = ats[w];
            }
        }
        id[0] = at;
        pos[0] += 1;
    }
}

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS, 1)
    argmax_f32(const float *__restrict__ x, int n, int *__restrict__ id, int *__restrict__ pos) {
    argmax_row(x, n, id, pos);
}

// The batched step's: thread block r takes row r of x ([rows, n]) for slot s = slots[r]: the
// row copied to the slot's logits (logits [slots, n]), its greedy choice into token[s], pos[s]
// moved on by one.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS, 1)
    argmax_f32_rows(const float *__restrict__ x, int n, const int *__restrict__ slots,
                    float *__restrict__ logits, int *__restrict__ token, int *__restrict__ pos) {
    const int s = slots[blockIdx.x];
    const float *row = x + (size_t)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += ARGMAX_THREADS) {
        logits[(size_t)s * n + i] = row[i];
    }
    argmax_row(row, n, token + s, pos + s);
}
