// One-row product of Q5_K weights (super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit
// scales and mins of the 8 sub-blocks, 32 bytes of fifth bits, 128 bytes of 4-bit quants) with
// a q8_1 activation; ggml's vec_dot_q5_K_q8_1: Q4_K's split (a thread takes two words of a
// 64-value group, 4 + 4 values of each of its two sub-blocks) with each value's fifth bit,
// bit (sub-block) of its byte in qh, moved into bit 4; per sub-block i it adds
// d8_i * (dot_i * scale_i) and d8_i * (sum_i * min_i) into two f32 sums, then
// d * sum_d - dmin * sum_m.
#include "mmvq_common.cuh"

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j
static __device__ __forceinline__ void scale_min_k5(int j, const u8 *q, int &sc, int &m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

struct Q5_K {
    static constexpr int QI = 32, VDR = 2, BS = 176, QKW = 256;
    static __device__ __forceinline__ float vec_dot(const u8 *b, const block_q8_1 *y, int iqs) {
        const int bq8_offset = 2 * ((iqs / 2) / 4);  // the first of the thread's two sub-blocks
        const int w = (iqs / 2) % 4;
        const u8 *ql = b + 48 + 16 * bq8_offset + 4 * w;
        const u8 *qh = b + 16 + 4 * w;
        const int vl0 = int_b4(ql, 0);
        const int vl1 = int_b4(ql, 4);
        const int vh0 = int_b4(qh, 0) >> bq8_offset;
        const int vh1 = int_b4(qh, 4) >> bq8_offset;
        float sum_d = 0.0f;
        float sum_m = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            int sc, m;
            scale_min_k5(bq8_offset + i, b + 4, sc, m);
            const block_q8_1 *yi = y + bq8_offset + i;
            const int u0 = int_q8(yi, w);
            const int u1 = int_q8(yi, w + 4);
            const int v0 = ((vl0 >> (4 * i)) & 0x0F0F0F0F) | (((vh0 >> i) << 4) & 0x10101010);
            const int v1 = ((vl1 >> (4 * i)) & 0x0F0F0F0F) | (((vh1 >> i) << 4) & 0x10101010);
            const int dot1 = __dp4a(v1, u1, __dp4a(v0, u0, 0));
            const int dot2 = __dp4a(0x01010101, u1, __dp4a(0x01010101, u0, 0));
            const float d8 = h2f(yi->d);
            sum_d = __fadd_rn(sum_d, __fmul_rn(d8, __int2float_rn(dot1 * sc)));
            sum_m = __fadd_rn(sum_m, __fmul_rn(d8, __int2float_rn(dot2 * m)));
        }
        const u16 *dm = (const u16 *)b;
        return __fsub_rn(__fmul_rn(h2f(dm[0]), sum_d), __fmul_rn(h2f(dm[1]), sum_m));
    }
};

MMVQ_KERNEL(mmvq_q5_k, Q5_K)
MMVQ_ROWS_KERNEL(mmvq_q5_k_rows, Q5_K)
