// One-row product of Q2_K weights (super-blocks of 256: 16 bytes of 4-bit scales and mins, 64
// bytes of 2-bit quants, f16 d, f16 dmin) with a q8_1 activation; ggml's vec_dot_q2_K_q8_1: a
// thread takes one word of quants (4 values in each of four 32-value runs, the bit pairs
// 2i of its bytes), and per run i adds d8_i * (dot_i * scale_i) and d8_i * (min_i * sum_i)
// into two f32 sums, then d * sum_d - dmin * sum_m.
#include "mmvq_common.cuh"

struct Q2_K {
    static constexpr int QI = 16, VDR = 1, BS = 84, QKW = 256;
    static __device__ __forceinline__ float vec_dot(const u8 *b, const block_q8_1 *y, int iqs) {
        const int bq8_offset = 4 * (iqs / 8);
        const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
        const u8 *scales = b + scale_offset;
        const int v = int_b4(b + 16, iqs);
        float sum_d = 0.0f;
        float sum_m = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const block_q8_1 *yi = y + bq8_offset + i;
            const int u = int_q8(yi, iqs % 8);
            const int sc = scales[2 * i];
            const int vi = (v >> (2 * i)) & 0x03030303;
            int m = sc >> 4;
            m |= m << 8;
            m |= m << 16;
            const float d8 = h2f(yi->d);
            sum_d = __fadd_rn(sum_d, __fmul_rn(d8, __int2float_rn(__dp4a(vi, u, 0) * (sc & 0xF))));
            sum_m = __fadd_rn(sum_m, __fmul_rn(d8, __int2float_rn(__dp4a(m, u, 0))));
        }
        const u16 *dm = (const u16 *)(b + 80);
        return __fsub_rn(__fmul_rn(h2f(dm[0]), sum_d), __fmul_rn(h2f(dm[1]), sum_m));
    }
};

MMVQ_KERNEL(mmvq_q2_k, Q2_K)
MMVQ_ROWS_KERNEL(mmvq_q2_k_rows, Q2_K)
