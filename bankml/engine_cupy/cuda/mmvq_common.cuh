// bankml's one-row decode products: shared definitions (docs/modules/cuda_kernels.md).
//
// Every float operation is written with an explicit rounding (__fadd_rn, __fmul_rn, __fdiv_rn,
// PTX mul.rn.f16) so that no compiler contracts two of them into one fused multiply-add: the
// NumPy twins (bankml/engine_cupy/cuda_twins.py) round at exactly these points. Needs no
// header: the f16 conversions are PTX instructions (for HIP, clang's _Float16), the integer dot
// products __dp4a. The same sources compile for HIP (ROCm): the block below writes CUDA's names
// in HIP's terms, and nothing else differs.
#pragma once

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)
// No two operations are fused into one multiply-add, whatever the compiler's default (the
// options say -ffp-contract=off too): the twins round after every operation.
#pragma clang fp contract(off)

// A warp is 32 threads, as on CUDA. With width 32 a shuffle stays inside its 32-lane half of a
// 64-lane wavefront, so each butterfly, and each warp taken as threads 32w..32w+31, is CUDA's.
#define __shfl_xor_sync(mask, var, lane_mask, width) __shfl_xor(var, lane_mask, width)

// CUDA's explicitly rounded operations as plain IEEE ones: round to nearest even, no
// contraction (above), division and square root correctly rounded (HIP's default, which the
// options also ask for). Written here, not taken from a HIP release's headers, so that what
// the kernels compute does not depend on how a release writes CUDA's names.
static __device__ __forceinline__ float bankml_fadd_rn(float a, float b) { return a + b; }
static __device__ __forceinline__ float bankml_fsub_rn(float a, float b) { return a - b; }
static __device__ __forceinline__ float bankml_fmul_rn(float a, float b) { return a * b; }
static __device__ __forceinline__ float bankml_fdiv_rn(float a, float b) { return a / b; }
static __device__ __forceinline__ float bankml_fsqrt_rn(float a) { return __builtin_sqrtf(a); }
static __device__ __forceinline__ float bankml_int2float_rn(int i) { return (float)i; }
static __device__ __forceinline__ float bankml_int_as_float(int i) {
    return __builtin_bit_cast(float, i);
}
static __device__ __forceinline__ int bankml_float_as_int(float f) {
    return __builtin_bit_cast(int, f);
}
#define __fadd_rn bankml_fadd_rn
#define __fsub_rn bankml_fsub_rn
#define __fmul_rn bankml_fmul_rn
#define __fdiv_rn bankml_fdiv_rn
#define __fsqrt_rn bankml_fsqrt_rn
#define __int2float_rn bankml_int2float_rn
#define __int_as_float bankml_int_as_float
#define __float_as_int bankml_float_as_int

typedef signed char bankml_i8x4 __attribute__((ext_vector_type(4)));

// c + the four signed byte products of a and b, as __dp4a: AMD's dot instruction where the
// target has one (as ggml's HIP build picks it), else the same sum written out. The sum is
// exact either way, so every target gets the same integers.
static __device__ __forceinline__ int bankml_dp4a(int a, int b, int c) {
#if defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) || defined(__gfx942__) || \
    defined(__gfx950__) || defined(__gfx1030__) || defined(__gfx1031__) ||                      \
    defined(__gfx1032__) || defined(__gfx1033__) || defined(__gfx1034__) ||                     \
    defined(__gfx1035__) || defined(__gfx1036__)
    return __builtin_amdgcn_sdot4(a, b, c, false);
#elif defined(__GFX11__) || defined(__GFX12__)
    return __builtin_amdgcn_sudot4(true, a, true, b, c, false);
#else
    const bankml_i8x4 va = __builtin_bit_cast(bankml_i8x4, a);
    const bankml_i8x4 vb = __builtin_bit_cast(bankml_i8x4, b);
    return c + va[0] * vb[0] + va[1] * vb[1] + va[2] * vb[2] + va[3] * vb[3];
#endif
}
#define __dp4a bankml_dp4a

// a - b byte by byte, each byte wrapping, as __vsub4
static __device__ __forceinline__ int bankml_vsub4(int a, int b) {
    return __builtin_bit_cast(int, __builtin_bit_cast(bankml_i8x4, a) -
                                       __builtin_bit_cast(bankml_i8x4, b));
}
#define __vsub4 bankml_vsub4
#endif

