// One-row product of Q5_0 weights (f16 d, 4 bytes of fifth bits, 16 bytes of 4-bit quants)
// with a q8_1 activation; ggml's vec_dot_q5_0_q8_1: the fifth bits moved into bit 4 of each
// byte, then d * (sumi * d8 - 8 * s8) (the offset 16 over the 8 values of a word pair, halved).
#include "mmvq_common.cuh"

struct Q5_0 {
    static constexpr int QI = 4, VDR = 2, BS = 22, QKW = 32;
    static __device__ __forceinline__ float vec_dot(const u8 *b, const block_q8_1 *y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < VDR; ++i) {
            const int vl = int_b2(b + 6, iqs + i);
            const int vh = int_b2(b + 2, 0) >> (4 * (iqs + i));
            int v0 = vl & 0x0F0F0F0F;
            v0 |= (vh << 4) & 0x00000010;
            v0 |= (vh << 11) & 0x00001000;
            v0 |= (vh << 18) & 0x00100000;
            v0 |= (vh << 25) & 0x10000000;
            sumi = __dp4a(v0, int_q8(y, iqs + i), sumi);
            int v1 = (vl >> 4) & 0x0F0F0F0F;
            v1 |= (vh >> 12) & 0x00000010;
            v1 |= (vh >> 5) & 0x00001000;
            v1 |= (vh << 2) & 0x00100000;
            v1 |= (vh << 9) & 0x10000000;
            sumi = __dp4a(v1, int_q8(y, iqs + i + QI), sumi);
        }
        const float d = h2f(*(const u16 *)b);
        const float t = __fsub_rn(__fmul_rn(__int2float_rn(sumi), h2f(y->d)),
                                  __fmul_rn((float)(16 * VDR / QI), h2f(y->s)));
        return __fmul_rn(d, t);
    }
};

MMVQ_KERNEL(mmvq_q5_0, Q5_0)
MMVQ_ROWS_KERNEL(mmvq_q5_0_rows, Q5_0)
