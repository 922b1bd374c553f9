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

// The batched step's: grid (blocks of a row, rows); row r is the embedding of token[slots[r]]
// (each slot's next token, held on the device), into dst [rows, ncols].
extern "C" __global__ void get_rows_q8_0_rows(const u8 *__restrict__ w,
                                              const int *__restrict__ token,
                                              const int *__restrict__ slots,
                                              float *__restrict__ dst, int ncols) {
    const int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= ncols) {
        return;
    }
    const int id = token[slots[blockIdx.y]];
    const u8 *b = w + ((size_t)id * (ncols / QK) + i / QK) * 34;
    const float d = h2f((u16)(b[0] | (b[1] << 8)));
    dst[(size_t)blockIdx.y * ncols + i] = __fmul_rn(d, (float)(signed char)b[2 + i % QK]);
}

extern "C" __global__ void get_rows_f32_rows(const float *__restrict__ w,
                                             const int *__restrict__ token,
                                             const int *__restrict__ slots,
                                             float *__restrict__ dst, int ncols) {
    const int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < ncols) {
        dst[(size_t)blockIdx.y * ncols + i] = w[(size_t)token[slots[blockIdx.y]] * ncols + i];
    }
}
