// ---- Mixture-of-experts layers ----
// Each of a step's T rows takes k experts: assignment a = t * k + j is row t's j-th pick.
// moe_route picks them from the router's logits, moe_align groups the assignments by expert
// into tiles of MOE_TM rows (one expert per tile, padding rows marked MOE_NONE), the two
// grouped matmuls run every tile against its expert's weights on tensor cores, and
// moe_combine adds each row's k results in j order. No atomics touch a value, and a row's
// dot products never see another row, so a row's result does not depend on the rows it
// shares an expert with.
#pragma once
#include <mma.h>
#include "elementwise.cuh"

#define MOE_TM 16
#define MOE_BN 64
#define MOE_KC 32
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
extern "C" __global__ void moe_align(const uint32_t* ids, int n, int E, int max_tiles,
                                     uint32_t* order, uint32_t* tile_expert) {
  extern __shared__ uint32_t moe_counts[];
  uint32_t* cursor = moe_counts + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) moe_counts[e] = 0;
  for (int p = threadIdx.x; p < max_tiles * MOE_TM; p += blockDim.x) order[p] = MOE_NONE;
  __syncthreads();
  for (int a = threadIdx.x; a < n; a += blockDim.x) atomicAdd(&moe_counts[ids[a]], 1u);
  __syncthreads();
  if (threadIdx.x == 0) {
    int tile = 0;
    for (int e = 0; e < E; e++) {
      cursor[e] = tile * MOE_TM;
      for (int t = (moe_counts[e] + MOE_TM - 1) / MOE_TM; t > 0; t--) tile_expert[tile++] = e;
    }
    for (; tile < max_tiles; tile++) tile_expert[tile] = MOE_NONE;
  }
  __syncthreads();
  for (int a = threadIdx.x; a < n; a += blockDim.x) order[atomicAdd(&cursor[ids[a]], 1u)] = a;
}

// One tile of a grouped matmul: acc[g] (16 x 16 per warp, warp w's columns c0 + 16 w ..) =
// sum over K of A[rows] . B_g[cols], A rows gathered by `a_row` (MOE_NONE: zeros), B_g the
// `nb` weight matrices [N, K] of the tile's expert. K % 8 == 0. 128 threads.
template <int NB>
__device__ __forceinline__ void moe_tile(
    const bf16* __restrict__ a, const uint32_t* a_row, const bf16* const* b, int N, int K,
    int c0, nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>* acc) {
  using namespace nvcuda;
  __shared__ __align__(32) bf16 as[MOE_TM * MOE_KC];
  __shared__ __align__(32) bf16 bs[NB][MOE_BN * MOE_KC];
  const int warp = threadIdx.x >> 5, k8 = MOE_KC / 8;
#pragma unroll
  for (int g = 0; g < NB; g++) wmma::fill_fragment(acc[g], 0.f);
  for (int k0 = 0; k0 < K; k0 += MOE_KC) {
    for (int i = threadIdx.x; i < MOE_TM * k8; i += blockDim.x) {
      const int r = i / k8, kk = k0 + (i % k8) * 8;
      const uint32_t row = a_row[r];
      ((uint4*)as)[i] = row != MOE_NONE && kk < K ? *(const uint4*)(a + (size_t)row * K + kk)
                                                  : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int g = 0; g < NB; g++)
      for (int i = threadIdx.x; i < MOE_BN * k8; i += blockDim.x) {
        const int c = c0 + i / k8, kk = k0 + (i % k8) * 8;
        ((uint4*)bs[g])[i] = c < N && kk < K ? *(const uint4*)(b[g] + (size_t)c * K + kk)
                                             : make_uint4(0, 0, 0, 0);
      }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < MOE_KC; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
      wmma::load_matrix_sync(fa, as + kk, MOE_KC);
#pragma unroll
      for (int g = 0; g < NB; g++) {
        // B[k][n] = w[n][k]: w's rows read as a column-major K x N matrix.
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
        wmma::load_matrix_sync(fb, bs[g] + warp * 16 * MOE_KC + kk, MOE_KC);
        wmma::mma_sync(acc[g], fa, fb, acc[g]);
      }
    }
    __syncthreads();
  }
}

