// RoPE of Q and K at the position held on the device, K and V stored into the layer's f16
// cache there, Q kept rounded to f16 (the one-row attention's Q, as K's type).
//
// One thread per rotated pair of Q and K, then one per value of V. The bias (qwen2) is added
// first when has_bias. Pairs are (i, i + hd/2) when neox, else (2i, 2i + 1);
// a' = a cos - b sin, b' = a sin + b cos, cos and sin read from the model's table at
// [pos, i] (computed once on the host, ggml's angles). Cache layout: [n_head_kv, n_ctx, hd].
#include "step_common.cuh"

static __device__ __forceinline__ void rope_kv_one(
    int i, const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
    const float *__restrict__ bias, int has_bias, int p, const float *__restrict__ cos_table,
    const float *__restrict__ sin_table, float *__restrict__ q_out, u16 *__restrict__ k_cache,
    u16 *__restrict__ v_cache, int n_head, int n_head_kv, int hd, int n_ctx, int neox) {
    const int half = hd / 2;
    const int nq = n_head * half, nk = n_head_kv * half, nv = n_head_kv * hd;
    if (i < nq + nk) {
        const bool is_q = i < nq;
        const int j = is_q ? i : i - nq;
        const int head = j / half, c = j % half;
        const int ia = neox ? c : 2 * c, ib = neox ? c + half : 2 * c + 1;
        const float *src = is_q ? q : k;
        float a = src[head * hd + ia], b = src[head * hd + ib];
        if (has_bias) {
            const float *bs = bias + (is_q ? 0 : n_head * hd);
            a = __fadd_rn(a, bs[head * hd + ia]);
            b = __fadd_rn(b, bs[head * hd + ib]);
        }
        const float cs = cos_table[p * half + c], sn = sin_table[p * half + c];
        const float ra = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
        const float rb = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
        if (is_q) {
            q_out[head * hd + ia] = h2f(f2h(ra));
            q_out[head * hd + ib] = h2f(f2h(rb));
        } else {
            u16 *row = k_cache + ((size_t)head * n_ctx + p) * hd;
            row[ia] = f2h(ra);
            row[ib] = f2h(rb);
        }
    } else if (i < nq + nk + nv) {
        const int j = i - nq - nk;
        float val = v[j];
        if (has_bias) {
            val = __fadd_rn(val, bias[(n_head + n_head_kv) * hd + j]);
        }
        v_cache[((size_t)(j / hd) * n_ctx + p) * hd + j % hd] = f2h(val);
    }
}

extern "C" __global__ void rope_kv_f16(const float *__restrict__ q, const float *__restrict__ k,
                                       const float *__restrict__ v,
                                       const float *__restrict__ bias, int has_bias,
                                       const int *__restrict__ pos,
                                       const float *__restrict__ cos_table,
                                       const float *__restrict__ sin_table,
                                       float *__restrict__ q_out, u16 *__restrict__ k_cache,
                                       u16 *__restrict__ v_cache, int n_head, int n_head_kv,
                                       int hd, int n_ctx, int neox) {
    rope_kv_one(blockDim.x * blockIdx.x + threadIdx.x, q, k, v, bias, has_bias, pos[0],
                cos_table, sin_table, q_out, k_cache, v_cache, n_head, n_head_kv, hd, n_ctx,
                neox);
}

// The batched step's: grid (blocks of a row, rows). Row r of q, k, v and q_out ([rows, ...])
// is slot s = slots[r]'s: its position pos[s], its layer il of the pool's caches
// ([slots, n_layer, n_head_kv, n_ctx, hd]).
extern "C" __global__ void rope_kv_f16_rows(const float *__restrict__ q,
                                            const float *__restrict__ k,
                                            const float *__restrict__ v,
                                            const float *__restrict__ bias, int has_bias,
                                            const int *__restrict__ slots,
                                            const int *__restrict__ pos,
                                            const float *__restrict__ cos_table,
                                            const float *__restrict__ sin_table,
                                            float *__restrict__ q_out, u16 *__restrict__ k_pool,
                                            u16 *__restrict__ v_pool, int il, int n_layer,
                                            int n_head, int n_head_kv, int hd, int n_ctx,
                                            int neox) {
    const size_t r = blockIdx.y;
    const int s = slots[r];
    const size_t nq = (size_t)n_head * hd, nkv = (size_t)n_head_kv * hd;
    const size_t cache = ((size_t)s * n_layer + il) * nkv * n_ctx;
    rope_kv_one(blockDim.x * blockIdx.x + threadIdx.x, q + r * nq, k + r * nkv, v + r * nkv, bias,
                has_bias, pos[s], cos_table, sin_table, q_out + r * nq, k_pool + cache,
                v_pool + cache, n_head, n_head_kv, hd, n_ctx, neox);
}
