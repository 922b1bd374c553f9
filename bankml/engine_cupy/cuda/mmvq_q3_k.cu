// One-row product of Q3_K weights (super-blocks of 256: 32 bytes of high bits, 64 bytes of
// 2-bit quants, 12 bytes of 6-bit scales, f16 d) with a q8_1 activation; ggml's
// vec_dot_q3_K_q8_1: a thread takes one word of quants (4 values in each of four 32-value
// runs), each value (low | high << 2) - 4 as (low) - (4 where its high bit is clear) byte-wise
// (__vsub4), and per run i adds d8_i * (dot_i * scale_i) into an f32 sum, then d * sum.
#include "mmvq_common.cuh"

struct Q3_K {
    static constexpr int QI = 16, VDR = 1, BS = 110, QKW = 256;
    static __device__ __forceinline__ float vec_dot(const u8 *b, const block_q8_1 *y, int iqs) {
        const int bq8_offset = 4 * (iqs / 8);
        const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
        const u8 *scales = b + 96;
        const int vl = int_b2(b + 32, iqs);
        // the high bits inverted, so that a clear bit subtracts 4
        const int vh = ~int_b2(b, iqs % 8) >> bq8_offset;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const block_q8_1 *yi = y + bq8_offset + i;
            const int isc = scale_offset + 2 * i;
            const int sc_low = (scales[isc % 8] >> (4 * (isc / 8))) & 0xF;
            const int sc_high = ((scales[8 + isc % 4] >> (2 * (isc / 4))) & 3) << 4;
            const int sc = (sc_low | sc_high) - 32;
            const int vil = (vl >> (2 * i)) & 0x03030303;
            const int vih = ((vh >> i) << 2) & 0x04040404;
            const int vi = __vsub4(vil, vih);
            const int dot = __dp4a(vi, int_q8(yi, iqs % 8), 0);
            sum = __fadd_rn(sum, __fmul_rn(h2f(yi->d), __int2float_rn(dot * sc)));
        }
        return __fmul_rn(h2f(*(const u16 *)(b + 108)), sum);
    }
};

MMVQ_KERNEL(mmvq_q3_k, Q3_K)
MMVQ_ROWS_KERNEL(mmvq_q3_k_rows, Q3_K)
