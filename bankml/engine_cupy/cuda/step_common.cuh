// bankml's decode-step kernels: shared definitions (docs/modules/device_step.md).
//
// As in mmvq_common.cuh, every float operation carries its rounding (__fadd_rn, __fmul_rn, ...)
// and the options carry --fmad=false, so the NumPy twins (bankml/engine_cupy/device_twins.py)
// round where these do. exp_rn is written out of IEEE operations, not CUDA's expf, for the same
// reason: its twin computes the same bits.
#pragma once
#include "mmvq_common.cuh"

// lane 0's f32 sum over a warp by the xor butterfly (16, 8, 4, 2, 1)
static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) {
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, offset, WARP));
    }
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset, WARP));
    }
    return v;
}

// One warp turns its 32 values (lane l holds value l of the block) into a q8_1 block, as
// quantize_q8_1.cu does: d = amax / 127, q = roundf(v / d), s = the butterfly sum, both f16.
static __device__ __forceinline__ void quantize_lane(float v, int lane, block_q8_1 *b) {
    float amax = fabsf(v);
    float sum = v;
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset, WARP));
        sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset, WARP));
    }
    const float d = __fdiv_rn(amax, 127.0f);
    b->qs[lane] = amax == 0.0f ? 0 : (signed char)roundf(__fdiv_rn(v, d));
    if (lane == 0) {
        b->d = f2h(d);
        b->s = f2h(sum);
    }
}

// e^x from IEEE operations: n = rint(x log2 e), r = x - n ln2 (two parts, n ln2_hi exact),
// e^r by Horner's rule on the Taylor series to r^7, times 2^n built in the exponent bits.
// 0 below -87, +inf above 88.
static __device__ __forceinline__ float exp_rn(float x) {
    if (x < -87.0f) {
        return 0.0f;
    }
    if (x > 88.0f) {
        return __int_as_float(0x7f800000);
    }
    const float n = rintf(__fmul_rn(x, 1.44269504f));
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, 0.693145751953125f)),
                              __fmul_rn(n, 1.42860677e-06f));
    float p = 1.98412698e-04f;
    p = __fadd_rn(__fmul_rn(p, r), 1.38888889e-03f);
    p = __fadd_rn(__fmul_rn(p, r), 8.33333333e-03f);
    p = __fadd_rn(__fmul_rn(p, r), 4.16666667e-02f);
    p = __fadd_rn(__fmul_rn(p, r), 1.66666667e-01f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    return __fmul_rn(p, __int_as_float(((int)n + 127) << 23));
}