// act[a, c] = act(gate_e[c] . x[a / k]) * (up_e[c] . x[a / k]) for the assignments of tile
// blockIdx.x, columns blockIdx.y * MOE_BN ..; x [T, H] bf16, w [E, 2I, H] (an expert's gate
// rows, then its up rows), act [T * k, I] bf16. Gate and up are rounded to bf16 first, as
// the dense path stores them. Grid: (max_tiles, I / MOE_BN rounded up), 128 threads.
extern "C" __global__ void __launch_bounds__(128)
    moe_gate_up_bf16(const bf16* x, const uint32_t* order, const uint32_t* tile_expert,
                     const bf16* w, int H, int I, int k, int act, bf16* out) {
  using namespace nvcuda;
  const uint32_t e = tile_expert[blockIdx.x];
  if (e == MOE_NONE) return;
  __shared__ uint32_t slot[MOE_TM], token[MOE_TM];
  __shared__ __align__(32) float cs[2][MOE_TM * MOE_BN];
  if (threadIdx.x < MOE_TM) {
    const uint32_t a = order[blockIdx.x * MOE_TM + threadIdx.x];
    slot[threadIdx.x] = a;
    token[threadIdx.x] = a == MOE_NONE ? MOE_NONE : a / k;
  }
  __syncthreads();
  const int c0 = blockIdx.y * MOE_BN, warp = threadIdx.x >> 5;
  const bf16* gate = w + (size_t)e * 2 * I * H;
  const bf16* b[2] = {gate, gate + (size_t)I * H};
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
  moe_tile<2>(x, token, b, I, H, c0, acc);
  for (int g = 0; g < 2; g++)
    wmma::store_matrix_sync(cs[g] + warp * 16, acc[g], MOE_BN, wmma::mem_row_major);
  __syncthreads();
  for (int i = threadIdx.x; i < MOE_TM * MOE_BN; i += blockDim.x) {
    const int r = i / MOE_BN, c = c0 + i % MOE_BN;
    if (slot[r] == MOE_NONE || c >= I) continue;
    const float g = __bfloat162float(__float2bfloat16(cs[0][i]));
    const float u = __bfloat162float(__float2bfloat16(cs[1][i]));
    out[(size_t)slot[r] * I + c] = __float2bfloat16(gate_times(act, g, u));
  }
}

// y[a, c] = weights[a] * (down_e[c] . act[a]) for the tile's assignments; w [E, H, I],
// act [T * k, I] bf16, y [T * k, H] f32. Grid: (max_tiles, H / MOE_BN rounded up), 128 threads.
extern "C" __global__ void __launch_bounds__(128)
    moe_down_bf16(const bf16* act, const uint32_t* order, const uint32_t* tile_expert,
                  const bf16* w, const float* weights, int H, int I, float* y) {
  using namespace nvcuda;
  const uint32_t e = tile_expert[blockIdx.x];
  if (e == MOE_NONE) return;
  __shared__ uint32_t slot[MOE_TM];
  __shared__ __align__(32) float cs[MOE_TM * MOE_BN];
  if (threadIdx.x < MOE_TM) slot[threadIdx.x] = order[blockIdx.x * MOE_TM + threadIdx.x];
  __syncthreads();
  const int c0 = blockIdx.y * MOE_BN, warp = threadIdx.x >> 5;
  const bf16* b[1] = {w + (size_t)e * H * I};
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[1];
  moe_tile<1>(act, slot, b, H, I, c0, acc);
  wmma::store_matrix_sync(cs + warp * 16, acc[0], MOE_BN, wmma::mem_row_major);
  __syncthreads();
  for (int i = threadIdx.x; i < MOE_TM * MOE_BN; i += blockDim.x) {
    const int r = i / MOE_BN, c = c0 + i % MOE_BN;
    if (slot[r] == MOE_NONE || c >= H) continue;
    y[(size_t)slot[r] * H + c] = cs[i] * weights[slot[r]];
  }
}

// x[t, :] += sum_j y[t * k + j, :] (j in order) + shared_w[t] * ys[t, :] (when ys is given).
// Grid: T blocks.
extern "C" __global__ void moe_combine_f32(float* x, const float* y, const float* ys,
                                           const float* shared_w, int H, int k) {
  const size_t t = blockIdx.x;
  for (int c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < k; j++) acc += y[(t * k + j) * H + c];
    if (ys) acc += shared_w[t] * ys[t * H + c];
    x[t * H + c] += acc;
  }
}
