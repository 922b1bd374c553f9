// GGUF blocks to f16 rows for the prefill's cuBLAS products (docs/modules/device_prefill.md):
// one thread per value, dst[i] = f16(value i of the matrix), the blocks read where the file
// put them. Each value is ggml's CPU dequantization (dequantize_row_<type>), one f32 operation
// at a time in its order, then rounded to f16 once:
//   Q4_0 (q - 8) * d   Q5_0 (q - 16) * d   Q8_0 q * d   Q4_1, Q5_1 q * d + m
//   Q2_K, Q4_K, Q5_K (d * scale) * q - dmin * min   Q3_K (d * (scale - 32)) * q
//   Q6_K (d * scale) * (q - 32)
// n (rows times columns) must be a whole number of blocks.
#include "mmvq_common.cuh"

static __device__ __forceinline__ float f16_at(const u8 *b, int at) {
    return h2f((u16)(b[at] | (b[at + 1] << 8)));
}

static __device__ __forceinline__ unsigned word_at(const u8 *b, int at) {
    return (unsigned)b[at] | ((unsigned)b[at + 1] << 8) | ((unsigned)b[at + 2] << 16) |
           ((unsigned)b[at + 3] << 24);
}

// the low (j < 16) or high nibble of the 16 quant bytes at qs, for value j of a 32-value block
static __device__ __forceinline__ int nibble32(const u8 *qs, int j) {
    return j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
}

static __device__ __forceinline__ float value_q4_0(const u8 *b, int j) {
    return __fmul_rn((float)(nibble32(b + 2, j) - 8), f16_at(b, 0));
}

static __device__ __forceinline__ float value_q4_1(const u8 *b, int j) {
    return __fadd_rn(__fmul_rn((float)nibble32(b + 4, j), f16_at(b, 0)), f16_at(b, 2));
}

static __device__ __forceinline__ float value_q5_0(const u8 *b, int j) {
    const int q = nibble32(b + 6, j) | (((word_at(b, 2) >> j) & 1) << 4);
    return __fmul_rn((float)(q - 16), f16_at(b, 0));
}

static __device__ __forceinline__ float value_q5_1(const u8 *b, int j) {
    const int q = nibble32(b + 8, j) | (((word_at(b, 4) >> j) & 1) << 4);
    return __fadd_rn(__fmul_rn((float)q, f16_at(b, 0)), f16_at(b, 2));
}

static __device__ __forceinline__ float value_q8_0(const u8 *b, int j) {
    return __fmul_rn((float)(signed char)b[2 + j], f16_at(b, 0));
}

