// The prefill's kernels (docs/modules/device_prefill.md): n prompt rows at once, activations as
// f16 rows for the cuBLAS products, the residual stream x kept in f32. Each follows its decode
// step twin (rms_norm_q8_1.cu, rope_kv_f16.cu, attn_decode_f16.cu, swiglu_q8_1.cu, get_rows.cu)
// row by row, with blockIdx.y (or blockIdx.x for the norm) choosing the row, and f16 where the
// step has q8_1. Every float operation carries its rounding, as there.
#include "step_common.cuh"

#define NORM_THREADS 256
#define ATTN_WARPS 4

// the embedding rows of ids[0..n-1] (row blockIdx.y) as f32, from Q8_0 blocks or an f32 table
extern "C" __global__ void get_rows_q8_0_n(const u8 *__restrict__ w, const int *__restrict__ ids,
                                           float *__restrict__ dst, int ncols) {
    const int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= ncols) {
        return;
    }
    const u8 *b = w + ((size_t)ids[blockIdx.y] * (ncols / QK) + i / QK) * 34;
    const float d = h2f((u16)(b[0] | (b[1] << 8)));
    dst[(size_t)blockIdx.y * ncols + i] = __fmul_rn(d, (float)(signed char)b[2 + i % QK]);
}

extern "C" __global__ void get_rows_f32_n(const float *__restrict__ w, const int *__restrict__ ids,
                                          float *__restrict__ dst, int ncols) {
    const int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < ncols) {
        dst[(size_t)blockIdx.y * ncols + i] = w[(size_t)ids[blockIdx.y] * ncols + i];
    }
}

// Row blockIdx.x of x [rows, n]: x += f32(delta) (when has_delta: the last product, f16), then
// rms_norm_q8_1.cu's sum of squares (thread t strided, butterflies, warps in order),
// scale = 1 / sqrt(sum / n + eps), y = f16((x * scale) * weight).
extern "C" __global__ void __launch_bounds__(NORM_THREADS, 1)
    add_rms_norm_f16(float *__restrict__ x, const u16 *__restrict__ delta, int has_delta,
                     const float *__restrict__ weight, u16 *__restrict__ y, int n, float eps) {
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    constexpr int nwarps = NORM_THREADS / WARP;
    float *xr = x + (size_t)blockIdx.x * n;
    const u16 *dr = delta + (size_t)blockIdx.x * n;
    u16 *yr = y + (size_t)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = tid; i < n; i += NORM_THREADS) {
        float xi = xr[i];
        if (has_delta) {
            xi = __fadd_rn(xi, h2f(dr[i]));
            xr[i] = xi;
        }
        ss = __fadd_rn(ss, __fmul_rn(xi, xi));
    }
    ss = warp_sum(ss);
    __shared__ float partial[nwarps];
    if (lane == 0) {
        partial[warp] = ss;
    }
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < nwarps; ++k) {
        total = __fadd_rn(total, partial[k]);
    }
    const float scale =
        __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, (float)n), eps)));
    for (int i = tid; i < n; i += NORM_THREADS) {
        yr[i] = f2h(__fmul_rn(__fmul_rn(xr[i], scale), weight[i]));
    }
}

