#pragma once
#include "elementwise.cuh"

// ---- Matmuls of one to eight rows (small decode and verify steps) ----
// out[m, n] = sum_k in[m, k] w[n, k]: bound by reading w once, which cuBLAS does at ~1.15x the
// copy floor for one row; here one warp per pair of output columns streams their weights with
// 16-byte loads, two chunks in flight per lane. The small kernels around a decode's matmuls are
// folded in, so a layer is four of these plus rotary and attention:
// the input row is built once per block in shared memory (bf16, as the unfused kernels round it):
enum { GEMV_IN_BF16 = 0, GEMV_IN_RMS = 1 };
//   IN_BF16: a bf16 [R, k] tensor; IN_RMS: RMSNorm (weights `norm`) of f32 residual rows
//   x[rows ? rows[m] : m];
// and the column's dot product goes out as
enum { GEMV_OUT_BF16 = 0, GEMV_OUT_F32 = 1, GEMV_OUT_ADD = 2, GEMV_OUT_SILU = 3, GEMV_OUT_GELU = 4 };
//   bf16 [R, n], f32 [R, n], added into the f32 residual stream [R, n] (the residual add), or
//   for interleaved gate|up columns, act(gate) * up (SiLU or GELU-tanh) as bf16 [R, n / 2] (a warp takes both
//   columns of a pair; each is rounded to bf16 first, as the unfused path stores them).


__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
  acc = fmaf(bf16_lo(a.x), bf16_lo(b.x), acc);
  acc = fmaf(bf16_hi(a.x), bf16_hi(b.x), acc);
  acc = fmaf(bf16_lo(a.y), bf16_lo(b.y), acc);
  acc = fmaf(bf16_hi(a.y), bf16_hi(b.y), acc);
  acc = fmaf(bf16_lo(a.z), bf16_lo(b.z), acc);
  acc = fmaf(bf16_hi(a.z), bf16_hi(b.z), acc);
  acc = fmaf(bf16_lo(a.w), bf16_lo(b.w), acc);
  return fmaf(bf16_hi(a.w), bf16_hi(b.w), acc);
}

// Builds input row m of `r` rows in `xs` (k bf16); rows m >= r are zeros. Unrolled over
// GEMV_PRO pieces of 8 values per thread, every load issued before the first use: a loop
// that waited on each load would cost one L2 round trip per piece.
template <int GEMV_PRO>
__device__ __forceinline__ void gemv_input(int mode, int m, int r, const void* __restrict__ in,
                                           const uint32_t* __restrict__ rows,
                                           const bf16* __restrict__ norm, float eps, int k,
                                           uint4* __restrict__ xs, float* red) {
  const int k8 = k / 8, step = blockDim.x;
  if (m >= r) {
    for (int i = threadIdx.x; i < k8; i += step) xs[i] = make_uint4(0, 0, 0, 0);
  } else if (mode == GEMV_IN_BF16) {
    const uint4* src = (const uint4*)in + (size_t)m * k8;
    for (int i0 = threadIdx.x; i0 < k8; i0 += GEMV_PRO * step) {
      uint4 v[GEMV_PRO];
#pragma unroll
      for (int j = 0; j < GEMV_PRO; j++)
        if (i0 + j * step < k8) v[j] = src[i0 + j * step];
#pragma unroll
      for (int j = 0; j < GEMV_PRO; j++)
        if (i0 + j * step < k8) xs[i0 + j * step] = v[j];
    }
  } else {
    const float4* x = (const float4*)in + (size_t)(rows ? rows[m] : m) * 2 * k8;
    float ss = 0.f;
    for (int i0 = threadIdx.x; i0 < k8; i0 += GEMV_PRO * step) {
      float4 a[GEMV_PRO], b[GEMV_PRO];
#pragma unroll
      for (int j = 0; j < GEMV_PRO; j++)
        if (i0 + j * step < k8) a[j] = x[2 * (i0 + j * step)], b[j] = x[2 * (i0 + j * step) + 1];
#pragma unroll
      for (int j = 0; j < GEMV_PRO; j++)
        if (i0 + j * step < k8)
          ss += a[j].x * a[j].x + a[j].y * a[j].y + a[j].z * a[j].z + a[j].w * a[j].w +
                b[j].x * b[j].x + b[j].y * b[j].y + b[j].z * b[j].z + b[j].w * b[j].w;
    }
    const float inv = rsqrtf(block_sum(ss, red) / k + eps);
    const uint4* w4 = (const uint4*)norm;
    for (int i0 = threadIdx.x; i0 < k8; i0 += GEMV_PRO * step) {
      float4 a[GEMV_PRO], b[GEMV_PRO];
      uint4 w[GEMV_PRO];
#pragma unroll
      for (int j = 0; j < GEMV_PRO; j++)
        if (i0 + j * step < k8)
          a[j] = x[2 * (i0 + j * step)], b[j] = x[2 * (i0 + j * step) + 1], w[j] = w4[i0 + j * step];
#pragma unroll
      for (int j = 0; j < GEMV_PRO; j++) {
        if (i0 + j * step >= k8) continue;
        xs[i0 + j * step] = make_uint4(
            pack_bf16(a[j].x * inv * bf16_lo(w[j].x), a[j].y * inv * bf16_hi(w[j].x)),
            pack_bf16(a[j].z * inv * bf16_lo(w[j].y), a[j].w * inv * bf16_hi(w[j].y)),
            pack_bf16(b[j].x * inv * bf16_lo(w[j].z), b[j].y * inv * bf16_hi(w[j].z)),
            pack_bf16(b[j].z * inv * bf16_lo(w[j].w), b[j].w * inv * bf16_hi(w[j].w)));
      }
    }
  }
}

