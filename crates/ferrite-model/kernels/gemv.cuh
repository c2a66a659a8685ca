#pragma once
#include "elementwise.cuh"

// ---- Matmuls of one to eight rows (small decode and verify steps) ----
// out[m, n] = sum_k in[m, k] w[n, k]: bound by reading w once, which cuBLAS does at ~1.15x the
// copy floor for one row; here one warp per output column streams the column's weights with
// 16-byte loads, 2 x GEMV_LOADS in flight per lane. The small kernels around a decode's matmuls are
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
#define GEMV_LOADS 4


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

// Loads one chunk of a column's weights: GEMV_LOADS 16-byte pieces per lane from `base` on.
__device__ __forceinline__ void gemv_load(const uint4* wc, int base, int k8, uint4* v) {
#pragma unroll
  for (int u = 0; u < GEMV_LOADS; u++) {
    const int i = base + 32 * u;
    v[u] = i < k8 ? __ldcs(wc + i) : make_uint4(0, 0, 0, 0);
  }
}

// R: rows the kernel is built for; `r` <= R of them are real. k % 8 == 0. PRO: the prologue's
// unrolling, as far as registers allow (two blocks of 512 threads per multiprocessor).
// Grid: any number of blocks of whole warps; dynamic shared memory R * k bf16.
// A warp takes columns first, first + stride, ... and walks their chunks one after the other,
// issuing each chunk's loads before it sums the one before (the first chunk's before the input
// is built), so a lane always has two chunks in flight and the prologue hides behind a load.
// Launched chained: that first chunk is in flight while the kernel before still finishes.
template <int R, int PRO>
__device__ void gemv(const bf16* __restrict__ w, int n, int k, int r, int in_mode, const void* in,
                     const uint32_t* rows, const bf16* norm, float eps, int out_mode, void* out) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  __shared__ float red[32];
  bf16* xs = (bf16*)gemv_smem;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int k8 = k / 8, per_chunk = 32 * GEMV_LOADS, chunks = (k8 + per_chunk - 1) / per_chunk;
  const int first = blockIdx.x * warps + (threadIdx.x >> 5), stride = gridDim.x * warps;
  // A warp's unit of columns: one, or a gate|up pair.
  const bool gated = out_mode >= GEMV_OUT_SILU;
  const int per_unit = gated ? 2 : 1, units = n / per_unit;
  const int items = first < units ? ((units - 1 - first) / stride + 1) * per_unit * chunks : 0;
  uint4 next[GEMV_LOADS];
  if (items > 0) gemv_load((const uint4*)(w + (size_t)first * per_unit * k), lane, k8, next);
  wait_for_previous_kernel();
  for (int m = 0; m < R; m++)
    gemv_input<PRO>(in_mode, m, r, in, rows, norm, eps, k, (uint4*)(xs + m * k), red);
  __syncthreads();
  const uint4* x4 = (const uint4*)xs;
  float acc[R], gate[R];
