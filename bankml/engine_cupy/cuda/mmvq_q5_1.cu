// One-row product of Q5_1 weights (f16 d, f16 m, 4 bytes of fifth bits, 16 bytes of 4-bit
// quants) with a q8_1 activation; ggml's vec_dot_q5_1_q8_1 with fast f16:
// sumi * f16(d*d8) + f16(m*s8) / 2.
#include "mmvq_common.cuh"

struct Q5_1 {
    static constexpr int QI = 4, VDR = 2, BS = 24, QKW = 32;
    static __device__ __forceinline__ float vec_dot(const u8 *b, const block_q8_1 *y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < VDR; ++i) {
            const int vl = int_b4(b + 8, iqs + i);
            const int vh = int_b4(b + 4, 0) >> (4 * (iqs + i));
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
        const u16 *dm = (const u16 *)b;
        const float dd = hmul_f(dm[0], y->d);
        const float ms = hmul_f(dm[1], y->s);
        return __fadd_rn(__fmul_rn(__int2float_rn(sumi), dd), __fdiv_rn(ms, (float)(QI / VDR)));
    }
};

MMVQ_KERNEL(mmvq_q5_1, Q5_1)
MMVQ_ROWS_KERNEL(mmvq_q5_1_rows, Q5_1)
