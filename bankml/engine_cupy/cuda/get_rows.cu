// The embedding row of the token id[0], as f32: from Q8_0 blocks (d * q, exact in f32) or from
// an f32 table. One thread per value.
#include "step_common.cuh"

extern "C" __global__ void get_rows_q8_0(const u8 *__restrict__ w, const int *__restrict__ id,
                                         float *__restrict__ dst, int ncols) {
    const int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= ncols) {
        return;
    }
    const u8 *b = w + ((size_t)id[0] * (ncols / QK) + i / QK) * 34;
    const float d = h2f((u16)(b[0] | (b[1] << 8)));
    dst[i] = __fmul_rn(d, (float)(signed char)b[2 + i % QK]);
}

extern "C" __global__ void get_rows_f32(const float *__restrict__ w, const int *__restrict__ id,
                                        float *__restrict__ dst, int ncols) {
    const int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < ncols) {
        dst[i] = w[(size_t)id[0] * ncols + i];
    }
}
