// One-row product of Q4_0 weights (GGUF blocks: f16 d, 16 bytes of 4-bit quants) with a q8_1
// activation; ggml's vec_dot_q4_0_q8_1 arithmetic: d * (sumi * d8 - 4 * s8) per thread's two
// words, the 4 subtracting the quants' offset 8 over the 8 values each word pair covers.
#include "mmvq_common.cuh"

struct Q4_0 {
    static constexpr int QI = 4, VDR = 2, BS = 18, QKW = 32;
    static __device__ __forceinline__ float vec_dot(const u8 *b, const block_q8_1 *y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < VDR; ++i) {
            const int v = int_b2(b + 2, iqs + i);
            sumi = __dp4a(v & 0x0F0F0F0F, int_q8(y, iqs + i), sumi);
            sumi = __dp4a((v >> 4) & 0x0F0F0F0F, int_q8(y, iqs + i + QI), sumi);
        }
        const float d = h2f(*(const u16 *)b);
        const float t = __fsub_rn(__fmul_rn(__int2float_rn(sumi), h2f(y->d)),
                                  __fmul_rn((float)(8 * VDR / QI), h2f(y->s)));
        return __fmul_rn(d, t);
    }
};

MMVQ_KERNEL(mmvq_q4_0, Q4_0)
MMVQ_ROWS_KERNEL(mmvq_q4_0_rows, Q4_0)