// ggml's get_scale_min_k4
static __device__ __forceinline__ void scale_min_k(int j, const u8 *q, int &sc, int &m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q4_K and Q5_K: value j of 256 is in group g = j / 64, sub-block 2g + (j % 64 >= 32), its
// quant the low or high nibble of byte 32g + j % 32 (Q5_K: plus bit (sub-block) of qh[j % 32])
template <bool FIVE>
static __device__ __forceinline__ float value_k45(const u8 *b, int j) {
    const int g = j / 64, l = j % 64, sub = 2 * g + (l >= 32);
    const u8 *qs = b + (FIVE ? 48 : 16) + 32 * g;
    int q = l < 32 ? qs[l] & 0xF : qs[l - 32] >> 4;
    if (FIVE) {
        q += ((b[16 + j % 32] >> sub) & 1) << 4;
    }
    int sc, m;
    scale_min_k(sub, b + 4, sc, m);
    const float d1 = __fmul_rn(f16_at(b, 0), (float)sc);
    const float m1 = __fmul_rn(f16_at(b, 2), (float)m);
    return __fsub_rn(__fmul_rn(d1, (float)q), m1);
}

// Q6_K: half h = j / 128; in it k = (j % 128) / 32 and l = j % 32; the low bits are the low
// (k < 2) or high nibble of ql[64h + l + 32 (k % 2)], the high two bits of qh[32h + l] at 2k,
// the scale scales[8h + l / 16 + 2k]
static __device__ __forceinline__ float value_q6_k(const u8 *b, int j) {
    const int h = j / 128, k = (j % 128) / 32, l = j % 32;
    const u8 ql = b[64 * h + l + 32 * (k % 2)];
    const int lo = k < 2 ? ql & 0xF : ql >> 4;
    const int hi = (b[128 + 32 * h + l] >> (2 * k)) & 3;
    const int sc = (signed char)b[192 + 8 * h + l / 16 + 2 * k];
    return __fmul_rn(__fmul_rn(f16_at(b, 208), (float)sc), (float)((lo | (hi << 4)) - 32));
}

// Q2_K and Q3_K: value j of 256 is in half h = j / 128, bit pair k = (j % 128) / 32 of quant
// byte 32h + j % 32, sub-block (16 values) j / 16; Q2_K (d * (sc & 15)) * q - dmin * (sc >> 4),
// Q3_K (d * (scale - 32)) * (q - 4 where bit 4h + k of hmask[j % 32] is clear)
static __device__ __forceinline__ float value_q2_k(const u8 *b, int j) {
    const int h = j / 128, k = (j % 128) / 32, l = j % 32;
    const int q = (b[16 + 32 * h + l] >> (2 * k)) & 3;
    const int sc = b[j / 16];
    const float dl = __fmul_rn(f16_at(b, 80), (float)(sc & 0xF));
    const float ml = __fmul_rn(f16_at(b, 82), (float)(sc >> 4));
    return __fsub_rn(__fmul_rn(dl, (float)q), ml);
}

static __device__ __forceinline__ float value_q3_k(const u8 *b, int j) {
    const int h = j / 128, k = (j % 128) / 32, l = j % 32, is = j / 16;
    const int low = (b[32 + 32 * h + l] >> (2 * k)) & 3;
    const int q = low - (((b[l] >> (4 * h + k)) & 1) ? 0 : 4);
    const int sc_low = (b[96 + is % 8] >> (4 * (is / 8))) & 0xF;
    const int sc_high = ((b[96 + 8 + is % 4] >> (2 * (is / 4))) & 3) << 4;
    const float dl = __fmul_rn(f16_at(b, 108), (float)((sc_low | sc_high) - 32));
    return __fmul_rn(dl, (float)q);
}

#define DEQUANTIZE_KERNEL(NAME, VALUES, BYTES, VALUE)                                          \
    extern "C" __global__ void NAME(const u8 *__restrict__ w, u16 *__restrict__ dst, int n) {  \
        const int i = blockDim.x * blockIdx.x + threadIdx.x;                                   \
        if (i < n) {                                                                           \
            dst[i] = f2h(VALUE(w + (size_t)(i / VALUES) * BYTES, i % VALUES));                 \
        }                                                                                      \
    }

DEQUANTIZE_KERNEL(dequantize_f16_q4_0, 32, 18, value_q4_0)
DEQUANTIZE_KERNEL(dequantize_f16_q4_1, 32, 20, value_q4_1)
DEQUANTIZE_KERNEL(dequantize_f16_q5_0, 32, 22, value_q5_0)
DEQUANTIZE_KERNEL(dequantize_f16_q5_1, 32, 24, value_q5_1)
DEQUANTIZE_KERNEL(dequantize_f16_q8_0, 32, 34, value_q8_0)
DEQUANTIZE_KERNEL(dequantize_f16_q2_k, 256, 84, value_q2_k)
DEQUANTIZE_KERNEL(dequantize_f16_q3_k, 256, 110, value_q3_k)
DEQUANTIZE_KERNEL(dequantize_f16_q4_k, 256, 144, value_k45<false>)
DEQUANTIZE_KERNEL(dequantize_f16_q5_k, 256, 176, value_k45<true>)
DEQUANTIZE_KERNEL(dequantize_f16_q6_k, 256, 210, value_q6_k)