typedef unsigned char u8;
typedef unsigned short u16;

#ifndef MMVQ_NWARPS
#define MMVQ_NWARPS 4  // warps per output row (one row per thread block), as ggml's generic table
#endif
#define WARP 32
#define QK 32  // values per q8_1 block (and per block of the non-K types)

// the activation: 32 int8 quants, f16 d (scale) and f16 s (d times the sum of the f32 values)
struct block_q8_1 {
    u16 d;
    u16 s;
    signed char qs[QK];
};

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)
// HIP (ROCm): clang's _Float16, whose conversions round to nearest even, subnormals kept, as
// PTX's cvt.f32.f16 and cvt.rn.f16.f32 do. A product of two f16 values is exact in f32 (22
// significant bits at most, exponents well inside f32's range), so the f32 product rounded once
// to f16 is the correctly rounded f16 product, mul.rn.f16's bits.
static __device__ __forceinline__ float h2f(u16 h) {
    return (float)__builtin_bit_cast(_Float16, h);
}

static __device__ __forceinline__ u16 f2h(float f) { return __builtin_bit_cast(u16, (_Float16)f); }

static __device__ __forceinline__ float hmul_f(u16 a, u16 b) {
    return h2f(f2h(__fmul_rn(h2f(a), h2f(b))));
}
#else
static __device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

static __device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// f16 product, rounded to f16 (ggml's __hmul2 where fast f16 arithmetic is available)
static __device__ __forceinline__ float hmul_f(u16 a, u16 b) {
    u16 r;
    asm("mul.rn.f16 %0, %1, %2;" : "=h"(r) : "h"(a), "h"(b));
    return h2f(r);
}
#endif

// the i-th 32-bit word of a 2-byte aligned buffer, and of a 4-byte aligned one
static __device__ __forceinline__ int int_b2(const u8 *x, int i) {
    const u16 *x16 = (const u16 *)x;
    return (int)((unsigned)x16[2 * i] | ((unsigned)x16[2 * i + 1] << 16));
}

static __device__ __forceinline__ int int_b4(const u8 *x, int i) { return ((const int *)x)[i]; }

static __device__ __forceinline__ int int_q8(const block_q8_1 *y, int i) {
    return ((const int *)y->qs)[i];
}

// One output row per thread block of MMVQ_NWARPS warps. Thread t (= 32*warp + lane) takes the
// weight blocks t / (QI/VDR), + BLOCKS_PER_ITER, ..., and in each the VDR words from
// VDR * (t % (QI/VDR)); its partial sum is a float accumulated in that order. Warps 1.. hand
// their partials to warp 0 through shared memory, which adds them in warp order, lane by lane;
// then a butterfly over the 32 lanes (xor 16, 8, 4, 2, 1) and lane 0 writes the row. A weight
// block holds Q::QKW values (32, or 256 for the K-quants): QKW/32 q8_1 blocks of the activation.
template <class Q>
static __device__ __forceinline__ void mmvq_row(const u8 *__restrict__ w,
                                                const block_q8_1 *__restrict__ y,
                                                float *__restrict__ dst, int ncols) {
    constexpr int per_block = Q::QI / Q::VDR;
    constexpr int blocks_per_iter = Q::VDR * MMVQ_NWARPS * WARP / Q::QI;
    const int row = blockIdx.x;
    const int tid = WARP * threadIdx.y + threadIdx.x;
    const int blocks_per_row = ncols / Q::QKW;
    const u8 *wrow = w + (size_t)row * blocks_per_row * Q::BS;
    const int kqs = Q::VDR * (tid % per_block);

    float tmp = 0.0f;
    for (int kbx = tid / per_block; kbx < blocks_per_row; kbx += blocks_per_iter) {
        tmp = __fadd_rn(tmp, Q::vec_dot(wrow + (size_t)kbx * Q::BS, y + kbx * (Q::QKW / QK), kqs));
    }

    __shared__ float partial[MMVQ_NWARPS > 1 ? MMVQ_NWARPS - 1 : 1][WARP];
    if (threadIdx.y > 0) {
        partial[threadIdx.y - 1][threadIdx.x] = tmp;
    }
    __syncthreads();
    if (threadIdx.y > 0) {
        return;
    }
#pragma unroll
    for (int l = 0; l < MMVQ_NWARPS - 1; ++l) {
        tmp = __fadd_rn(tmp, partial[l][threadIdx.x]);
    }
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset >>= 1) {
        tmp = __fadd_rn(tmp, __shfl_xor_sync(0xffffffffu, tmp, offset, WARP));
    }
    if (threadIdx.x == 0) {
        dst[row] = tmp;
    }
}

