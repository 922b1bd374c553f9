// What HIP's runtime header gives a kernel (hiprtc and hipcc include it before the source), for
// compiling bankml's kernels for AMD GPUs with a clang that has no ROCm headers (-nogpuinc):
// the keywords, the thread and block indices, __syncthreads(_or), __shfl_xor and the few math
// functions the kernels call, each written as HIP writes it for AMD's GPUs.
#pragma once
typedef __SIZE_TYPE__ size_t;

#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))
#define __forceinline__ inline __attribute__((always_inline))
#define __restrict__ __restrict
#define __launch_bounds__(threads, min_warps) \
    __attribute__((amdgpu_flat_work_group_size(1, threads)))

struct hip_stub_dim3 {
    unsigned x, y, z;
};
#define threadIdx                                                                          \
    (hip_stub_dim3{__builtin_amdgcn_workitem_id_x(), __builtin_amdgcn_workitem_id_y(),     \
                   __builtin_amdgcn_workitem_id_z()})
#define blockIdx                                                                           \
    (hip_stub_dim3{__builtin_amdgcn_workgroup_id_x(), __builtin_amdgcn_workgroup_id_y(),   \
                   __builtin_amdgcn_workgroup_id_z()})
#define blockDim                                                                           \
    (hip_stub_dim3{__builtin_amdgcn_workgroup_size_x(), __builtin_amdgcn_workgroup_size_y(), \
                   __builtin_amdgcn_workgroup_size_z()})
#define gridDim                                                                            \
    (hip_stub_dim3{__builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(),    \
                   __builtin_amdgcn_grid_size_y() / __builtin_amdgcn_workgroup_size_y(),    \
                   __builtin_amdgcn_grid_size_z() / __builtin_amdgcn_workgroup_size_z()})

static __device__ __forceinline__ void __syncthreads() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

extern "C" __device__ int __ockl_wgred_or_i32(int);
static __device__ __forceinline__ int __syncthreads_or(int predicate) {
    return __ockl_wgred_or_i32(predicate);
}

// lane self reads lane self ^ lane_mask of its width-wide group (itself past the group's end)
static __device__ __forceinline__ int __shfl_xor(int var, int lane_mask, int width) {
    const int self = __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
    const int index = self ^ lane_mask;
    const int at = index >= ((self + width) & ~(width - 1)) ? self : index;
    return __builtin_amdgcn_ds_bpermute(at << 2, var);
}
static __device__ __forceinline__ float __shfl_xor(float var, int lane_mask, int width) {
    return __builtin_bit_cast(float, __shfl_xor(__builtin_bit_cast(int, var), lane_mask, width));
}

static __device__ __forceinline__ float fabsf(float x) { return __builtin_fabsf(x); }
static __device__ __forceinline__ float fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
static __device__ __forceinline__ float rintf(float x) { return __builtin_rintf(x); }
static __device__ __forceinline__ float roundf(float x) { return __builtin_roundf(x); }