// rope_kv_f16.cu for row r = blockIdx.y at position pos[0] + r: q, k, v are the products' f16
// rows [n, n_head * hd], [n, n_head_kv * hd] (twice); Q comes out as f16 rows, K and V go into
// the cache [n_head_kv, n_ctx, hd] at that position.
extern "C" __global__ void rope_kv_f16_n(const u16 *__restrict__ q, const u16 *__restrict__ k,
                                         const u16 *__restrict__ v,
                                         const float *__restrict__ bias, int has_bias,
                                         const int *__restrict__ pos,
                                         const float *__restrict__ cos_table,
                                         const float *__restrict__ sin_table,
                                         u16 *__restrict__ q_out, u16 *__restrict__ k_cache,
                                         u16 *__restrict__ v_cache, int n_head, int n_head_kv,
                                         int hd, int n_ctx, int neox) {
    const int i = blockDim.x * blockIdx.x + threadIdx.x;
    const int r = blockIdx.y;
    const int half = hd / 2;
    const int nq = n_head * half, nk = n_head_kv * half, nv = n_head_kv * hd;
    const int p = pos[0] + r;
    if (i < nq + nk) {
        const bool is_q = i < nq;
        const int j = is_q ? i : i - nq;
        const int head = j / half, c = j % half;
        const int ia = neox ? c : 2 * c, ib = neox ? c + half : 2 * c + 1;
        const u16 *src = is_q ? q + (size_t)r * n_head * hd : k + (size_t)r * nv;
        float a = h2f(src[head * hd + ia]), b = h2f(src[head * hd + ib]);
        if (has_bias) {
            const float *bs = bias + (is_q ? 0 : n_head * hd);
            a = __fadd_rn(a, bs[head * hd + ia]);
            b = __fadd_rn(b, bs[head * hd + ib]);
        }
        const float cs = cos_table[p * half + c], sn = sin_table[p * half + c];
        const float ra = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
        const float rb = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
        if (is_q) {
            u16 *row = q_out + (size_t)r * n_head * hd;
            row[head * hd + ia] = f2h(ra);
            row[head * hd + ib] = f2h(rb);
        } else {
            u16 *row = k_cache + ((size_t)head * n_ctx + p) * hd;
            row[ia] = f2h(ra);
            row[ib] = f2h(rb);
        }
    } else if (i < nq + nk + nv) {
        const int j = i - nq - nk;
        float val = h2f(v[(size_t)r * nv + j]);
        if (has_bias) {
            val = __fadd_rn(val, bias[(n_head + n_head_kv) * hd + j]);
        }
        v_cache[((size_t)(j / hd) * n_ctx + p) * hd + j % hd] = f2h(val);
    }
}

// Causal attention of prompt row r = blockIdx.y (position pos[0] + r, so T = pos[0] + r + 1
// positions of the cache, the earlier rows' K and V stored by rope_kv_f16_n) for head
// blockIdx.x: attn_decode_f16.cu's order exactly (scores per warp, the max, exp_rn, their sum,
// each output dim in position order), the output an f16 row [n, n_head * hd]. scores: f32
// scratch [n, n_head, n_ctx].
extern "C" __global__ void __launch_bounds__(ATTN_WARPS *WARP, 1)
    attn_prefill_f16(const u16 *__restrict__ q, const u16 *__restrict__ k_cache,
                     const u16 *__restrict__ v_cache, const int *__restrict__ pos,
                     float *__restrict__ scores, u16 *__restrict__ out, int n_head,
                     int n_head_kv, int hd, int n_ctx, float scale) {
    const int h = blockIdx.x, r = blockIdx.y, tid = threadIdx.x, lane = tid % WARP,
              warp = tid / WARP;
    const int kvh = h / (n_head / n_head_kv);
    const int T = pos[0] + r + 1;
    const u16 *qh = q + ((size_t)r * n_head + h) * hd;
    const u16 *K = k_cache + (size_t)kvh * n_ctx * hd;
    const u16 *V = v_cache + (size_t)kvh * n_ctx * hd;
    float *s = scores + ((size_t)r * n_head + h) * n_ctx;
    __shared__ float red[ATTN_WARPS];

    for (int t = warp; t < T; t += ATTN_WARPS) {
        float dot = 0.0f;
        for (int d = lane; d < hd; d += WARP) {
            dot = __fadd_rn(dot, __fmul_rn(h2f(qh[d]), h2f(K[(size_t)t * hd + d])));
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
    u16 *o = out + ((size_t)r * n_head + h) * hd;
    for (int d = tid; d < hd; d += ATTN_WARPS * WARP) {
        float acc = 0.0f;
        for (int t = 0; t < T; ++t) {
            acc = __fadd_rn(acc, __fmul_rn(s[t], h2f(V[(size_t)t * hd + d])));
        }
        o[d] = f2h(__fdiv_rn(acc, total));
    }
}

// silu(gate) * up over n values of f16 rows, as swiglu_q8_1.cu, the result rounded to f16
extern "C" __global__ void swiglu_f16(const u16 *__restrict__ gate, const u16 *__restrict__ up,
                                      u16 *__restrict__ y, int n) {
    const int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const float g = h2f(gate[i]);
    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, exp_rn(-g)));
    y[i] = f2h(__fmul_rn(silu, h2f(up[i])));
}

// the sequence's position moved past the prompt's other rows (argmax_f32 adds the last one)
extern "C" __global__ void advance_pos(int *__restrict__ pos, int by) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        pos[0] += by;
    }
}
