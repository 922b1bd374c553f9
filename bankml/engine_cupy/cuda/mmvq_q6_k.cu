// One-row product of Q6_K weights (super-blocks of 256: 128 bytes of low 4 bits, 64 bytes of
// high 2 bits, 16 int8 scales, f16 d) with a q8_1 activation; ggml's vec_dot_q6_K_q8_1: a
// thread takes one word of low bits (4 values in each of two 32-value runs), adds
// d8_i * (dot_i * scale_i) for both into an f32 sum, then d * sum. The quants are
// (low | high << 4) - 32, the subtraction byte-wise (__vsub4).
#include "mmvq_common.cuh"

struct Q6_K {
    static constexpr int QI = 32, VDR = 1, BS = 210, QKW = 256;
    static __device__ __forceinline__ float vec_dot(const u8 *b, const block_q8_1 *y, int iqs) {
        const int bq8_offset = 4 * (iqs / 16) + (iqs % 16) / 8;
        const int scale_offset = 8 * (iqs / 16) + (iqs % 16) / 4;
        const int vh_shift = 2 * ((iqs % 16) / 8);
        const int vl = int_b2(b, iqs);
        const int vh = int_b2(b + 128, 8 * (iqs / 16) + iqs % 8) >> vh_shift;
        const signed char *scales = (const signed char *)(b + 192) + scale_offset;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const block_q8_1 *yi = y + bq8_offset + 2 * i;
            const int sc = scales[4 * i];
            const int vil = (vl >> (4 * i)) & 0x0F0F0F0F;
            const int vih = ((vh >> (4 * i)) << 4) & 0x30303030;
            const int vi = __vsub4(vil | vih, 0x20202020);
            const int dot = __dp4a(vi, int_q8(yi, iqs % 8), 0);
            sum = __fadd_rn(sum, __fmul_rn(h2f(yi->d), __int2float_rn(dot * sc)));
        }
        return __fmul_rn(h2f(*(const u16 *)(b + 208)), sum);
    }
};

MMVQ_KERNEL(mmvq_q6_k, Q6_K)
MMVQ_ROWS_KERNEL(mmvq_q6_k_rows, Q6_K)
