// One-row product of Q4_1 weights (f16 d, f16 m, 16 bytes of 4-bit quants) with a q8_1
// activation; ggml's vec_dot_q4_1_q8_1 with fast f16: d*d8 and m*s8 are f16 products, then
// sumi * (d*d8) + (m*s8) / 2 (each of the block's two threads adds half of the offset term).
#include "mmvq_common.cuh"

struct Q4_1 {
    static constexpr int QI = 4, VDR = 2, BS = 20, QKW = 32;
    static __device__ __forceinline__ float vec_dot(const u8 *b, const block_q8_1 *y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < VDR; ++i) {
            const int v = int_b4(b + 4, iqs + i);
            sumi = __dp4a(v & 0x0F0F0F0F, int_q8(y, iqs + i), sumi);
            sumi = __dp4a((v >> 4) & 0x0F0F0F0F, int_q8(y, iqs + i + QI), sumi);
        }
        const u16 *dm = (const u16 *)b;
        const float dd = hmul_f(dm[0], y->d);
        const float ms = hmul_f(dm[1], y->s);
        return __fadd_rn(__fmul_rn(__int2float_rn(sumi), dd), __fdiv_rn(ms, (float)(QI / VDR)));
    }
};

MMVQ_KERNEL(mmvq_q4_1, Q4_1)
MMVQ_ROWS_KERNEL(mmvq_q4_1_rows, Q4_1)