// Several rows of the activation (up to MMVQ_MAX_ROWS: the slots of one batched decode step,
// ggml's ncols_dst) against the same weights in one launch: each weight block a thread takes is
// dotted with every row's q8_1 blocks in turn, and each row's partial sum goes through exactly
// the additions of mmvq_row (same blocks, same order, same reduction), so row j's outputs have
// the bits its one-row product has. y: nrows_y activations of ncols / 32 q8_1 blocks each;
// dst: [nrows_y, gridDim.x].
#define MMVQ_MAX_ROWS 8

template <class Q>
static __device__ __forceinline__ void mmvq_rows(const u8 *__restrict__ w,
                                                 const block_q8_1 *__restrict__ y,
                                                 float *__restrict__ dst, int ncols,
                                                 int nrows_y) {
    constexpr int per_block = Q::QI / Q::VDR;
    constexpr int blocks_per_iter = Q::VDR * MMVQ_NWARPS * WARP / Q::QI;
    const int row = blockIdx.x;
    const int tid = WARP * threadIdx.y + threadIdx.x;
    const int blocks_per_row = ncols / Q::QKW;
    const int y_stride = ncols / QK;
    const u8 *wrow = w + (size_t)row * blocks_per_row * Q::BS;
    const int kqs = Q::VDR * (tid % per_block);

    float tmp[MMVQ_MAX_ROWS];
#pragma unroll
    for (int j = 0; j < MMVQ_MAX_ROWS; ++j) {
        tmp[j] = 0.0f;
    }
    for (int kbx = tid / per_block; kbx < blocks_per_row; kbx += blocks_per_iter) {
        const u8 *b = wrow + (size_t)kbx * Q::BS;
#pragma unroll
        for (int j = 0; j < MMVQ_MAX_ROWS; ++j) {
            if (j < nrows_y) {
                const block_q8_1 *yj = y + j * y_stride + kbx * (Q::QKW / QK);
                tmp[j] = __fadd_rn(tmp[j], Q::vec_dot(b, yj, kqs));
            }
        }
    }

    __shared__ float partial[MMVQ_NWARPS > 1 ? MMVQ_NWARPS - 1 : 1][MMVQ_MAX_ROWS][WARP];
    if (threadIdx.y > 0) {
#pragma unroll
        for (int j = 0; j < MMVQ_MAX_ROWS; ++j) {
            partial[threadIdx.y - 1][j][threadIdx.x] = tmp[j];
        }
    }
    __syncthreads();
    if (threadIdx.y > 0) {
        return;
    }
#pragma unroll
    for (int j = 0; j < MMVQ_MAX_ROWS; ++j) {
        if (j < nrows_y) {
            float t = tmp[j];
#pragma unroll
            for (int l = 0; l < MMVQ_NWARPS - 1; ++l) {
                t = __fadd_rn(t, partial[l][j][threadIdx.x]);
            }
#pragma unroll
            for (int offset = WARP / 2; offset > 0; offset >>= 1) {
                t = __fadd_rn(t, __shfl_xor_sync(0xffffffffu, t, offset, WARP));
            }
            if (threadIdx.x == 0) {
                dst[(size_t)j * gridDim.x + row] = t;
            }
        }
    }
}

#define MMVQ_KERNEL(NAME, Q)                                                                   \
    extern "C" __global__ void __launch_bounds__(MMVQ_NWARPS * WARP, 1)                        \
        NAME(const u8 *__restrict__ w, const block_q8_1 *__restrict__ y,                       \
             float *__restrict__ dst, int ncols) {                                             \
        mmvq_row<Q>(w, y, dst, ncols);                                                         \
    }

#define MMVQ_ROWS_KERNEL(NAME, Q)                                                              \
    extern "C" __global__ void __launch_bounds__(MMVQ_NWARPS * WARP, 1)                        \
        NAME(const u8 *__restrict__ w, const block_q8_1 *__restrict__ y,                       \
             float *__restrict__ dst, int ncols, int nrows_y) {                                \
        mmvq_rows<Q>(w, y, dst, ncols, nrows_y);                                               \
    }
