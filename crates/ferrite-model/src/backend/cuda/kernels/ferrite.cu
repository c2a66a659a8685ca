// ferrite's CUDA kernels: everything of a step except the large matmuls (cuBLAS, unless
// --batch-invariant). bf16 in and
// out, f32 arithmetic; the residual stream stays in f32.
// Paged KV layout: K and V `[num_blocks, num_kv_heads, block_size, head_dim]`.
// One file per op, compiled as one unit into one fat binary (build.rs).
#include "elementwise.cuh"
#include "qkv.cuh"
#include "attention.cuh"
#include "sample.cuh"
#include "gemv.cuh"
#include "gemm.cuh"
#include "moe.cuh"
#include "gdn.cuh"
