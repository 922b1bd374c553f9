// One-row product of Q8_0 weights (f16 d, 32 int8 quants) with a q8_1 activation; ggml's
// vec_dot_q8_0_q8_1: (d * d8) * sumi over a thread's two words (8 of the block's 32 values).
#include "mmvq_common.cuh"

struct Q8_0 {
    static constexpr int QI = 8, VDR = 2, BS = 34, QKW = 32;
    static __device__ __forceinline__ float vec_dot(const u8 *b, const block_q8_1 *y, int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < VDR; ++i) {
            sumi = __dp4a(int_b2(b + 2, iqs + i), int_q8(y, iqs + i), sumi);
        }
        const float d = h2f(*(const u16 *)b);
        return __fmul_rn(__fmul_rn(d, h2f(y->d)), __int2float_rn(sumi));
    }
};

MMVQ_KERNEL(mmvq_q8_0, Q8_0)
MMVQ_ROWS_KERNEL(mmvq_q8_0_rows, Q8_0)