#pragma unroll
  for (int m = 0; m < R; m++) acc[m] = 0.f;
  for (int it = 0, col = first * per_unit, c = 0; it < items; it++) {
    uint4 v[GEMV_LOADS];
#pragma unroll
    for (int u = 0; u < GEMV_LOADS; u++) v[u] = next[u];
    int ncol = col, nc = c + 1;
    if (nc == chunks) {
      nc = 0;
      ncol = (col + 1) % per_unit ? col + 1 : (col / per_unit + stride) * per_unit;
    }
    if (it + 1 < items)
      gemv_load((const uint4*)(w + (size_t)ncol * k), lane + nc * per_chunk, k8, next);
    const int base = lane + c * per_chunk;
#pragma unroll
    for (int u = 0; u < GEMV_LOADS; u++) {
      const int i = base + 32 * u;
      if (i < k8) {
#pragma unroll
        for (int m = 0; m < R; m++) acc[m] = dot8(v[u], x4[m * k8 + i], acc[m]);
      }
    }
    if (c == chunks - 1) {
#pragma unroll
      for (int m = 0; m < R; m++) {
        const float sum = warp_sum(acc[m]);
        acc[m] = 0.f;
        if (gated && col % 2 == 0) {
          gate[m] = sum;
        } else if (lane == 0 && m < r) {
          const size_t o = (size_t)m * n + col;
          if (out_mode == GEMV_OUT_BF16) ((bf16*)out)[o] = __float2bfloat16(sum);
          else if (out_mode == GEMV_OUT_F32) ((float*)out)[o] = sum;
          else if (out_mode == GEMV_OUT_ADD) ((float*)out)[o] += sum;
          else
            ((bf16*)out)[(size_t)m * units + col / 2] = __float2bfloat16(
                gate_times(out_mode == GEMV_OUT_GELU ? ACT_GELU_TANH : ACT_SILU,
                           __bfloat162float(__float2bfloat16(gate[m])),
                           __bfloat162float(__float2bfloat16(sum))));
        }
      }
    }
    col = ncol;
    c = nc;
  }
}

// Threads per block (`GEMV_THREADS` in kernels.rs). Up to two rows, two blocks per
// multiprocessor (the bound caps registers at 64); more rows keep R accumulators per lane, so
// one block with room for them. Row m's sum does not depend on R (its own accumulator, the same
// chunk order), so a request's verify rows round exactly as its decode rows do.
#define GEMV(R, PRO, BLOCKS)                                                          \
  extern "C" __global__ void __launch_bounds__(512, BLOCKS)                            \
      gemv_r##R##_bf16(const bf16* w, int n, int k, int r, int in_mode, const void* in, \
                       const uint32_t* rows, const bf16* norm, float eps, int out_mode, \
                       void* out) {                                                   \
    gemv<R, PRO>(w, n, k, r, in_mode, in, rows, norm, eps, out_mode, out);            \
  }
GEMV(1, 2, 2)
GEMV(2, 1, 2)
GEMV(3, 1, 1)
GEMV(4, 1, 1)
GEMV(5, 1, 1)
GEMV(6, 1, 1)
GEMV(7, 1, 1)
GEMV(8, 1, 1)

