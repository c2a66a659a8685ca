// ---- Gated delta-net (linear attention) layers: Qwen3.5, Qwen3-Next ----
// A request's state, in its slot of `state` ([slots, elems] f32): the causal convolution's last
// K - 1 inputs ([K - 1, conv_dim], oldest first), then the delta rule's matrix per value head
// ([v_heads, dk, dv]). A request whose chunk starts at position 0 starts from zeros, a
// prefix-cache hit from a checkpoint slot; a chunk may also write its state after its first n
// tokens into a checkpoint slot (in place: no other copy), and a verify step the state after
// each of its tokens from the drafts[2i]-th on but the last into slots drafts[2i + 1], +1, ...
// (the recurrent form only: a step with drafts never takes the chunked one). The input
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
                                           const uint32_t* saves, const uint32_t* drafts) {
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
  if (drafts && drafts[2 * i + 1] != 0xffffffffu) {
    for (int after = drafts[2 * i]; after < n; after++) {
      float* save = state + (size_t)(drafts[2 * i + 1] + after - drafts[2 * i]) * elems;
      for (int m = 0; m < K - 1; m++)
        save[(size_t)m * conv_dim + c] =
            gdn_window_row(proj, P, window, conv_dim, K, r0, after, m, c, fresh);
    }
  }
  // Ascending m reads entries m + n > m, not yet overwritten.
  for (int m = 0; m < K - 1; m++)
    window[(size_t)m * conv_dim + c] =
        gdn_window_row(proj, P, window, conv_dim, K, r0, n, m, c, fresh);
}

// Token t's write strength beta = sigmoid(b) and log decay -A softplus(a + dt_bias) of value
// head h, from `ba` = its b [nv] then a [nv] in the input projection.
__device__ __forceinline__ void gdn_gates(const bf16* ba, int nv, int h, float A, float dt,
                                          float& beta, float& log_decay) {
  const float b = __bfloat162float(ba[h]), a = __bfloat162float(ba[nv + h]) + dt;
  beta = 1.f / (1.f + __expf(-b));
  log_decay = -A * (a > 20.f ? a : log1pf(__expf(a)));
}

// The delta rule, one warp per (request i, value head h, 32 of its dv columns): lane j keeps
// column j of the head's [dk, dv] matrix S in registers and walks the request's tokens in
// order: S *= decay, delta = (v - S^T k) * beta, S += k delta^T, o = S^T q, with q and k
// L2-normed (q times 1/sqrt(dk)); o f32 [T, v_heads * dv]. With saves, the columns after the
// first n tokens also go to the checkpoint. Grid: (B, v_heads, dv / 32 rounded up), 32 threads.
template <int DK>
__device__ void gdn_rule(const float* qkv, const bf16* proj, int P, float* state, int elems,
                         int conv_offset, const bf16* a_log, const bf16* dt_bias, int nk, int nv,
                         int dv, const uint32_t* cu, const uint32_t* positions,
                         const uint32_t* slots, const uint32_t* saves, const uint32_t* drafts,
                         float* o_out) {
  __shared__ float q[DK], k[DK];
  const int i = blockIdx.x, h = blockIdx.y, lane = threadIdx.x, j = blockIdx.z * 32 + lane;
  const bool col = j < dv;
  const int kh = h / (nv / nk), kd = nk * DK, conv_dim = 2 * kd + nv * dv, vd = nv * dv;
  wait_for_previous_kernel();
  const int r0 = cu[i], r1 = cu[i + 1];
  if (r0 == r1) return;
  const size_t head = conv_offset + (size_t)h * DK * dv;
  float* g = state + (size_t)slots[i] * elems + head;
  const bool saving = saves && saves[2 * i + 1] != 0xffffffffu;
  const int save_at = saving ? r0 + (int)saves[2 * i] - 1 : -1;
  float* save = saving ? state + (size_t)saves[2 * i + 1] * elems + head : nullptr;
  // A verify step: the state after each row from this one on (but the last) to its slot.
  const bool drafting = drafts && drafts[2 * i + 1] != 0xffffffffu;
  const int draft_from = drafting ? r0 + (int)drafts[2 * i] - 1 : r1;
  const bool fresh = positions[r0] == 0;
  float S[DK];
#pragma unroll
  for (int e = 0; e < DK; e++) S[e] = fresh || !col ? 0.f : g[(size_t)e * dv + j];
  const float A = __expf(__bfloat162float(a_log[h])), dt = __bfloat162float(dt_bias[h]);
  const float scale = rsqrtf((float)DK);
  for (int t = r0; t < r1; t++) {
    const float* row = qkv + (size_t)t * conv_dim;
    float qq = 0.f, kk = 0.f;
    for (int e = lane; e < DK; e += 32) {
      const float a = row[kh * DK + e], b = row[kd + kh * DK + e];
      q[e] = a, k[e] = b;
      qq += a * a, kk += b * b;
    }
    qq = warp_sum(qq);
    kk = warp_sum(kk);
    __syncwarp();
    const float qn = rsqrtf(qq + 1e-6f) * scale, kn = rsqrtf(kk + 1e-6f);
    const float v = col ? row[2 * kd + h * dv + j] : 0.f;
    float beta, decay;
    gdn_gates(proj + (size_t)t * P + conv_dim + vd, nv, h, A, dt, beta, decay);
    decay = __expf(decay);
    float mem = 0.f;
#pragma unroll
    for (int e = 0; e < DK; e++) {
      S[e] *= decay;
      mem += S[e] * k[e];
    }
    const float delta = (v - mem * kn) * beta * kn;
    float o = 0.f;
#pragma unroll
    for (int e = 0; e < DK; e++) {
      S[e] += k[e] * delta;
      o += S[e] * q[e];
    }
    if (col) {
      o_out[(size_t)t * vd + h * dv + j] = o * qn;
      if (t == save_at)
#pragma unroll
        for (int e = 0; e < DK; e++) save[(size_t)e * dv + j] = S[e];
      if (t >= draft_from && t < r1 - 1) {
        float* d = state + (size_t)(drafts[2 * i + 1] + t - draft_from) * elems + head;
#pragma unroll
        for (int e = 0; e < DK; e++) d[(size_t)e * dv + j] = S[e];
      }
    }
    __syncwarp();  // every lane is done with q and k before the next token's
  }
  if (col)
#pragma unroll
    for (int e = 0; e < DK; e++) g[(size_t)e * dv + j] = S[e];
}

