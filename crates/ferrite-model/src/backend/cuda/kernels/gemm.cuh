#pragma once
#include "gemv.cuh"

// ---- Batch-invariant matmuls (`--batch-invariant`) ----
// out[m, n] = sum_k x[m, k] w[n, k] where each element's sum is the same whatever the row
// count, the tile shape and the grid, so a row gets the same bits alone, in a batch of any
// size, or as one of a verify window's rows. (cuBLAS picks its kernel, and so its order of
// summation, by the row count.) Each element has one f32 accumulator that walks the depth in
// 32-wide chunks, in order; a chunk is two mma.sync m16n8k16 whose k slots are permuted alike
// in A (input rows) and B (weight rows): lane t's 8 consecutive values of a row fill k pairs
// 2t and 2t + 8 of the first MMA (values 0-3) and of the second (values 4-7). The depth is
// never split; tiles start at multiples of 16 rows and 8 columns, and an element's position
// in its tile does not change what the tensor core adds for it.
// Block tiles BM x BN, staged through shared memory by cp.async in STAGES buffers of CH chunks
// each (zero-filled past the rows, the columns and the depth: k % 8 == 0); warps of WM x WN.
// A chunk's rows are 64 bytes in shared memory, so the 16-byte fragment loads of a quarter
// warp (two rows) meet no bank twice.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int BM, int BN, int WM, int WN, int STAGES, int CH>
__device__ void gemm_bi(const bf16* __restrict__ x, const bf16* __restrict__ w, int rows, int n,
                        int k, int out_mode, void* out) {
  constexpr int WARPS_N = BN / WN, THREADS = (BM / WM) * WARPS_N * 32;
  constexpr int MT = WM / 16, NT = WN / 8;
  extern __shared__ __align__(16) unsigned char gemm_smem[];
  bf16* as = (bf16*)gemm_smem;             // [STAGES][CH][BM][32]
  bf16* bs = as + STAGES * CH * BM * 32;   // [STAGES][CH][BN][32]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
  const int chunks = (k + 31) / 32, groups = (chunks + CH - 1) / CH;
  // Chunks CH q .. CH q + CH - 1 of the block's input and weight rows into buffer s: 4 pieces
  // of 16 bytes a row and chunk. A thread copies the same PIECES pieces of every stage, so
  // their addresses are worked out once.
  constexpr int PIECES = (BM + BN) * 4 * CH / THREADS;
  static_assert(PIECES * THREADS == (BM + BN) * 4 * CH, "whole pieces per thread");
  const bf16* src[PIECES];
  int dst[PIECES], depth[PIECES];
#pragma unroll
  for (int j = 0; j < PIECES; j++) {
    const int i = threadIdx.x + j * THREADS;
    const int c = i / ((BM + BN) * 4), r = i % ((BM + BN) * 4), row = r >> 2;
    const bool a = row < BM;
    const int at = a ? m0 + row : n0 + row - BM;
    depth[j] = at < (a ? rows : n) ? c * 32 + (r & 3) * 8 : k;  // k: never copied
    src[j] = (a ? x : w) + (size_t)(at < (a ? rows : n) ? at : 0) * k + depth[j] % k;
    dst[j] = (a ? c * BM + row : STAGES * CH * BM + c * BN + row - BM) * 32 + (r & 3) * 8;
  }
  auto stage = [&](int q, int s) {
    const int k0 = q * CH * 32;
#pragma unroll
    for (int j = 0; j < PIECES; j++) {
      const bool valid = depth[j] + k0 < k;
      const int off = s * CH * (dst[j] < STAGES * CH * BM * 32 ? BM : BN) * 32;
      cp_async16(as + dst[j] + off, valid ? src[j] + k0 : x, valid);
    }
  };
  wait_for_previous_kernel();
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < groups) stage(s, s);
    cp_async_commit();
  }
  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; i++)