// Loads one chunk of a column's weights: LOADS 16-byte pieces per lane from `base` on.
template <int LOADS>
__device__ __forceinline__ void gemv_load(const uint4* wc, int base, int k8, uint4* v) {
#pragma unroll
  for (int u = 0; u < LOADS; u++) {
    const int i = base + 32 * u;
    v[u] = i < k8 ? __ldcs(wc + i) : make_uint4(0, 0, 0, 0);
  }
}

// R: rows the kernel is built for; `r` <= R of them are real. k % 8 == 0, n even. PRO: the
// prologue's unrolling, LOADS: 16-byte loads per lane and chunk, as far as registers allow.
// Grid: any number of blocks of whole warps; dynamic shared memory R * k bf16.
// A warp takes column pairs first, first + stride, ... (a gate|up pair, or two neighbours) and
// walks their chunks one after the other, both columns at once, so each input piece read from
// shared memory serves two columns; it issues each chunk's loads before it sums the one before
// (the first chunk's before the input is built), so a lane always has two chunks in flight and
// the prologue hides behind a load. Launched chained: that first chunk is in flight while the
// kernel before still finishes. A lane sums its pieces lane, lane + 32, ... in order whatever
// R and LOADS, then the warp adds its lanes: a column's sum is the same for every row count.
template <int R, int PRO, int LOADS>
__device__ void gemv(const bf16* __restrict__ w, int n, int k, int r, int in_mode, const void* in,
                     const uint32_t* rows, const bf16* norm, float eps, int out_mode, void* out) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  __shared__ float red[32];
  bf16* xs = (bf16*)gemv_smem;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int k8 = k / 8, per_chunk = 32 * LOADS, chunks = (k8 + per_chunk - 1) / per_chunk;
  const int first = blockIdx.x * warps + (threadIdx.x >> 5), stride = gridDim.x * warps;
  const bool gated = out_mode >= GEMV_OUT_SILU;
  const int pairs = n / 2;
  const int items = first < pairs ? ((pairs - 1 - first) / stride + 1) * chunks : 0;
  uint4 next[2][LOADS];
  if (items > 0) {
    gemv_load<LOADS>((const uint4*)(w + (size_t)2 * first * k), lane, k8, next[0]);
    gemv_load<LOADS>((const uint4*)(w + (size_t)(2 * first + 1) * k), lane, k8, next[1]);
  }
  wait_for_previous_kernel();
  for (int m = 0; m < R; m++)
    gemv_input<PRO>(in_mode, m, r, in, rows, norm, eps, k, (uint4*)(xs + m * k), red);
  __syncthreads();
  const uint4* x4 = (const uint4*)xs;
  float acc[2][R];
