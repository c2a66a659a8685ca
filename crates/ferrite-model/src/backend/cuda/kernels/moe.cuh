// ---- Mixture-of-experts layers ----
// Each of a step's T rows takes k experts: assignment a = t * k + j is row t's j-th pick.
// moe_route picks them from the router's logits, moe_align groups the assignments by expert
// into tiles of TM rows (16 when experts get few rows each, 64 for long prefills) (one expert per tile, padding rows marked MOE_NONE), the two
// grouped matmuls run every tile against its expert's weights on tensor cores, and
// moe_combine adds each row's k results in j order. No atomics touch a value, and a row's
// dot products never see another row, so a row's result does not depend on the rows it
// shares an expert with. Each kernel is launched chained (common.cuh): it waits for the one
// before it, its launch hidden behind that one's tail.
#pragma once
#include <mma.h>
#include "gemv.cuh"

#define MOE_BN 64
#define MOE_KC 64
// Shared-memory row stride of a chunk: padded so a fragment's 16 rows fall in distinct banks.
#define MOE_LD (MOE_KC + 8)
#define MOE_NONE 0xffffffffu
// Experts a warp's lanes hold in registers while routing: up to 32 * MOE_PER_LANE.
#define MOE_PER_LANE 16

// One warp per row: softmax over the row's first E logits (the router's width is E, or E + 1
// with the shared expert's gate last), the k largest by repeated argmax (lower index first
// on ties), rescaled to sum to 1 if `norm`. shared_w[t]: sigmoid of the gate logit, or 1.
// Grid: T / 4 blocks of 128 threads (rounded up).
extern "C" __global__ void moe_route_f32(const float* logits, int T, int width, int E, int k,
                                         int norm, int gated, uint32_t* ids, float* weights,
                                         float* shared_w) {
  wait_for_previous_kernel();
  const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= T) return;
  const float* l = logits + (size_t)row * width;
  float m = -INFINITY;
  for (int i = lane; i < E; i += 32) m = fmaxf(m, l[i]);
  m = warp_max(m);
  float p[MOE_PER_LANE], s = 0.f;
#pragma unroll
  for (int q = 0; q < MOE_PER_LANE; q++) {
    const int i = lane + 32 * q;
    p[q] = i < E ? __expf(l[i] - m) : -1.f;
    s += i < E ? p[q] : 0.f;
  }
  s = warp_sum(s);
  float picked = 0.f;
  for (int j = 0; j < k; j++) {
    float best = -1.f;
    int at = 0x7fffffff;
#pragma unroll
    for (int q = 0; q < MOE_PER_LANE; q++)
      if (p[q] > best) best = p[q], at = lane + 32 * q;
    for (int o = 16; o > 0; o >>= 1) {
      const float b = __shfl_xor_sync(0xffffffffu, best, o);
      const int i = __shfl_xor_sync(0xffffffffu, at, o);
      if (b > best || (b == best && i < at)) best = b, at = i;
    }
#pragma unroll
    for (int q = 0; q < MOE_PER_LANE; q++)
      if (lane + 32 * q == at) p[q] = -1.f;
    picked += best / s;
    if (lane == 0) ids[row * k + j] = at, weights[row * k + j] = best / s;
  }
  if (lane == 0) {
    if (norm)
      for (int j = 0; j < k; j++) weights[row * k + j] /= picked;
    if (shared_w) shared_w[row] = gated ? 1.f / (1.f + __expf(-l[E])) : 1.f;
  }
}

// Groups the n = T * k assignments by expert: expert e's take padded slots from its offset
// on (each expert's run padded to whole tiles), order[slot] = assignment (MOE_NONE in padding),
// tile_expert[tile] = its expert (MOE_NONE past the last). One block; shared memory 2E words.
extern "C" __global__ void moe_align(const uint32_t* ids, int n, int E, int max_tiles, int tm,
                                     uint32_t* order, uint32_t* tile_expert) {
  extern __shared__ uint32_t moe_counts[];
  uint32_t* cursor = moe_counts + E;
  wait_for_previous_kernel();
  for (int e = threadIdx.x; e < E; e += blockDim.x) moe_counts[e] = 0;
  for (int p = threadIdx.x; p < max_tiles * tm; p += blockDim.x) order[p] = MOE_NONE;
  __syncthreads();
  for (int a = threadIdx.x; a < n; a += blockDim.x) atomicAdd(&moe_counts[ids[a]], 1u);
  __syncthreads();
  if (threadIdx.x == 0) {
    int tile = 0;
    for (int e = 0; e < E; e++) {
      cursor[e] = tile * tm;
      for (int t = (moe_counts[e] + tm - 1) / tm; t > 0; t--) tile_expert[tile++] = e;
    }
    for (; tile < max_tiles; tile++) tile_expert[tile] = MOE_NONE;
  }
  __syncthreads();
  for (int a = threadIdx.x; a < n; a += blockDim.x) order[atomicAdd(&cursor[ids[a]], 1u)] = a;
}