#define GDN_RULE(DK)                                                                          \
  extern "C" __global__ void __launch_bounds__(32) gdn_rule_k##DK##_f32(                       \
      const float* qkv, const bf16* proj, int P, float* state, int elems, int conv_offset,     \
      const bf16* a_log, const bf16* dt_bias, int nk, int nv, int dv, const uint32_t* cu,      \
      const uint32_t* positions, const uint32_t* slots, const uint32_t* saves,                 \
      const uint32_t* drafts, float* o) {                                                      \
    gdn_rule<DK>(qkv, proj, P, state, elems, conv_offset, a_log, dt_bias, nk, nv, dv, cu,      \
                 positions, slots, saves, drafts, o);                                         \
  }
GDN_RULE(16)
GDN_RULE(32)
GDN_RULE(64)
GDN_RULE(128)

// The delta rule in its chunk-parallel form, for steps with prefill chunks: a request's tokens
// in chunks of GDN_CHUNK (also cut at its checkpoint), each solved as matrices from the state S0
// at the chunk's start. With g_t the cumulative log decay within the chunk, the values written
// U solve (I + A) U = beta (V - e^g K S0), A[t, s] = beta_t e^(g_t - g_s) k_t.k_s (s < t);
// then O = e^g Q S0 + (e^(g_t - g_s) q_t.k_s, s <= t) U and the next S0 = e^g_n S0 + K'^T U,
// K'_t = e^(g_n - g_t) k_t. Every exponent is <= 0. Same arguments and output as gdn_rule;
// a block of 256 threads per (request i, value head h, 32 of its dv columns), whose tile of S
// stays in shared memory across the chunks. Grid: (B, v_heads, dv / 32 rounded up).
// Its shared memory, laid out below, is sized by `chunk_shared_bytes` in gdn.rs.
#define GDN_CHUNK 64
#define GDN_COLS 32

