// The activation of a one-row product as q8_1 blocks (ggml's quantize_q8_1 on the GPU).
//
// One thread per value, a warp per block of 32: amax by a butterfly of fmaxf (exact in any
// order), the sum by a butterfly of f32 additions (xor 16, 8, 4, 2, 1), d = amax / 127,
// q = roundf(x / d) (half away from zero; 0 when amax is 0), and lane 0 stores d and the sum
// as f16 (round to nearest even). n must be a multiple of 32.
#include "mmvq_common.cuh"

extern "C" __global__ void quantize_q8_1(const float *__restrict__ x,
                                         block_q8_1 *__restrict__ y, int n) {
    const int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const float xi = x[i];
    float amax = fabsf(xi);
    float sum = xi;
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset, WARP));
        sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset, WARP));
    }
    const float d = __fdiv_rn(amax, 127.0f);
    const signed char q = amax == 0.0f ? 0 : (signed char)roundf(__fdiv_rn(xi, d));
    block_q8_1 *b = y + i / QK;
    b->qs[i % QK] = q;
    if (i % QK == 0) {
        b->d = f2h(d);
        b->s = f2h(sum);
    }
}
