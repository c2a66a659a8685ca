#pragma once
#include "common.cuh"

// The better of two (value, index) candidates: larger value, ties to the lower index.
__device__ __forceinline__ void keep_best(float& v, int& idx, float v2, int i2) {
  if (v2 > v || (v2 == v && i2 < idx)) {
    v = v2;
    idx = i2;
  }
}

// Best (value, index) over the block; every thread gets the result.
__device__ void block_best(float& v, int& idx) {
  __shared__ float best_v[32];
  __shared__ int best_i[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int o = 16; o > 0; o >>= 1)
    keep_best(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
  if (lane == 0) {
    best_v[warp] = v;
    best_i[warp] = idx;
  }
  __syncthreads();
  const bool have = lane < (int)(blockDim.x >> 5);
  v = have ? best_v[lane] : -INFINITY;
  idx = have ? best_i[lane] : 0x7fffffff;
  for (int o = 16; o > 0; o >>= 1)
    keep_best(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
  __syncthreads();
}

// u32 parameters per row of `sample_rows_f32`.
constexpr int DRAW_PARAMS = 7;  // the last: the row has a grammar mask (mask_rows_f32)

// SplitMix64 of (key, token): the row's noise for one token, a pure function of both, so a
// seeded request draws the same token whatever else shares the step.
__device__ __forceinline__ float uniform01(uint64_t key, uint32_t token) {
  uint64_t z = key ^ ((uint64_t)token * 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return ((float)(z >> 40) + 0.5f) * (1.0f / 16777216.0f);  // in (0, 1)
}

// Floats as unsigned ints in the same order (for binary searches over values).
__device__ __forceinline__ uint32_t ordered(float x) {
  const uint32_t b = __float_as_uint(x);
  return b & 0x80000000u ? ~b : b | 0x80000000u;
}

// `block_sum` with shared scratch of its own (for callers without one).
__device__ float block_total(float v) {
  __shared__ float red[32];
  return block_sum(v, red);
}

// The largest ordered value u with total(u) >= want, where total(u) sums `weight(l)` over the
// row's finite logits l with ordered(l) >= u (non-increasing in u): 32 halvings.
template <class W>
__device__ uint32_t largest_cut(const float* row, int n, float want, W weight) {
  uint32_t lo = 0, hi = 0xffffffffu;
  while (lo < hi) {
    const uint32_t mid = lo + (uint32_t)(((uint64_t)hi - lo + 1) / 2);
    float t = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const float l = row[i];
      if (l > -INFINITY && ordered(l) >= mid) t += weight(l);
    }
    if (block_total(t) >= want) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One token per row of f32 logits `[R, n]`; `params[6r..6r+6]` = {temperature, min_p, top_p
// (f32 bits), top_k, key low, key high}. Temperature 0: argmax, ties to the lowest index.
// Otherwise a draw from softmax(logits / T) by the Gumbel-max trick (argmax of l/T + Gumbel
// noise) among the tokens the CPU sampler keeps, found as logit thresholds instead of a sort:
// the top_k largest, then the most likely whose probabilities (renormalized) reach top_p,
// then those with p >= min_p * p_max, i.e. l >= l_max + T ln(min_p) (ties at a threshold all
// stay). NaN and -inf are never drawn. Grid: one block per row.
extern "C" __global__ void sample_rows_f32(const float* x, const uint32_t* params, uint32_t* out,
                                           int n) {
  const float* row = x + (size_t)blockIdx.x * n;
  const uint32_t* p = params + DRAW_PARAMS * blockIdx.x;
  const float temperature = __uint_as_float(p[0]), min_p = __uint_as_float(p[1]);
  const float top_p = __uint_as_float(p[2]);
  const uint32_t top_k = p[3];
  const uint64_t key = (uint64_t)p[4] | ((uint64_t)p[5] << 32);
  float v = -INFINITY;
  int idx = 0x7fffffff;
  for (int i = threadIdx.x; i < n; i += blockDim.x) keep_best(v, idx, row[i], i);
  block_best(v, idx);
  if (temperature > 0.f && v > -INFINITY) {
    const float inv_t = 1.f / temperature;
    uint32_t cut = 0;  // keep ordered(l) >= cut
    if (top_k > 0 && top_k < (uint32_t)n)
      cut = largest_cut(row, n, (float)top_k, [](float) { return 1.f; });
    if (top_p < 1.f) {
      const auto w = [&](float l) { return ordered(l) >= cut ? __expf((l - v) * inv_t) : 0.f; };
      float z = 0.f;
      for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (row[i] > -INFINITY) z += w(row[i]);
      z = block_total(z);
      cut = max(cut, largest_cut(row, n, top_p * z, w));
    }
    const float floor = min_p > 0.f ? v + temperature * logf(min_p) : -INFINITY;
    float g = -INFINITY;
    int gi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const float l = row[i];
      if (!(l >= floor) || l == -INFINITY || ordered(l) < cut) continue;  // also drops NaN
      keep_best(g, gi, l * inv_t - logf(-logf(uniform01(key, i))), i);
    }
    block_best(g, gi);
    if (gi != 0x7fffffff) idx = gi;
  }
  if (threadIdx.x == 0) out[blockIdx.x] = idx == 0x7fffffff ? 0u : (uint32_t)idx;
}


// Grammar masks (structured output): logits of the tokens whose bit in the row's mask
// (`words` u32 per row, bit t % 32 of word t / 32) is clear become -inf, in rows whose draw
// parameters say they are masked. Grid: (rows, blocks per row), one token per thread and pass
// (coalesced): one block per row took 43 us on a 49K vocabulary, as long as the sampling.
extern "C" __global__ void mask_rows_f32(float* x, const uint32_t* params, const uint32_t* masks,
                                         int n, int words) {
  const size_t r = blockIdx.x;
  if (params[DRAW_PARAMS * r + DRAW_PARAMS - 1] == 0) return;
  float* row = x + r * n;
  const uint32_t* m = masks + r * words;
  for (int t = blockIdx.y * blockDim.x + threadIdx.x; t < n; t += gridDim.y * blockDim.x)
    if (!((m[t >> 5] >> (t & 31)) & 1u)) row[t] = -INFINITY;
}
