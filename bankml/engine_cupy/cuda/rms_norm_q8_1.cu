// RMSNorm fused with the residual add before it and the q8_1 quantization after it: one thread
// block of NORM_THREADS for the whole row.
//
// x += delta (when has_delta: the previous product's output, the residual stream kept in x);
// thread t adds the squares of x[t], x[t + NORM_THREADS], ... into an f32; each warp's partials
// by the butterfly (lane 0's), then every thread adds the warps' in warp order;
// scale = 1 / sqrt(sum / n + eps); warp w quantizes the q8_1 blocks w, w + NORM_THREADS/32, ...
// of (x * scale) * weight. n must be a multiple of 32.
#include "step_common.cuh"

#define NORM_THREADS 256

static __device__ __forceinline__ void rms_norm_row(float *__restrict__ x,
                                                    const float *__restrict__ delta,
                                                    int has_delta,
                                                    const float *__restrict__ weight,
                                                    block_q8_1 *__restrict__ y, int n,
                                                    float eps) {
    const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    constexpr int nwarps = NORM_THREADS / WARP;
    float ss = 0.0f;
    for (int i = tid; i < n; i += NORM_THREADS) {
        float xi = x[i];
        if (has_delta) {
            xi = __fadd_rn(xi, delta[i]);
            x[i] = xi;
        }
        ss = __fadd_rn(ss, __fmul_rn(xi, xi));
    }
    ss = warp_sum(ss);
    __shared__ float partial[nwarps];
    if (lane == 0) {
        partial[warp] = ss;
    }
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < nwarps; ++k) {
        total = __fadd_rn(total, partial[k]);
    }
    const float scale =
        __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(total, (float)n), eps)));
    for (int b = warp; b < n / QK; b += nwarps) {
        const int i = QK * b + lane;
        quantize_lane(__fmul_rn(__fmul_rn(x[i], scale), weight[i]), lane, y + b);
    }
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS, 1)
    rms_norm_q8_1(float *__restrict__ x, const float *__restrict__ delta, int has_delta,
                  const float *__restrict__ weight, block_q8_1 *__restrict__ y, int n, float eps) {
    rms_norm_row(x, delta, has_delta, weight, y, n, eps);
}

// The batched step's: thread block r takes row r of x, delta ([rows, n]) and y ([rows, n/32]).
extern "C" __global__ void __launch_bounds__(NORM_THREADS, 1)
    rms_norm_q8_1_rows(float *__restrict__ x, const float *__restrict__ delta, int has_delta,
                       const float *__restrict__ weight, block_q8_1 *__restrict__ y, int n,
                       float eps) {
    const size_t r = blockIdx.x;
    rms_norm_row(x + r * n, delta + (has_delta ? r * n : 0), has_delta, weight, y + r * (n / QK),
                 n, eps);
}