template <int DK>
__device__ void gdn_chunked(const float* qkv, const bf16* proj, int P, float* state, int elems,
                            int conv_offset, const bf16* a_log, const bf16* dt_bias, int nk,
                            int nv, int dv, const uint32_t* cu, const uint32_t* positions,
                            const uint32_t* slots, const uint32_t* saves, float* o_out) {
  constexpr int C = GDN_CHUNK, W = GDN_COLS, KS = DK + 1, CS = C + 1;
  extern __shared__ float smem[];
  float* Q = smem;            // [C][KS] normed q (times 1/sqrt(dk))
  float* K = Q + C * KS;      // [C][KS] normed k
  float* S = K + C * KS;      // [DK][W] the state's tile
  float* Am = S + DK * W;     // [C][CS] A
  float* Pm = Am + C * CS;    // [C][CS] the intra-chunk attention
  float* U = Pm + C * CS;     // [C][W] v, then the right-hand side, then U
  float* g = U + C * W;       // [C] cumulative log decay
  float* beta = g + C;        // [C]
  float* wk = beta + C;       // [C] e^(g_n - g_t)
  const int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = lane, j = blockIdx.z * W + lane;
  const bool col = j < dv;
  const int kh = h / (nv / nk), kd = nk * DK, conv_dim = 2 * kd + nv * dv, vd = nv * dv;
  wait_for_previous_kernel();
  const int r0 = cu[i], r1 = cu[i + 1];
  if (r0 == r1) return;
  const size_t head = conv_offset + (size_t)h * DK * dv;
  float* own = state + (size_t)slots[i] * elems + head;
  const bool saving = saves && saves[2 * i + 1] != 0xffffffffu;
  const int save_end = saving ? r0 + (int)saves[2 * i] : -1;
  float* save = saving ? state + (size_t)saves[2 * i + 1] * elems + head : nullptr;
  const bool fresh = positions[r0] == 0;
  // Thread (warp, lane) owns S[e][c] for e = warp + 8m.
  for (int e = warp; e < DK; e += 8) S[e * W + c] = fresh || !col ? 0.f : own[(size_t)e * dv + j];
  const float Ah = __expf(__bfloat162float(a_log[h])), dt = __bfloat162float(dt_bias[h]);
  const float scale = rsqrtf((float)DK);
  for (int start = r0; start < r1;) {
    int end = min(start + C, r1);
    if (start < save_end) end = min(end, save_end);
    const int n = end - start;
    // Rows of q, k, v and the gates; rows past n are zeros.
    for (int t = warp; t < C; t += 8) {
      const float* row = qkv + (size_t)(start + t) * conv_dim;
      float qq = 0.f, kk = 0.f;
      for (int e = lane; e < DK; e += 32) {
        const float a = t < n ? row[kh * DK + e] : 0.f, b = t < n ? row[kd + kh * DK + e] : 0.f;
        Q[t * KS + e] = a, K[t * KS + e] = b;
        qq += a * a, kk += b * b;
      }
      qq = warp_sum(qq);
      kk = warp_sum(kk);
      const float qn = rsqrtf(qq + 1e-6f) * scale, kn = rsqrtf(kk + 1e-6f);
      for (int e = lane; e < DK; e += 32) Q[t * KS + e] *= qn, K[t * KS + e] *= kn;
      U[t * W + c] = t < n && col ? row[2 * kd + h * dv + j] : 0.f;
      if (lane == 0) {
        float b = 0.f, l = 0.f;
        if (t < n) gdn_gates(proj + (size_t)(start + t) * P + conv_dim + vd, nv, h, Ah, dt, b, l);
        beta[t] = b, g[t] = l;
      }
    }
    __syncthreads();
    if (warp == 0) {  // inclusive scan of the log decays, two per lane
      float x0 = g[2 * lane], x1 = x0 + g[2 * lane + 1], run = x1;
      for (int d = 1; d < 32; d <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, run, d);
        if (lane >= d) run += y;
      }
      const float before = run - x1;
      g[2 * lane] = before + x0, g[2 * lane + 1] = run;
    }
    __syncthreads();
    // A and the intra-chunk attention: thread owns rows 4 * (tid / 16) + x, columns tid % 16 + 16y.
    {
      const int rb = 4 * (tid >> 4), cb = tid & 15;
      if (rb < n) {
        float kk[4][4] = {}, qk[4][4] = {};
        for (int e = 0; e < DK; e++) {
          float kr[4], qr[4], kc[4];
#pragma unroll
          for (int x = 0; x < 4; x++) {
            kr[x] = K[(rb + x) * KS + e], qr[x] = Q[(rb + x) * KS + e];
            kc[x] = K[(cb + 16 * x) * KS + e];
          }
#pragma unroll
          for (int x = 0; x < 4; x++)
#pragma unroll
            for (int y = 0; y < 4; y++) kk[x][y] += kr[x] * kc[y], qk[x][y] += qr[x] * kc[y];
        }
#pragma unroll
        for (int x = 0; x < 4; x++)
#pragma unroll
          for (int y = 0; y < 4; y++) {
            const int r = rb + x, s = cb + 16 * y;
            const float d = __expf(g[r] - g[min(s, r)]);
            Am[r * CS + s] = s < r ? beta[r] * d * kk[x][y] : 0.f;
            Pm[r * CS + s] = s <= r ? d * qk[x][y] : 0.f;
          }
      }
    }
    // The right-hand side beta (v - e^g K S0), and e^g Q S0 into registers: thread owns
    // rows t = warp + 8m of column c.
    float o[C / 8];
#pragma unroll
    for (int m = 0; m < C / 8; m++) {
      const int t = warp + 8 * m;
      float ks = 0.f, qs = 0.f;
      if (t < n)
        for (int e = 0; e < DK; e++) {
          const float s = S[e * W + c];
          ks += K[t * KS + e] * s, qs += Q[t * KS + e] * s;
        }
      const float eg = __expf(g[t]);
      U[t * W + c] = beta[t] * (U[t * W + c] - eg * ks);
      o[m] = eg * qs;
    }
    __syncthreads();
    // Forward substitution in blocks of 16 rows: warp 0 solves a diagonal block (each lane its
    // own column), then every thread takes the block out of the rows below it.
    for (int b0 = 0; b0 < n; b0 += 16) {
      if (warp == 0) {
        float x[16];
#pragma unroll
        for (int r = 0; r < 16; r++) {
          float v = U[(b0 + r) * W + c];
#pragma unroll
          for (int s = 0; s < r; s++) v -= Am[(b0 + r) * CS + b0 + s] * x[s];
          x[r] = v;
          U[(b0 + r) * W + c] = v;
        }
      }
      __syncthreads();
      for (int t = b0 + 16 + warp; t < n; t += 8) {
        float v = U[t * W + c];
#pragma unroll
        for (int s = 0; s < 16; s++) v -= Am[t * CS + b0 + s] * U[(b0 + s) * W + c];
        U[t * W + c] = v;
      }
      __syncthreads();
    }
    if (lane == 0)
      for (int t = warp; t < C; t += 8) wk[t] = __expf(g[n - 1] - g[t]);
    __syncthreads();
#pragma unroll
    for (int m = 0; m < C / 8; m++) {
      const int t = warp + 8 * m;
      if (t >= n) continue;
      float v = o[m];
      for (int s = 0; s <= t; s++) v += Pm[t * CS + s] * U[s * W + c];
      if (col) o_out[(size_t)(start + t) * vd + h * dv + j] = v;
    }
    const float en = __expf(g[n - 1]);
    for (int e = warp; e < DK; e += 8) {
      float v = en * S[e * W + c];
      for (int t = 0; t < n; t++) v += wk[t] * K[t * KS + e] * U[t * W + c];
      S[e * W + c] = v;
      if (end == save_end && col) save[(size_t)e * dv + j] = v;
    }
    __syncthreads();
    start = end;
  }
  if (col)
    for (int e = warp; e < DK; e += 8) own[(size_t)e * dv + j] = S[e * W + c];
}

