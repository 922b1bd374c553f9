"""The exact CPU kernels: Numba loops that round as ggml's CPU kernels do, bit for bit.

By concern:

- ``exact_matmul``, ``exact_kquants``, ``exact_iquants``: the matrix products on the GGUF
  blocks (legacy quants, F16/BF16/F32; the K-quants; the IQ and TQ types), each with the
  activation rounding of its weight type;
- ``exact_attention``: ggml's flash attention over the f16 or q8_0 cache;
- ``exact_ops``: the element-wise steps (RMSNorm, RoPE, SwiGLU/GeGLU, the Walsh-Hadamard turn);
- ``exact_decode``: one decode step (one new token) as one compiled call per layer, composed of
  the kernels above;
- ``jit``: the Numba decorator the kernels use, the on-disk cache keyed on the kernel modules' sources, the
  FMA and f16 intrinsics, and ``start_worker_threads``.

Importing these modules compiles nothing and starts no thread: Numba compiles a kernel on its
first call (or loads it from its cache), and the engine starts the OpenMP worker team itself.
"""