// One tile of a grouped matmul, TM = 16 (each warp 16 columns: acc[g][0], columns c0 + 16 w)
// or 64 (each warp 16 rows: acc[g][n], rows 16 w .., columns c0 + 16 n) = sum over K of A[rows] . B_g[cols], A's rows gathered by `a_row` (MOE_NONE:
// zeros), B_g the NB weight matrices [N, K] of the tile's expert. K % 8 == 0. 128 threads.
// The next chunk's loads are in flight while the tensor cores take the current one.
// Shared memory of a tile: its A chunk, then NB B chunks; the epilogue reuses it.
template <int TM, int NB>
__host__ __device__ constexpr int moe_tile_bytes() {
  return (TM + NB * MOE_BN) * MOE_LD * 2;
}

template <int TM, int NB>
__device__ __forceinline__ void moe_tile(
    const bf16* __restrict__ a, const uint32_t* a_row, const bf16* const* b, int N, int K,
    int c0, unsigned char* smem,
    nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> (*acc)[TM == 64 ? 4 : 1]) {
  using namespace nvcuda;
  constexpr int K8 = MOE_KC / 8, A_LOADS = (TM * K8 + 127) / 128, B_LOADS = MOE_BN * K8 / 128;
  constexpr int NF = TM == 64 ? 4 : 1;
  bf16* as = (bf16*)smem;
  bf16* bs_base = as + TM * MOE_LD;
  bf16* bs[NB];
#pragma unroll
  for (int g = 0; g < NB; g++) bs[g] = bs_base + g * MOE_BN * MOE_LD;
  const int warp = threadIdx.x >> 5;
  uint4 ra[A_LOADS], rb[NB][B_LOADS];
  auto load = [&](int k0) {
#pragma unroll
    for (int j = 0; j < A_LOADS; j++) {
      const int i = threadIdx.x + 128 * j, r = i / K8, kk = k0 + (i % K8) * 8;
      const uint32_t row = r < TM ? a_row[r] : MOE_NONE;
      ra[j] = row != MOE_NONE && kk < K ? *(const uint4*)(a + (size_t)row * K + kk)
                                        : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int g = 0; g < NB; g++)
#pragma unroll
      for (int j = 0; j < B_LOADS; j++) {
        const int i = threadIdx.x + 128 * j, c = c0 + i / K8, kk = k0 + (i % K8) * 8;
        rb[g][j] = c < N && kk < K ? __ldcs((const uint4*)(b[g] + (size_t)c * K + kk))
                                   : make_uint4(0, 0, 0, 0);
      }
  };
#pragma unroll
  for (int g = 0; g < NB; g++)
#pragma unroll
    for (int n = 0; n < NF; n++) wmma::fill_fragment(acc[g][n], 0.f);
  load(0);
  for (int k0 = 0; k0 < K; k0 += MOE_KC) {
    // Piece i of a chunk is row i / K8, 8 values at (i % K8) * 8: uint4 r * LD8 + i % K8.
    constexpr int LD8 = MOE_LD / 8;
#pragma unroll
    for (int j = 0; j < A_LOADS; j++) {
      const int i = threadIdx.x + 128 * j;
      if (i < TM * K8) ((uint4*)as)[i / K8 * LD8 + i % K8] = ra[j];
    }
#pragma unroll
    for (int g = 0; g < NB; g++)
#pragma unroll
      for (int j = 0; j < B_LOADS; j++) {
        const int i = threadIdx.x + 128 * j;
        ((uint4*)bs[g])[i / K8 * LD8 + i % K8] = rb[g][j];
      }
    __syncthreads();
    if (k0 + MOE_KC < K) load(k0 + MOE_KC);
#pragma unroll
    for (int kk = 0; kk < MOE_KC; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
      wmma::load_matrix_sync(fa, as + (TM == 64 ? warp * 16 * MOE_LD : 0) + kk, MOE_LD);
#pragma unroll
      for (int g = 0; g < NB; g++)
#pragma unroll
        for (int n = 0; n < NF; n++) {
          // B[k][n] = w[n][k]: w's rows read as a column-major K x N matrix.
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
          const int col = TM == 64 ? n * 16 : warp * 16;
          wmma::load_matrix_sync(fb, bs[g] + col * MOE_LD + kk, MOE_LD);
          wmma::mma_sync(acc[g][n], fa, fb, acc[g][n]);
        }
    }
    __syncthreads();
  }
}

