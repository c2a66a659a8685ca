// ---- Gated delta-net (linear attention) layers: Qwen3.5, Qwen3-Next ----
// A request's state, in its slot of `state` ([slots, elems] f32): the causal convolution's last
// K - 1 inputs ([K - 1, conv_dim], oldest first), then the delta rule's matrix per value head
// ([v_heads, dk, dv]). A request whose chunk starts at position 0 starts from zeros, a
// prefix-cache hit from a checkpoint slot; a chunk may also write its state after its first n
// tokens into a checkpoint slot (in place: no other copy). The input
// projection's row per token `proj` [T, P] bf16 holds Q | K | V (the convolution's channels),
// then z [v_heads * dv], b [v_heads], a [v_heads].
#pragma once
#include "common.cuh"

// The request of token t: the last i with cu[i] <= t.
__device__ __forceinline__ int gdn_seq_of(const uint32_t* cu, int num_seqs, int t) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if ((int)cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ float gdn_silu(float x) { return x / (1.f + __expf(-x)); }

// y[t, c] = silu(sum_j w[c, j] x[t - K + 1 + j, c]), inputs before the chunk from the window
// (zeros for a fresh request). Grid: (T, conv_dim / 256 rounded up), 256 threads.
extern "C" __global__ void gdn_conv_f32(const bf16* proj, int P, const float* state, int elems,
                                        const bf16* w, int conv_dim, int K, const uint32_t* cu,
                                        int num_seqs, const uint32_t* positions,
                                        const uint32_t* slots, float* y) {
  wait_for_previous_kernel();
  const int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= conv_dim) return;
  const int i = gdn_seq_of(cu, num_seqs, t), r0 = cu[i];
  const bool fresh = positions[r0] == 0;
  const float* window = state + (size_t)slots[i] * elems;
  float acc = 0.f;
  for (int j = 0; j < K; j++) {
    const int src = t - (K - 1) + j;
    float x;
    if (src >= r0) x = __bfloat162float(proj[(size_t)src * P + c]);
    else x = fresh ? 0.f : window[(size_t)(src - r0 + K - 1) * conv_dim + c];
    acc += __bfloat162float(w[c * K + j]) * x;
  }
  y[(size_t)t * conv_dim + c] = gdn_silu(acc);
}

// A prefix-cache hit starts from its checkpoint: slot restores[i]'s state copied into the
// request's own. Before the other kernels. Grid: (B, elems / 1024 rounded up), 256 threads.
extern "C" __global__ void gdn_state_restore(float* state, int elems, const uint32_t* restores,
                                             const uint32_t* slots) {
  wait_for_previous_kernel();
  const int i = blockIdx.x;
  if (restores[i] == 0xffffffffu) return;
  const float4* src = (const float4*)(state + (size_t)restores[i] * elems);
  float4* dst = (float4*)(state + (size_t)slots[i] * elems);
  for (int e = blockIdx.y * 256 + threadIdx.x; e < elems / 4; e += gridDim.y * 256) dst[e] = src[e];
}

// Row m of the window after the chunk's first n tokens: the last K - 1 inputs of
// window ++ chunk[..n].
__device__ __forceinline__ float gdn_window_row(const bf16* proj, int P, const float* window,
                                                int conv_dim, int K, int r0, int n, int m,
                                                int c, bool fresh) {
  const int u = n - (K - 1) + m;  // chunk-relative token of window row m
  if (u >= 0) return __bfloat162float(proj[(size_t)(r0 + u) * P + c]);
  return fresh ? 0.f : window[(size_t)(m + n) * conv_dim + c];
}

// Slides each request's window over its chunk, and writes the window after the first
// saves[2i] tokens into checkpoint saves[2i + 1] (0xffffffff: none). After gdn_conv_f32
// (which reads the old window). Grid: (B, conv_dim / 256 rounded up).
extern "C" __global__ void gdn_conv_window(const bf16* proj, int P, float* state, int elems,
                                           int conv_dim, int K, const uint32_t* cu,
                                           const uint32_t* positions, const uint32_t* slots,
                                           const uint32_t* saves) {
  wait_for_previous_kernel();
  const int i = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= conv_dim) return;
  const int r0 = cu[i], n = cu[i + 1] - r0;
  if (n == 0) return;
  const bool fresh = positions[r0] == 0;
  float* window = state + (size_t)slots[i] * elems;
  if (saves && saves[2 * i + 1] != 0xffffffffu) {
    float* save = state + (size_t)saves[2 * i + 1] * elems;
    for (int m = 0; m < K - 1; m++)
      save[(size_t)m * conv_dim + c] =
          gdn_window_row(proj, P, window, conv_dim, K, r0, saves[2 * i], m, c, fresh);
  }
  // Ascending m reads entries m + n > m, not yet overwritten.
  for (int m = 0; m < K - 1; m++)
    window[(size_t)m * conv_dim + c] =
        gdn_window_row(proj, P, window, conv_dim, K, r0, n, m, c, fresh);
}

