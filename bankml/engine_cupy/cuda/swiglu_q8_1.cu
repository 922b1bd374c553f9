// SwiGLU fused with the q8_1 quantization of its output: one thread per value, a warp per
// q8_1 block: v = (g / (1 + e^-g)) * u, e^x by exp_rn. n must be a multiple of 32.
#include "step_common.cuh"

extern "C" __global__ void swiglu_q8_1(const float *__restrict__ gate,
                                       const float *__restrict__ up, block_q8_1 *__restrict__ y,
                                       int n) {
    const int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const float g = gate[i];
    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, exp_rn(-g)));
    quantize_lane(__fmul_rn(silu, up[i]), i % QK, y + i / QK);
}

// The batched step's: grid (blocks of a row, rows); row r of gate, up ([rows, n]) and y.
extern "C" __global__ void swiglu_q8_1_rows(const float *__restrict__ gate,
                                            const float *__restrict__ up,
                                            block_q8_1 *__restrict__ y, int n) {
    const int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const size_t r = blockIdx.y;
    const float g = gate[r * n + i];
    const float silu = __fdiv_rn(g, __fadd_rn(1.0f, exp_rn(-g)));
    quantize_lane(__fmul_rn(silu, up[r * n + i]), i % QK, y + r * (n / QK) + i / QK);
}