// ---- The same on tensor cores: up to 8 rows as the N = 8 of mma.sync m16n8k16 ----
// A tile is 16 output columns (the MMA's M: weight rows c0 + g and c0 + g + 8, g = lane / 4);
// a block of 8 warps takes tiles blockIdx.x, + gridDim.x, ... (the input rows built once in
// shared memory), each over the whole depth: warp w the 32-deep chunks w, w + 8, ... of k, in
// order, then the 8 warps' partial sums add in warp order. Each lane loads 16 bytes (8
// consecutive k) of both its weight rows per chunk and 16 bytes of input row g from shared
// memory; the chunk's k is permuted alike in A and B (lane t's 8 values fill k pairs 2t and
// 2t + 8 of two MMAs), which the sum does not see. Input rows m >= r read as zeros. A row's sum
// is fixed by the instruction and this order for every row count and grid, as in `gemv<R>`,
// and the input is read from shared memory once per 32 bytes of weights (`gemv<R>`: R times
// per 16). Each of a lane's MMA_GEMV_SLOTS loads in flight is refilled as soon as its MMA has
// read it, across tiles too. Grid: up to n / 16 blocks of 256 threads; dynamic shared memory
// r * k bf16.
#define MMA_GEMV_SLOTS 4
extern "C" __global__ void __launch_bounds__(256) gemv_mma_bf16(
    const bf16* __restrict__ w, int n, int k, int r, int in_mode, const void* in,
    const uint32_t* rows, const bf16* norm, float eps, int out_mode, void* out) {
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  __shared__ float red[32];
  __shared__ float part[8][16][8];
  bf16* xs = (bf16*)gemv_smem;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int k8 = k / 8, chunks = k / 32, tiles = n / 16;
  // This warp's chunks of a tile, in groups of MMA_GEMV_SLOTS.
  const int mine = warp < chunks ? (chunks - 1 - warp) / 8 + 1 : 0;
  const int groups = (mine + MMA_GEMV_SLOTS - 1) / MMA_GEMV_SLOTS;
  uint4 va[MMA_GEMV_SLOTS], vb[MMA_GEMV_SLOTS];
  // Slot u of group q of `tile`: chunk warp + 8 (q SLOTS + u), if there is one.
  auto load = [&](int tile, int q, int u) {
    const int j = warp + 8 * (q * MMA_GEMV_SLOTS + u);
    if (j >= chunks) return;
    const uint4* row = (const uint4*)(w + (size_t)(tile * 16 + g) * k) + 4 * j + t;
    va[u] = __ldcs(row);
    vb[u] = __ldcs(row + (size_t)8 * k8);
  };
  // The first loads are in flight while the kernel before finishes.
#pragma unroll
  for (int u = 0; u < MMA_GEMV_SLOTS; u++) load(blockIdx.x, 0, u);
  wait_for_previous_kernel();
  for (int m = 0; m < r; m++)
    gemv_input<1>(in_mode, m, r, in, rows, norm, eps, k, (uint4*)(xs + m * k), red);
  __syncthreads();
  const uint4* x4 = (const uint4*)xs + (size_t)g * k8 + t;
  const bool gated = out_mode >= GEMV_OUT_SILU;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    for (int q = 0; q < groups; q++) {
#pragma unroll
      for (int u = 0; u < MMA_GEMV_SLOTS; u++) {
        const int j = warp + 8 * (q * MMA_GEMV_SLOTS + u);
        if (j < chunks) {
          const uint4 xb = g < r ? x4[4 * j] : make_uint4(0, 0, 0, 0);
          const uint32_t a1[4] = {va[u].x, vb[u].x, va[u].y, vb[u].y};
          const uint32_t a2[4] = {va[u].z, vb[u].z, va[u].w, vb[u].w};
          mma_bf16(c, a1, xb.x, xb.y);
          mma_bf16(c, a2, xb.z, xb.w);
        }
        if (q + 1 < groups) load(tile, q + 1, u);
        else if (tile + gridDim.x < tiles) load(tile + gridDim.x, 0, u);
      }
    }
    // c: columns g (c[0], c[1]) and g + 8 (c[2], c[3]) of the tile, input rows 2t, 2t + 1.
    part[warp][g][2 * t] = c[0];
    part[warp][g][2 * t + 1] = c[1];
    part[warp][g + 8][2 * t] = c[2];
    part[warp][g + 8][2 * t + 1] = c[3];
    __syncthreads();
    // One thread per (column, row); a gate|up pair's thread takes both columns.
    const int i = gated ? 2 * (threadIdx.x >> 3) : threadIdx.x >> 3, m = threadIdx.x & 7;
    if (threadIdx.x < (gated ? 64 : 128) && m < r) {
      float sum = 0.f;
      for (int v = 0; v < 8; v++) sum += part[v][i][m];
      const int col = tile * 16 + i;
      const size_t o = (size_t)m * n + col;
      if (out_mode == GEMV_OUT_BF16) ((bf16*)out)[o] = __float2bfloat16(sum);
      else if (out_mode == GEMV_OUT_F32) ((float*)out)[o] = sum;
      else if (out_mode == GEMV_OUT_ADD) ((float*)out)[o] += sum;
      else {
        float up = 0.f;
        for (int v = 0; v < 8; v++) up += part[v][i + 1][m];
        ((bf16*)out)[(size_t)m * (n / 2) + col / 2] = __float2bfloat16(
            gate_times(out_mode == GEMV_OUT_GELU ? ACT_GELU_TANH : ACT_SILU,
                       __bfloat162float(__float2bfloat16(sum)),
                       __bfloat162float(__float2bfloat16(up))));
      }
    }
    __syncthreads();  // `part` is read before the next tile writes it
  }
}