// The delta rule of one request's value head h (block (i, h), dv threads rounded up to whole
// warps: thread j < dv keeps column j of the head's [dk, dv] matrix S in shared memory), token by token: S *= decay,
// delta = (v - S^T k) * beta, S += k delta^T, o = S^T q; q and k L2-normed (q times 1/sqrt(dk)),
// then out = rms_norm(o) * norm * silu(z), bf16 [T, v_heads * dv]. Dynamic shared memory
// (dk * dv + 2 * dk) floats.
extern "C" __global__ void gdn_rule_bf16(const float* qkv, const bf16* proj, int P,
                                         float* state, int elems, int conv_offset,
                                         const bf16* a_log, const bf16* dt_bias,
                                         const bf16* norm, float eps, int nk, int nv, int dk,
                                         int dv, const uint32_t* cu, const uint32_t* positions,
                                         const uint32_t* slots, const uint32_t* saves,
                                         bf16* out) {
  extern __shared__ float gdn_smem[];
  __shared__ float red[32];
  float* S = gdn_smem;
  float* q = S + dk * dv;
  float* k = q + dk;
  const int i = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
  const int kh = h / (nv / nk), kd = nk * dk, conv_dim = 2 * kd + nv * dv, vd = nv * dv;
  wait_for_previous_kernel();
  const int r0 = cu[i], r1 = cu[i + 1];
  if (r0 == r1) return;
  float* g = state + (size_t)slots[i] * elems + conv_offset + (size_t)h * dk * dv;
  // The checkpoint to write after the first `save_at` tokens, if any.
  const bool saving = saves && saves[2 * i + 1] != 0xffffffffu;
  const int save_at = saving ? r0 + (int)saves[2 * i] - 1 : -1;
  float* save = saving ? state + (size_t)saves[2 * i + 1] * elems + conv_offset +
                             (size_t)h * dk * dv
                       : nullptr;
  const bool fresh = positions[r0] == 0;
  for (int e = j; e < dk * dv; e += blockDim.x) S[e] = fresh ? 0.f : g[e];
  const float A = __expf(__bfloat162float(a_log[h])), dt = __bfloat162float(dt_bias[h]);
  const bool col = j < dv;
  const float w = col ? __bfloat162float(norm[j]) : 0.f, scale = rsqrtf((float)dk);
  for (int t = r0; t < r1; t++) {
    const float* row = qkv + (size_t)t * conv_dim;
    float qq = 0.f, kk = 0.f;
    for (int e = j; e < dk; e += blockDim.x) {
      const float a = row[kh * dk + e], b = row[kd + kh * dk + e];
      q[e] = a, k[e] = b;
      qq += a * a, kk += b * b;
    }
    qq = block_sum(qq, red);
    kk = block_sum(kk, red);
    const float qn = rsqrtf(qq + 1e-6f) * scale, kn = rsqrtf(kk + 1e-6f);
    const bf16* p = proj + (size_t)t * P + conv_dim;
    const float v = col ? row[2 * kd + h * dv + j] : 0.f;
    const float z = col ? __bfloat162float(p[h * dv + j]) : 0.f;
    const float b = __bfloat162float(p[vd + h]), a = __bfloat162float(p[vd + nv + h]) + dt;
    const float beta = 1.f / (1.f + __expf(-b));
    const float decay = __expf(-A * (a > 20.f ? a : log1pf(__expf(a))));
    float mem = 0.f, o = 0.f;
    if (col) {
      for (int e = 0; e < dk; e++) {
        const float s = S[e * dv + j] * decay;
        S[e * dv + j] = s;
        mem += s * k[e] * kn;
      }
      const float delta = (v - mem) * beta;
      for (int e = 0; e < dk; e++) {
        const float s = S[e * dv + j] + k[e] * kn * delta;
        S[e * dv + j] = s;
        o += s * q[e] * qn;
      }
      // Each thread writes its own column: no other reads or writes it.
      if (t == save_at)
        for (int e = 0; e < dk; e++) save[e * dv + j] = S[e * dv + j];
    }
    const float ss = block_sum(o * o, red);
    if (col)
      out[(size_t)t * vd + h * dv + j] =
          __float2bfloat16(o * rsqrtf(ss / dv + eps) * w * gdn_silu(z));
  }
  for (int e = j; e < dk * dv; e += blockDim.x) g[e] = S[e];
}

// x[i] *= sigmoid(g[i]), bf16 (Qwen3.5's gated attention output).
extern "C" __global__ void gate_sigmoid_bf16(bf16* x, const bf16* g, size_t n) {
  wait_for_previous_kernel();
  const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float gate = __bfloat162float(g[i]);
  x[i] = __float2bfloat16(__bfloat162float(x[i]) / (1.f + __expf(-gate)));
}
