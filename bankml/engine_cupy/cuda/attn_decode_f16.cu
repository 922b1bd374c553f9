// One-row attention over the f16 cache (GQA), its output quantized to q8_1 for the output
// product: one thread block of ATTN_WARPS warps per query head, T = pos + 1 positions.
//
// 1. score t (warp t % ATTN_WARPS): lane l adds q[d] * K[t, d] for d = l, l + 32, ... into an
//    f32, the butterfly sums the lanes (lane 0's), times scale; kept in scores[head, t];
// 2. m = the largest score (exact in any order);
// 3. thread j computes e_t = exp_rn(s_t - m) for t = j, j + blockDim, ... (kept in place of
//    the score) adding them into an f32; the sum is the warps' butterflies added in warp order;
// 4. thread d (d < hd, step blockDim) adds e_t * V[t, d] for t = 0.. T-1 in order, divides by
//    the sum;
// 5. warp w quantizes the head's q8_1 blocks w, w + ATTN_WARPS, ... (hd a multiple of 32).
#include "step_common.cuh"

#define ATTN_WARPS 4
#define ATTN_MAX_HD 256

static __device__ __forceinline__ void attn_decode_head(
    int h, const float *__restrict__ q, const u16 *__restrict__ k_cache,
    const u16 *__restrict__ v_cache, int T, float *__restrict__ scores,
    block_q8_1 *__restrict__ out, int n_head, int n_head_kv, int hd, int n_ctx, float scale) {
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    const int kvh = h / (n_head / n_head_kv);
    const float *qh = q + (size_t)h * hd;
    const u16 *K = k_cache + (size_t)kvh * n_ctx * hd;
    const u16 *V = v_cache + (size_t)kvh * n_ctx * hd;
    float *s = scores + (size_t)h * n_ctx;
    __shared__ float red[ATTN_WARPS];
    __shared__ float o[ATTN_MAX_HD];

    for (int t = warp; t < T; t += ATTN_WARPS) {
        float dot = 0.0f;
        for (int d = lane; d < hd; d += WARP) {
            dot = __fadd_rn(dot, __fmul_rn(qh[d], h2f(K[(size_t)t * hd + d])));
        }
        dot = warp_sum(dot);
        if (lane == 0) {
            s[t] = __fmul_rn(dot, scale);
        }
    }
    __syncthreads();
    float m = -__int_as_float(0x7f800000);
    for (int t = tid; t < T; t += ATTN_WARPS * WARP) {
        m = fmaxf(m, s[t]);
    }
    m = warp_max(m);
    if (lane == 0) {
        red[warp] = m;
    }
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int w = 1; w < ATTN_WARPS; ++w) {
        m = fmaxf(m, red[w]);
    }
    __syncthreads();
    float sum = 0.0f;
    for (int t = tid; t < T; t += ATTN_WARPS * WARP) {
        const float e = exp_rn(__fsub_rn(s[t], m));
        s[t] = e;
        sum = __fadd_rn(sum, e);
    }
    sum = warp_sum(sum);
    if (lane == 0) {
        red[warp] = sum;
    }
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) {
        total = __fadd_rn(total, red[w]);
    }
    for (int d = tid; d < hd; d += ATTN_WARPS * WARP) {
        float acc = 0.0f;
        for (int t = 0; t < T; ++t) {
            acc = __fadd_rn(acc, __fmul_rn(s[t], h2f(V[(size_t)t * hd + d])));
        }
        o[d] = __fdiv_rn(acc, total);
    }
    __syncthreads();
    for (int b = warp; b < hd / QK; b += ATTN_WARPS) {
        quantize_lane(o[QK * b + lane], lane, out + (size_t)h * (hd / QK) + b);
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS *WARP, 1)
    attn_decode_f16(const float *__restrict__ q, const u16 *__restrict__ k_cache,
                    const u16 *__restrict__ v_cache, const int *__restrict__ pos,
                    float *__restrict__ scores, block_q8_1 *__restrict__ out, int n_head,
                    int n_head_kv, int hd, int n_ctx, float scale) {
    attn_decode_head(blockIdx.x, q, k_cache, v_cache, pos[0] + 1, scores, out, n_head, n_head_kv,
                     hd, n_ctx, scale);
}

// The batched step's: grid (n_head, rows). Row r is slot s = slots[r]'s: its query
// (q [rows, n_head * hd]), layer il of its caches in the pool ([slots, n_layer, n_head_kv,
// n_ctx, hd]) over 0..pos[s], its scores' scratch ([slots, n_head, n_ctx]); out [rows, ...].
extern "C" __global__ void __launch_bounds__(ATTN_WARPS *WARP, 1)
    attn_decode_f16_rows(const float *__restrict__ q, const u16 *__restrict__ k_pool,
                         const u16 *__restrict__ v_pool, const int *__restrict__ slots,
                         const int *__restrict__ pos, float *__restrict__ scores,
                         block_q8_1 *__restrict__ out, int il, int n_layer, int n_head,
                         int n_head_kv, int hd, int n_ctx, float scale) {
    const size_t r = blockIdx.y;
    const int s = slots[r];
    const size_t cache = ((size_t)s * n_layer + il) * n_head_kv * (size_t)n_ctx * hd;
    attn_decode_head(blockIdx.x, q + r * n_head * hd, k_pool + cache, v_pool + cache, pos[s] + 1,
                     scores + (size_t)s * n_head * n_ctx, out + r * (n_head * hd / QK), n_head,
                     n_head_kv, hd, n_ctx, scale);
}
