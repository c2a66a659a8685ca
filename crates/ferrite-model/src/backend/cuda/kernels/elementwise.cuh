// The small kernels around the matmuls: embedding lookup, norms, gated activations,
// residual adds, logit soft-capping.
#pragma once
#include "common.cuh"

// x[t, :] = table[ids[t] - first, :] * scale, widened to f32; zeros for a token outside the
// table's `rows` (a tensor-parallel rank's share of the vocabulary). Grid: T blocks.
extern "C" __global__ void embed_bf16(const uint32_t* ids, const bf16* table, float* x,
                                      int hidden, float scale, uint32_t first, uint32_t rows) {
  const uint32_t id = ids[blockIdx.x] - first;  // wraps past `rows` below `first`
  const bf16* row = table + (size_t)id * hidden;
  float* out = x + (size_t)blockIdx.x * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    out[i] = id < rows ? __bfloat162float(row[i]) * scale : 0.f;
}

__device__ __forceinline__ void store_as(bf16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store_as(float* p, float v) { *p = v; }

// RMSNorm of the f32 residual stream into bf16 (a matmul's input) or f32 (an MTP head's own
// residual stream). Output row r reads row s = rows ? rows[r] : r. Grid: one block per output
// row.
template <typename T>
__device__ void rms_norm_rows(const float* x, const uint32_t* rows, const bf16* w, T* out,
                              int hidden, float eps) {
  __shared__ float red[32];
  size_t r = blockIdx.x, s = rows ? rows[r] : r;
  const float* xr = x + s * hidden;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) ss += xr[i] * xr[i];
  float inv = rsqrtf(block_sum(ss, red) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    store_as(&out[r * hidden + i], xr[i] * inv * __bfloat162float(w[i]));
}

extern "C" __global__ void rms_norm_bf16(const float* x, const uint32_t* rows, const bf16* w,
                                         bf16* out, int hidden, float eps) {
  rms_norm_rows(x, rows, w, out, hidden, eps);
}

extern "C" __global__ void rms_norm_f32(const float* x, const uint32_t* rows, const bf16* w,
                                        float* out, int hidden, float eps) {
  rms_norm_rows(x, rows, w, out, hidden, eps);
}

// x[r, :] += RMSNorm(y[r, :]) * w, y f32 (Gemma's norms after attention and the MLP).
// Grid: one block per row.
extern "C" __global__ void add_rms_norm_f32(float* x, const float* y, const bf16* w, int hidden,
                                            float eps) {
  __shared__ float red[32];
  const size_t r = blockIdx.x;
  const float* yr = y + r * hidden;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) ss += yr[i] * yr[i];
  float inv = rsqrtf(block_sum(ss, red) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    x[r * hidden + i] += yr[i] * inv * __bfloat162float(w[i]);
}

// Activations of a gated MLP (`Activation` in backend/mod.rs).
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

__device__ __forceinline__ float gate_times(int act, float g, float u) {
  if (act == ACT_GELU_TANH) {
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + tanhf(c * (g + 0.044715f * g * g * g))) * u;
  }
  return g / (1.f + __expf(-g)) * u;
}

// out[t, j] = act(gu[t, 2j]) * gu[t, 2j + 1]: gate and up come interleaved from one matmul
// (the weights' rows alternate gate, up, so the small-row matmul finishes each pair itself).
extern "C" __global__ void gated_mul_bf16(const bf16* gu, bf16* out, size_t n, int act) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = __float2bfloat16(
      gate_times(act, __bfloat162float(gu[2 * i]), __bfloat162float(gu[2 * i + 1])));
}

// x[i] += d[i] (the residual add after a matmul that cannot fold it in).
extern "C" __global__ void add_f32(float* x, const float* d, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) x[i] += d[i];
}

// x[i] = cap * tanh(x[i] / cap) (Gemma's final-logit soft-cap).
extern "C" __global__ void softcap_f32(float* x, size_t n, float cap) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) x[i] = cap * tanhf(x[i] / cap);
}