// Stores a warp's accumulators (as moe_tile lays them out) into cs [TM, MOE_BN].
template <int TM>
__device__ __forceinline__ void moe_store(
    float* cs, nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>* acc) {
  const int warp = threadIdx.x >> 5;
  if (TM == 16) {
    nvcuda::wmma::store_matrix_sync(cs + warp * 16, acc[0], MOE_BN, nvcuda::wmma::mem_row_major);
    return;
  }
#pragma unroll
  for (int n = 0; n < 4; n++)
    nvcuda::wmma::store_matrix_sync(cs + warp * 16 * MOE_BN + n * 16, acc[n], MOE_BN,
                                    nvcuda::wmma::mem_row_major);
}

// act[a, c] = act(gate_e[c] . x[a / k]) * (up_e[c] . x[a / k]) for the assignments of tile
// blockIdx.x, columns blockIdx.y * MOE_BN ..; x [T, H] bf16, w [E, 2I, H] (an expert's gate
// rows, then its up rows), act [T * k, I] bf16. Gate and up are rounded to bf16 first, as
// the dense path stores them. Grid: (max_tiles, I / MOE_BN rounded up), 128 threads.
template <int TM>
__device__ void moe_gate_up(const bf16* x, const uint32_t* order, const uint32_t* tile_expert,
                            const bf16* w, int H, int I, int k, int act, bf16* out) {
  using namespace nvcuda;
  wait_for_previous_kernel();
  const uint32_t e = tile_expert[blockIdx.x];
  if (e == MOE_NONE) return;
  __shared__ uint32_t slot[TM], token[TM];
  // The tile's chunks, then (after its last use) the accumulators of gate and up.
  constexpr int TILE = moe_tile_bytes<TM, 2>(), EPI = 2 * TM * MOE_BN * 4;
  __shared__ __align__(128) unsigned char smem[TILE > EPI ? TILE : EPI];
  float* cs[2] = {(float*)smem, (float*)smem + TM * MOE_BN};
  if (threadIdx.x < TM) {
    const uint32_t a = order[blockIdx.x * TM + threadIdx.x];
    slot[threadIdx.x] = a;
    token[threadIdx.x] = a == MOE_NONE ? MOE_NONE : a / k;
  }
  __syncthreads();
  const int c0 = blockIdx.y * MOE_BN;
  const bf16* gate = w + (size_t)e * 2 * I * H;
  const bf16* b[2] = {gate, gate + (size_t)I * H};
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][TM == 64 ? 4 : 1];
  moe_tile<TM, 2>(x, token, b, I, H, c0, smem, acc);
  for (int g = 0; g < 2; g++) moe_store<TM>(cs[g], acc[g]);
  __syncthreads();
  for (int i = threadIdx.x; i < TM * MOE_BN; i += blockDim.x) {
    const int r = i / MOE_BN, c = c0 + i % MOE_BN;
    if (slot[r] == MOE_NONE || c >= I) continue;
    const float g = __bfloat162float(__float2bfloat16(cs[0][i]));
    const float u = __bfloat162float(__float2bfloat16(cs[1][i]));
    out[(size_t)slot[r] * I + c] = __float2bfloat16(gate_times(act, g, u));
  }
}

// y[a, c] = weights[a] * (down_e[c] . act[a]) for the tile's assignments; w [E, H, I],
// act [T * k, I] bf16, y [T * k, H] f32. Grid: (max_tiles, H / MOE_BN rounded up), 128 threads.
template <int TM>
__device__ void moe_down(const bf16* act, const uint32_t* order, const uint32_t* tile_expert,
                         const bf16* w, const float* weights, int H, int I, float* y) {
  using namespace nvcuda;
  wait_for_previous_kernel();
  const uint32_t e = tile_expert[blockIdx.x];
  if (e == MOE_NONE) return;
  __shared__ uint32_t slot[TM];
  constexpr int TILE = moe_tile_bytes<TM, 1>(), EPI = TM * MOE_BN * 4;
  __shared__ __align__(128) unsigned char smem[TILE > EPI ? TILE : EPI];
  float* cs = (float*)smem;
  if (threadIdx.x < TM) slot[threadIdx.x] = order[blockIdx.x * TM + threadIdx.x];
  __syncthreads();
  const int c0 = blockIdx.y * MOE_BN;
  const bf16* b[1] = {w + (size_t)e * H * I};
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[1][TM == 64 ? 4 : 1];
  moe_tile<TM, 1>(act, slot, b, H, I, c0, smem, acc);
  moe_store<TM>(cs, acc[0]);
  __syncthreads();
  for (int i = threadIdx.x; i < TM * MOE_BN; i += blockDim.x) {
    const int r = i / MOE_BN, c = c0 + i % MOE_BN;
    if (slot[r] == MOE_NONE || c >= H) continue;
    y[(size_t)slot[r] * H + c] = cs[i] * weights[slot[r]];
  }
}