#pragma unroll
    for (int j = 0; j < NT; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
  for (int q = 0; q < groups; q++) {
    cp_async_wait<STAGES - 2>();  // group q has landed
    __syncthreads();              // ... for every thread, and group q - 1 is no longer read
    if (q + STAGES - 1 < groups) stage(q + STAGES - 1, (q + STAGES - 1) % STAGES);
    cp_async_commit();
    const int s = q % STAGES;
#pragma unroll
    for (int c = 0; c < CH; c++) {
      if (q * CH + c >= chunks) break;
      const bf16* ac = as + (s * CH + c) * BM * 32;
      const bf16* bc = bs + (s * CH + c) * BN * 32;
      uint4 b[NT];
#pragma unroll
      for (int j = 0; j < NT; j++) b[j] = *(const uint4*)(bc + (wn + 8 * j + g) * 32 + t * 8);
#pragma unroll
      for (int i = 0; i < MT; i++) {
        const bf16* ar = ac + (wm + 16 * i + g) * 32 + t * 8;
        const uint4 lo = *(const uint4*)ar, hi = *(const uint4*)(ar + 8 * 32);
        const uint32_t a1[4] = {lo.x, hi.x, lo.y, hi.y}, a2[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
        for (int j = 0; j < NT; j++) {
          mma_bf16(acc[i][j], a1, b[j].x, b[j].y);
          mma_bf16(acc[i][j], a2, b[j].z, b[j].w);
        }
      }
    }
  }
  // acc[i][j]: rows g (0, 1) and g + 8 (2, 3) of m-tile i, columns 2t and 2t + 1 of n-tile j
  // (for gate|up weights, gate and up of one pair).
#pragma unroll
  for (int i = 0; i < MT; i++)
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int row = m0 + wm + 16 * i + g + 8 * h, col = n0 + wn + 8 * j + 2 * t;
        if (row >= rows || col >= n) continue;
        const float s0 = acc[i][j][2 * h], s1 = acc[i][j][2 * h + 1];
        const bool two = col + 1 < n;
        const size_t o = (size_t)row * n + col;
        if (out_mode == GEMV_OUT_BF16) {
          ((bf16*)out)[o] = __float2bfloat16(s0);
          if (two) ((bf16*)out)[o + 1] = __float2bfloat16(s1);
        } else if (out_mode == GEMV_OUT_F32) {
          ((float*)out)[o] = s0;
          if (two) ((float*)out)[o + 1] = s1;
        } else if (out_mode == GEMV_OUT_ADD) {
          ((float*)out)[o] += s0;
          if (two) ((float*)out)[o + 1] += s1;
        } else {
          ((bf16*)out)[(size_t)row * (n / 2) + col / 2] = __float2bfloat16(
              gate_times(out_mode == GEMV_OUT_GELU ? ACT_GELU_TANH : ACT_SILU,
                         __bfloat162float(__float2bfloat16(s0)),
                         __bfloat162float(__float2bfloat16(s1))));
        }
      }
}

// Three shapes, picked by the row count (`Kernels::gemm_invariant`): up to 16 rows (decodes;
// 32-column tiles so a 4096-wide matrix fills the GPU), up to 64, and more (prefill).
// Small steps read weights: deep pipelines (40 KB of them in flight per block of up to 16
// rows); prefill computes: wide tiles.
#define GEMM_BI(NAME, BM, BN, WM, WN, STAGES, CH)                                               \
  extern "C" __global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32)                      \
      gemm_bi_##NAME(const bf16* x, const bf16* w, int rows, int n, int k, int out_mode,       \
                     void* out) {                                                              \
    gemm_bi<BM, BN, WM, WN, STAGES, CH>(x, w, rows, n, k, out_mode, out);                      \
  }
GEMM_BI(m16, 16, 32, 16, 8, 6, 4)
GEMM_BI(m64, 64, 32, 16, 16, 4, 4)
GEMM_BI(m128, 128, 128, 64, 32, 4, 1)