#pragma unroll
  for (int m = 0; m < R; m++) acc[0][m] = acc[1][m] = 0.f;
  for (int it = 0, p = first, c = 0; it < items; it++) {
    uint4 v[2][LOADS];
#pragma unroll
    for (int u = 0; u < LOADS; u++) v[0][u] = next[0][u], v[1][u] = next[1][u];
    int np = p, nc = c + 1;
    if (nc == chunks) nc = 0, np = p + stride;
    if (it + 1 < items) {
      gemv_load<LOADS>((const uint4*)(w + (size_t)2 * np * k), lane + nc * per_chunk, k8, next[0]);
      gemv_load<LOADS>((const uint4*)(w + (size_t)(2 * np + 1) * k), lane + nc * per_chunk, k8,
                       next[1]);
    }
    const int base = lane + c * per_chunk;
#pragma unroll
    for (int u = 0; u < LOADS; u++) {
      const int i = base + 32 * u;
      if (i < k8) {
#pragma unroll
        for (int m = 0; m < R; m++) {
          const uint4 x = x4[m * k8 + i];
          acc[0][m] = dot8(v[0][u], x, acc[0][m]);
          acc[1][m] = dot8(v[1][u], x, acc[1][m]);
        }
      }
    }
    if (c == chunks - 1) {
#pragma unroll
      for (int m = 0; m < R; m++) {
        const float s0 = warp_sum(acc[0][m]), s1 = warp_sum(acc[1][m]);
        acc[0][m] = acc[1][m] = 0.f;
        if (lane != 0 || m >= r) continue;
        const size_t o = (size_t)m * n + 2 * p;
        if (out_mode == GEMV_OUT_BF16) {
          ((bf16*)out)[o] = __float2bfloat16(s0);
          ((bf16*)out)[o + 1] = __float2bfloat16(s1);
        } else if (out_mode == GEMV_OUT_F32) {
          ((float*)out)[o] = s0;
          ((float*)out)[o + 1] = s1;
        } else if (out_mode == GEMV_OUT_ADD) {
          ((float*)out)[o] += s0;
          ((float*)out)[o + 1] += s1;
        } else if (gated) {
          ((bf16*)out)[(size_t)m * pairs + p] = __float2bfloat16(
              gate_times(out_mode == GEMV_OUT_GELU ? ACT_GELU_TANH : ACT_SILU,
                         __bfloat162float(__float2bfloat16(s0)),
                         __bfloat162float(__float2bfloat16(s1))));
        }
      }
    }
    p = np;
    c = nc;
  }
}

// Threads per block (`GEMV_THREADS` in kernels.rs). Up to two rows, two blocks per
// multiprocessor (the bound caps registers at 64); more rows keep R accumulators per lane, so
// one block with room for them. Row m's sum does not depend on R (its own accumulator, the same
// chunk order), so a request's verify rows round exactly as its decode rows do.
#define GEMV(R, PRO, LOADS, BLOCKS)                                                   \
  extern "C" __global__ void __launch_bounds__(512, BLOCKS)                            \
      gemv_r##R##_bf16(const bf16* w, int n, int k, int r, int in_mode, const void* in, \
                       const uint32_t* rows, const bf16* norm, float eps, int out_mode, \
                       void* out) {                                                   \
    gemv<R, PRO, LOADS>(w, n, k, r, in_mode, in, rows, norm, eps, out_mode, out);     \
  }
GEMV(1, 2, 2, 2)
GEMV(2, 1, 2, 2)
GEMV(3, 1, 4, 1)
GEMV(4, 1, 4, 1)
GEMV(5, 1, 4, 1)
GEMV(6, 1, 4, 1)
GEMV(7, 1, 4, 1)
GEMV(8, 1, 4, 1)