#define GDN_CHUNKED(DK)                                                                       \
  extern "C" __global__ void __launch_bounds__(256) gdn_chunked_k##DK##_f32(                   \
      const float* qkv, const bf16* proj, int P, float* state, int elems, int conv_offset,     \
      const bf16* a_log, const bf16* dt_bias, int nk, int nv, int dv, const uint32_t* cu,      \
      const uint32_t* positions, const uint32_t* slots, const uint32_t* saves, float* o) {     \
    gdn_chunked<DK>(qkv, proj, P, state, elems, conv_offset, a_log, dt_bias, nk, nv, dv, cu,   \
                    positions, slots, saves, o);                                              \
  }
GDN_CHUNKED(16)
GDN_CHUNKED(32)
GDN_CHUNKED(64)
GDN_CHUNKED(128)

// out[t, h] = rms_norm(o[t, h]) * norm * silu(z[t, h]) per value head of dv, bf16. Grid:
// (T, v_heads), dv threads rounded up to whole warps.
extern "C" __global__ void gdn_gated_norm_bf16(const float* o, const bf16* proj, int P,
                                               int conv_dim, const bf16* norm, float eps,
                                               int nv, int dv, bf16* out) {
  __shared__ float red[32];
  wait_for_previous_kernel();
  const int t = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
  const size_t at = (size_t)t * nv * dv + h * dv + j;
  const float x = j < dv ? o[at] : 0.f;
  const float ss = block_sum(x * x, red);
  if (j >= dv) return;
  const float z = __bfloat162float(proj[(size_t)t * P + conv_dim + h * dv + j]);
  out[at] = __float2bfloat16(x * rsqrtf(ss / dv + eps) * __bfloat162float(norm[j]) * gdn_silu(z));
}

// x[i] *= sigmoid(g[i]), bf16 (Qwen3.5's gated attention output).
extern "C" __global__ void gate_sigmoid_bf16(bf16* x, const bf16* g, size_t n) {
  wait_for_previous_kernel();
  const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float gate = __bfloat162float(g[i]);
  x[i] = __float2bfloat16(__bfloat162float(x[i]) / (1.f + __expf(-gate)));
}