#define MOE_TILED(TM)                                                                           \
  extern "C" __global__ void __launch_bounds__(128) moe_gate_up_m##TM##_bf16(                  \
      const bf16* x, const uint32_t* order, const uint32_t* tile_expert, const bf16* w, int H,  \
      int I, int k, int act, bf16* out) {                                                       \
    moe_gate_up<TM>(x, order, tile_expert, w, H, I, k, act, out);                               \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(128) moe_down_m##TM##_bf16(                     \
      const bf16* act, const uint32_t* order, const uint32_t* tile_expert, const bf16* w,       \
      const float* weights, int H, int I, float* y) {                                           \
    moe_down<TM>(act, order, tile_expert, w, weights, H, I, y);                                 \
  }
MOE_TILED(16)
MOE_TILED(64)

// Steps of few assignments (decodes): one warp per (assignment, output column) streams the
// column's weights with 16-byte loads, many in flight, the input row staged in shared memory
// (dynamic, K bf16); no grouping by expert. GATED: act[a, c] = act(gate_e[c] . x[a / k]) *
// (up_e[c] . x[a / k]) over w [E, 2N, K]; else y[a, c] = weights[a] * (w_e[c] . in[a]) over
// w [E, N, K], f32. Grid: (T * k, N / 8 rounded up), 256 threads.
template <bool GATED>
__device__ void moe_gemv(const bf16* __restrict__ in, int in_div, const uint32_t* ids,
                         const bf16* __restrict__ w, int N, int K, int act,
                         const float* weights, void* out) {
  extern __shared__ __align__(16) unsigned char moe_xs[];
  const int a = blockIdx.x, lane = threadIdx.x & 31, k8 = K / 8;
  const uint4* src = (const uint4*)(in + (size_t)(a / in_div) * K);
  uint4* xs = (uint4*)moe_xs;
  wait_for_previous_kernel();
  for (int i = threadIdx.x; i < k8; i += blockDim.x) xs[i] = src[i];
  __syncthreads();
  const int c = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (c >= N) return;
  const size_t e = ids[a];
  const uint4* wg = (const uint4*)(w + (e * (GATED ? 2 : 1) * N + c) * K);
  const uint4* wu = (const uint4*)(w + (e * 2 * N + N + c) * K);
  float g = 0.f, u = 0.f;
#pragma unroll 4
  for (int i = lane; i < k8; i += 32) {
    const uint4 x = xs[i];
    g = dot8(__ldcs(wg + i), x, g);
    if (GATED) u = dot8(__ldcs(wu + i), x, u);
  }
  g = warp_sum(g);
  if (GATED) u = warp_sum(u);
  if (lane != 0) return;
  if (GATED) {
    const float gb = __bfloat162float(__float2bfloat16(g));
    const float ub = __bfloat162float(__float2bfloat16(u));
    ((bf16*)out)[(size_t)a * N + c] = __float2bfloat16(gate_times(act, gb, ub));
  } else {
    ((float*)out)[(size_t)a * N + c] = g * weights[a];
  }
}

extern "C" __global__ void __launch_bounds__(256)
    moe_gemv_gate_up_bf16(const bf16* x, int k, const uint32_t* ids, const bf16* w, int I, int H,
                          int act, bf16* out) {
  moe_gemv<true>(x, k, ids, w, I, H, act, nullptr, out);
}

extern "C" __global__ void __launch_bounds__(256)
    moe_gemv_down_bf16(const bf16* act, const uint32_t* ids, const bf16* w, const float* weights,
                       int H, int I, float* y) {
  moe_gemv<false>(act, 1, ids, w, H, I, 0, weights, y);
}

// x[t, :] += sum_j y[t * k + j, :] (j in order) + shared_w[t] * ys[t, :] (when ys is given).
// Grid: T blocks.
extern "C" __global__ void moe_combine_f32(float* x, const float* y, const float* ys,
                                           const float* shared_w, int H, int k) {
  const size_t t = blockIdx.x;
  wait_for_previous_kernel();
  for (int c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < k; j++) acc += y[(t * k + j) * H + c];
    if (ys) acc += shared_w[t] * ys[t * H + c];
    x[t * H + c] += acc;
  }
}
