// ferrite's CUDA kernels: everything of a Llama-family step except the matmuls (cuBLAS via
// candle). bf16 in and out, f32 arithmetic; the residual stream stays in f32.
// Paged KV layout: K and V `[num_blocks, num_kv_heads, block_size, head_dim]`.
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; `red` holds 32 floats of shared memory.
__device__ float block_sum(float v, float* red) {
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

// x[t, :] = table[ids[t], :] widened to f32. Grid: T blocks.
extern "C" __global__ void embed_bf16(const uint32_t* ids, const bf16* table, float* x,
                                      int hidden) {
  const bf16* row = table + (size_t)ids[blockIdx.x] * hidden;
  float* out = x + (size_t)blockIdx.x * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[i] = __bfloat162float(row[i]);
}

// RMSNorm of the f32 residual stream into bf16. Output row r reads row s = rows ? rows[r] : r.
// Grid: one block per output row.
extern "C" __global__ void rms_norm_bf16(const float* x, const uint32_t* rows, const bf16* w,
                                         bf16* out, int hidden, float eps) {
  __shared__ float red[32];
  size_t r = blockIdx.x, s = rows ? rows[r] : r;
  const float* xr = x + s * hidden;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) ss += xr[i] * xr[i];
  float inv = rsqrtf(block_sum(ss, red) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    out[r * hidden + i] = __float2bfloat16(xr[i] * inv * __bfloat162float(w[i]));
}

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.f + __expf(-g)) * u; }

// out[t, j] = silu(gu[t, 2j]) * gu[t, 2j + 1]: gate and up come interleaved from one matmul
// (the weights' rows alternate gate, up, so the small-row matmul finishes each pair itself).
extern "C" __global__ void silu_mul_bf16(const bf16* gu, bf16* out, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = __float2bfloat16(silu_times(__bfloat162float(gu[2 * i]), __bfloat162float(gu[2 * i + 1])));
}

// x[i] += d[i] (the residual add after a matmul that cannot fold it in).
extern "C" __global__ void add_f32(float* x, const float* d, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) x[i] += d[i];
}

// Splits one token's fused QKV row, adds the bias, applies the per-head Q/K RMSNorm (Qwen3),
// rotates Q and K, writes Q to `q_out [T, H, D]` and K/V into the cache at the token's slot.
// Grid: T blocks; a warp per head; dynamic shared memory: D floats per warp.
extern "C" __global__ void qkv_rope_write_bf16(
    const bf16* qkv, const bf16* bias, const bf16* q_norm, const bf16* k_norm, float eps,
    const uint32_t* positions, const float* cos_t, const float* sin_t, const uint32_t* slots,
    bf16* q_out, bf16* k_cache, bf16* v_cache, int H, int Hkv, int D, int rope_dim, int neox,
    int block_size) {
  extern __shared__ float sh[];
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  size_t t = blockIdx.x;
  const bf16* row = qkv + t * (size_t)(H + 2 * Hkv) * D;
  int pos = positions[t], half = rope_dim / 2;
  size_t slot = slots[t], blk = slot / block_size, off = slot % block_size;
  float* v = sh + warp * D;
  for (int h = warp; h < H + 2 * Hkv; h += nwarps) {
    for (int d = lane; d < D; d += 32) {
      float x = __bfloat162float(row[h * D + d]);
      if (bias) x += __bfloat162float(bias[h * D + d]);
      v[d] = x;
    }
    __syncwarp();
    bool is_q = h < H, is_k = !is_q && h < H + Hkv;
    const bf16* nw = is_q ? q_norm : (is_k ? k_norm : nullptr);
    float scale = 1.f;
    if (nw) {
      float ss = 0.f;
      for (int d = lane; d < D; d += 32) ss += v[d] * v[d];
      scale = rsqrtf(warp_sum(ss) / D + eps);
    }
    for (int d = lane; d < D; d += 32) {
      float r = v[d] * scale * (nw ? __bfloat162float(nw[d]) : 1.f);
      if ((is_q || is_k) && d < rope_dim) {
        int i, partner;
        float sign;
        if (neox) {
          i = d % half;
          partner = d < half ? d + half : d - half;
          sign = d < half ? -1.f : 1.f;
        } else {
          i = d / 2;
          partner = d ^ 1;
          sign = (d & 1) ? 1.f : -1.f;
        }
        float p = v[partner] * scale * (nw ? __bfloat162float(nw[partner]) : 1.f);
        r = r * cos_t[pos * half + i] + sign * p * sin_t[pos * half + i];
      }
      bf16 o = __float2bfloat16(r);
      if (is_q) {
        q_out[(t * H + h) * D + d] = o;
      } else {
        int hk = is_k ? h - H : h - H - Hkv;
        size_t at = ((blk * Hkv + hk) * block_size + off) * D + d;
        (is_k ? k_cache : v_cache)[at] = o;
      }
    }
    __syncwarp();
  }
}

// ---------------------------------------------------------------------------------------------
// Paged varlen attention over one packed step: prefill chunks and decodes in one launch.
// Program (tile, kv_head, split): a tile is up to TQ = ROWS / G consecutive query tokens of one
// request, all G query heads of the KV head (so each K/V row read serves ROWS query rows). Tile
// t of request i starts at cu_q[i] / TQ + i, so the request is found by binary search (vLLM's
// unified-attention layout) and the grid is sized from T and B alone. A split covers a share of
// the tile's key range; with splits > 1 it writes unnormalized partials for `merge_splits`.
// This CUDA-core kernel serves head sizes the tensor-core kernel below does not (256).
constexpr int ROWS = 16;
constexpr int KCHUNK = 128;  // keys per pass = threads per block

// The query tokens of program `blockIdx.x` and the keys they may see.
struct Tile {
  int seq, q0, t_begin, nt;  // request, its first row in the step, tile start, tokens
  int first_pos;             // position of the tile's first token
  int k_start, k_end;        // keys [k_start, k_end) (causal, sliding window)
};

// Tile t of request i starts at cu_q[i] / TQ + i: a binary search over that finds the
// request; false for the padding programs past a request's last tile.
__device__ bool find_tile(const uint32_t* cu_q, const uint32_t* seq_k, int num_seqs, int TQ,
                          int window, Tile& t) {
  const int tile = blockIdx.x;
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if ((int)(cu_q[mid] / TQ) + mid <= tile) lo = mid; else hi = mid - 1;
  }
  const int q0 = cu_q[lo], qlen = cu_q[lo + 1] - q0;
  t.seq = lo;
  t.q0 = q0;
  t.t_begin = (tile - (q0 / TQ + lo)) * TQ;
  if (t.t_begin >= qlen) return false;
  t.nt = min(TQ, qlen - t.t_begin);
  t.first_pos = (int)seq_k[lo] - qlen + t.t_begin;
  t.k_end = t.first_pos + t.nt;
  t.k_start = window > 0 ? max(0, t.first_pos - window + 1) : 0;
  return true;
}

template <int D>
__device__ void attention_tile(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                               const bf16* __restrict__ vc, const uint32_t* cu_q,
                               const uint32_t* seq_k, const uint32_t* tables, int max_blocks,
                               int num_seqs, int H, int Hkv, int block_size, float scale,
                               int window, float softcap, int splits, bf16* out, float* part_acc,
                               float* part_ml) {
  constexpr int DPT = D >= 128 ? D / 128 : 1;       // dims per thread in P.V
  constexpr int RSTRIDE = D >= 128 ? 1 : 128 / D;  // threads sharing a dim split the rows
  constexpr int NR = ROWS / RSTRIDE;
  __shared__ float qs[ROWS][D];
  __shared__ float ps[ROWS][KCHUNK];
  __shared__ float m_s[ROWS], l_s[ROWS], alpha_s[ROWS];
  const int G = H / Hkv;
  const int hk = blockIdx.y, split = blockIdx.z, tid = threadIdx.x;
  Tile tl;
  if (!find_tile(cu_q, seq_k, num_seqs, ROWS / G, window, tl)) return;
  const int seq = tl.seq, q0 = tl.q0, t_begin = tl.t_begin, first_pos = tl.first_pos;
  const int nrows = tl.nt * G, k_start = tl.k_start, k_end = tl.k_end;
  const int per = (k_end - k_start + splits - 1) / splits;
  const int s_begin = k_start + split * per, s_end = min(k_end, s_begin + per);
  const uint32_t* table = tables + (size_t)seq * max_blocks;

  for (int i = tid; i < ROWS * D; i += blockDim.x) {
    int r = i / D, d = i % D;
    float x = 0.f;
    if (r < nrows)
      x = __bfloat162float(q[((size_t)(q0 + t_begin + r / G) * H + hk * G + r % G) * D + d]);
    qs[r][d] = x * scale;
  }
  if (tid < ROWS) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.f;
  }
  float acc[NR][DPT];
#pragma unroll
  for (int i = 0; i < NR; i++)
#pragma unroll
    for (int j = 0; j < DPT; j++) acc[i][j] = 0.f;
  const int dim0 = tid % (D >= 128 ? 128 : D), rgroup = tid / (D >= 128 ? 128 : D);
  __syncthreads();

  for (int c0 = s_begin; c0 < s_end; c0 += KCHUNK) {
    // Scores: one key per thread, every row of the tile.
    const int k = c0 + tid;
    float s[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) s[r] = 0.f;
    if (k < s_end) {
      const uint32_t page = table[k / block_size];
      const uint4* krow = reinterpret_cast<const uint4*>(
          kc + (((size_t)page * Hkv + hk) * block_size + k % block_size) * D);
#pragma unroll 4
      for (int c = 0; c < D / 8; c++) {
        uint4 raw = __ldg(krow + c);
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
        float kf[8];
#pragma unroll
        for (int e = 0; e < 4; e++) {
          float2 f = __bfloat1622float2(h2[e]);
          kf[2 * e] = f.x;
          kf[2 * e + 1] = f.y;
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
          if (r < nrows) {
            const float4* qv = reinterpret_cast<const float4*>(&qs[r][c * 8]);
            float4 a = qv[0], b = qv[1];
            s[r] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] +
                    b.y * kf[5] + b.z * kf[6] + b.w * kf[7];
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
      const int pos = first_pos + r / G;
      bool ok = r < nrows && k < s_end && k <= pos && (window <= 0 || k > pos - window);
      float x = s[r];
      if (softcap > 0.f) x = softcap * tanhf(x / softcap);
      ps[r][tid] = ok ? x : -INFINITY;
    }
    __syncthreads();
    // Online softmax per row: a warp per row.
    const int warp = tid >> 5, lane = tid & 31;
    for (int r = warp; r < ROWS; r += blockDim.x >> 5) {
      float mx = -INFINITY;
      for (int j = lane; j < KCHUNK; j += 32) mx = fmaxf(mx, ps[r][j]);
      mx = warp_max(mx);
      const float m_old = m_s[r], m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int j = lane; j < KCHUNK; j += 32) {
        float p = m_new == -INFINITY ? 0.f : __expf(ps[r][j] - m_new);
        ps[r][j] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        float a = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
        alpha_s[r] = a;
        l_s[r] = l_s[r] * a + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();
    // P.V: each thread owns DPT dims of NR rows.
#pragma unroll
    for (int i = 0; i < NR; i++) {
      const float a = alpha_s[i * RSTRIDE + rgroup];
#pragma unroll
      for (int j = 0; j < DPT; j++) acc[i][j] *= a;
    }
    const int n = min(KCHUNK, s_end - c0);
#pragma unroll 4
    for (int kk = 0; kk < n; kk++) {
      const int key = c0 + kk;
      const uint32_t page = table[key / block_size];
      const bf16* vrow = vc + (((size_t)page * Hkv + hk) * block_size + key % block_size) * D;
      float vv[DPT];
#pragma unroll
      for (int j = 0; j < DPT; j++) vv[j] = __bfloat162float(vrow[dim0 + j * 128]);
#pragma unroll
      for (int i = 0; i < NR; i++) {
        if (i * RSTRIDE + rgroup >= nrows) break;  // decodes fill few of the tile's rows
        const float p = ps[i * RSTRIDE + rgroup][kk];
#pragma unroll
        for (int j = 0; j < DPT; j++) acc[i][j] += p * vv[j];
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < NR; i++) {
    const int r = i * RSTRIDE + rgroup;
    if (r >= nrows) continue;
    const size_t row = (size_t)(q0 + t_begin + r / G) * H + hk * G + r % G;
#pragma unroll
    for (int j = 0; j < DPT; j++) {
      const int d = dim0 + j * 128;
      if (splits == 1) {
        const float l = l_s[r];
        out[row * D + d] = __float2bfloat16(l > 0.f ? acc[i][j] / l : 0.f);
      } else {
        part_acc[(row * splits + split) * D + d] = acc[i][j];
        if (d == 0) {
          part_ml[(row * splits + split) * 2] = m_s[r];
          part_ml[(row * splits + split) * 2 + 1] = l_s[r];
        }
      }
    }
  }
}

#define ATTENTION(D)                                                                         \
  extern "C" __global__ void __launch_bounds__(KCHUNK) paged_attention_d##D##_bf16(          \
      const bf16* q, const bf16* kc, const bf16* vc, const uint32_t* cu_q,                   \
      const uint32_t* seq_k, const uint32_t* tables, int max_blocks, int num_seqs, int H,    \
      int Hkv, int block_size, float scale, int window, float softcap, int splits, bf16* out, \
      float* part_acc, float* part_ml) {                                                     \
    attention_tile<D>(q, kc, vc, cu_q, seq_k, tables, max_blocks, num_seqs, H, Hkv,         \
                      block_size, scale, window, softcap, splits, out, part_acc, part_ml);   \
  }
ATTENTION(256)

// Combines the splits of each query row: grid T*H blocks, D threads.
extern "C" __global__ void merge_splits_bf16(const float* part_acc, const float* part_ml,
                                             bf16* out, int splits, int D) {
  const size_t row = blockIdx.x;
  float m = -INFINITY;
  for (int s = 0; s < splits; s++) m = fmaxf(m, part_ml[(row * splits + s) * 2]);
  float l = 0.f, acc = 0.f;
  for (int s = 0; s < splits; s++) {
    const float ms = part_ml[(row * splits + s) * 2];
    if (ms == -INFINITY) continue;
    const float w = __expf(ms - m);
    l += part_ml[(row * splits + s) * 2 + 1] * w;
    acc += part_acc[(row * splits + s) * D + threadIdx.x] * w;
  }
  out[row * D + threadIdx.x] = __float2bfloat16(l > 0.f ? acc / l : 0.f);
}

// ---------------------------------------------------------------------------------------------
// The same attention on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate), flash-
// attention style, for head sizes 64 and 128: a program takes 64 query rows (TQ = 64 / G tokens
// x the G query heads of one KV head, so each K/V tile read from memory serves every head of
// the group), walks its share of the keys in tiles of 64 staged in shared memory through the
// block table (coalesced 16-byte loads), and keeps the softmax online in registers. Decodes
// fill few rows of a tile; warps without rows skip the math, and splits of the key range keep
// the multiprocessors busy on long contexts.
constexpr int MMA_ROWS = 64;
constexpr int MMA_KEYS = 64;
constexpr int MMA_THREADS = 128;

__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* p) {
  uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* p) {
  uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// 16 bytes global -> shared without passing through registers; zero-fills when !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <int D>
__device__ void attention_tile_mma(const bf16* __restrict__ q, const bf16* __restrict__ kc,
                                   const bf16* __restrict__ vc, const uint32_t* cu_q,
                                   const uint32_t* seq_k, const uint32_t* tables, int max_blocks,
                                   int num_seqs, int H, int Hkv, int block_size, float scale,
                                   int window, float softcap, int splits, bf16* out,
                                   float* part_acc, float* part_ml) {
  constexpr int LD = D + 8;  // padded rows: ldmatrix rows land in distinct banks
  constexpr int KS = D / 16, DN = D / 8, NJ = MMA_KEYS / 8;
  __shared__ __align__(16) bf16 ks_[MMA_KEYS][LD];
  __shared__ __align__(16) bf16 vs_[MMA_KEYS][LD];
  const int G = H / Hkv;
  const int hk = blockIdx.y, split = blockIdx.z, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  Tile tl;
  if (!find_tile(cu_q, seq_k, num_seqs, MMA_ROWS / G, window, tl)) return;
  const int seq = tl.seq, q0 = tl.q0, t_begin = tl.t_begin, first_pos = tl.first_pos;
  const int nrows = tl.nt * G, k_start = tl.k_start, k_end = tl.k_end;
  // This split's keys, whole 64-key tiles apart from the ends.
  const int per = ((k_end - k_start + splits - 1) / splits + MMA_KEYS - 1) / MMA_KEYS * MMA_KEYS;
  const int s_begin = k_start + split * per, s_end = min(k_end, s_begin + per);
  const bool active = warp * 16 < nrows;
  const uint32_t* table = tables + (size_t)seq * max_blocks;

  // This thread's two rows of the warp's 16, and their Q fragments.
  const int r0 = warp * 16 + lane / 4, r1 = r0 + 8;
  const int pos0 = first_pos + r0 / G, pos1 = first_pos + r1 / G;
  const bf16* q0p = r0 < nrows ? q + ((size_t)(q0 + t_begin + r0 / G) * H + hk * G + r0 % G) * D : nullptr;
  const bf16* q1p = r1 < nrows ? q + ((size_t)(q0 + t_begin + r1 / G) * H + hk * G + r1 % G) * D : nullptr;
  uint32_t qa[KS][4];
#pragma unroll
  for (int s = 0; s < KS; s++) {
    const int c = s * 16 + (lane % 4) * 2;
    qa[s][0] = q0p ? *reinterpret_cast<const uint32_t*>(q0p + c) : 0u;
    qa[s][1] = q1p ? *reinterpret_cast<const uint32_t*>(q1p + c) : 0u;
    qa[s][2] = q0p ? *reinterpret_cast<const uint32_t*>(q0p + c + 8) : 0u;
    qa[s][3] = q1p ? *reinterpret_cast<const uint32_t*>(q1p + c + 8) : 0u;
  }
  float o[DN][4];
#pragma unroll
  for (int n = 0; n < DN; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float log2e = 1.4426950408889634f;

  for (int kb = s_begin; kb < s_end; kb += MMA_KEYS) {
    __syncthreads();  // the previous tile is no longer read
    // Stage the tile with cp.async (global to shared, no registers): look up every page
    // first, then issue all of this thread's 16-byte copies back to back, so they are in
    // flight together instead of one round trip each; keys past the range are zero-filled.
    constexpr int LOADS = MMA_KEYS * D / 8 / MMA_THREADS;
    size_t at[LOADS];
#pragma unroll
    for (int j = 0; j < LOADS; j++) {
      const int i = tid + j * MMA_THREADS, k = kb + i / (D / 8);
      at[j] = k < s_end ? (((size_t)table[k / block_size] * Hkv + hk) * block_size + k % block_size) * D +
                              (i % (D / 8)) * 8
                        : SIZE_MAX;
    }
#pragma unroll
    for (int j = 0; j < LOADS; j++) {
      const int i = tid + j * MMA_THREADS, key = i / (D / 8), c = (i % (D / 8)) * 8;
      const bool in = at[j] != SIZE_MAX;
      cp_async16(&ks_[key][c], kc + (in ? at[j] : 0), in);
      cp_async16(&vs_[key][c], vc + (in ? at[j] : 0), in);
    }
    asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();
    if (!active) continue;
    // S = Q K^T for this warp's 16 rows and the tile's 64 keys.
    float s[NJ][4];
#pragma unroll
    for (int j = 0; j < NJ; j++) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int t = 0; t < KS; t += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, &ks_[j * 8 + lane % 8][t * 16 + (lane / 8) * 8]);
        mma_bf16(s[j], qa[t], b[0], b[1]);
        mma_bf16(s[j], qa[t + 1], b[2], b[3]);
      }
    }
    // Mask, scale, online softmax (each row's 64 scores sit in one quad of lanes).
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int row = h ? r1 : r0, pos = h ? pos1 : pos0;
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const int key = kb + j * 8 + (lane % 4) * 2 + e;
          float x = s[j][2 * h + e] * scale;
          if (softcap > 0.f) x = softcap * tanhf(x / softcap);
          const bool ok = row < nrows && key < s_end && key <= pos &&
                          (window <= 0 || key > pos - window);
          x = ok ? x * log2e : -INFINITY;
          s[j][2 * h + e] = x;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[h], mx);
      const float corr = m_new == -INFINITY ? 1.f : exp2f(m[h] - m_new);
      m[h] = m_new;
      l[h] *= corr;
#pragma unroll
      for (int n = 0; n < DN; n++) {
        o[n][2 * h] *= corr;
        o[n][2 * h + 1] *= corr;
      }
#pragma unroll
      for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const float p = m_new == -INFINITY ? 0.f : exp2f(s[j][2 * h + e] - m_new);
          s[j][2 * h + e] = p;
          l[h] += p;
        }
    }
    // O += P V: the S accumulators of two key groups are exactly an A fragment.
#pragma unroll
    for (int kk = 0; kk < MMA_KEYS / 16; kk++) {
      uint32_t a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                       pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                       pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < DN; n += 2) {
        uint32_t b[4];
        const int mtx = lane / 8;
        ldmatrix_x4_trans(b, &vs_[kk * 16 + (mtx % 2) * 8 + lane % 8][(n + mtx / 2) * 8]);
        mma_bf16(o[n], a, b[0], b[1]);
        mma_bf16(o[n + 1], a, b[2], b[3]);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; h++) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int row = h ? r1 : r0;
    if (row >= nrows) continue;
    const size_t qrow = (size_t)(q0 + t_begin + row / G) * H + hk * G + row % G;
    if (splits > 1) {
      // Unnormalized, with the running max back in natural-log units for merge_splits.
      const size_t at = qrow * splits + split;
#pragma unroll
      for (int n = 0; n < DN; n++) {
        part_acc[at * D + n * 8 + (lane % 4) * 2] = o[n][2 * h];
        part_acc[at * D + n * 8 + (lane % 4) * 2 + 1] = o[n][2 * h + 1];
      }
      if (lane % 4 == 0) {
        part_ml[at * 2] = m[h] == -INFINITY ? -INFINITY : m[h] / log2e;
        part_ml[at * 2 + 1] = l[h];
      }
      continue;
    }
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    bf16* dst = out + qrow * D;
#pragma unroll
    for (int n = 0; n < DN; n++) {
      *reinterpret_cast<__nv_bfloat162*>(dst + n * 8 + (lane % 4) * 2) =
          __floats2bfloat162_rn(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
  }
}

#define ATTENTION_MMA(D)                                                                      \
  extern "C" __global__ void __launch_bounds__(MMA_THREADS) paged_attention_mma_d##D##_bf16(          \
      const bf16* q, const bf16* kc, const bf16* vc, const uint32_t* cu_q,                    \
      const uint32_t* seq_k, const uint32_t* tables, int max_blocks, int num_seqs, int H,     \
      int Hkv, int block_size, float scale, int window, float softcap, int splits, bf16* out, \
      float* part_acc, float* part_ml) {                                                      \
    attention_tile_mma<D>(q, kc, vc, cu_q, seq_k, tables, max_blocks, num_seqs, H, Hkv,      \
                          block_size, scale, window, softcap, splits, out, part_acc,         \
                          part_ml);                                                          \
  }
ATTENTION_MMA(64)
ATTENTION_MMA(128)

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
constexpr int DRAW_PARAMS = 6;

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

// ---- Matmuls of one or two rows (decode steps) ----
// out[m, n] = sum_k in[m, k] w[n, k]: bound by reading w once, which cuBLAS does at ~1.15x the
// copy floor for one row; here one warp per output column streams the column's weights with
// 16-byte loads, 2 x GEMV_LOADS in flight per lane. The small kernels around a decode's matmuls are
// folded in, so a layer is four of these plus rotary and attention:
// the input row is built once per block in shared memory (bf16, as the unfused kernels round it):
enum { GEMV_IN_BF16 = 0, GEMV_IN_RMS = 1 };
//   IN_BF16: a bf16 [R, k] tensor; IN_RMS: RMSNorm (weights `norm`) of f32 residual rows
//   x[rows ? rows[m] : m];
// and the column's dot product goes out as
enum { GEMV_OUT_BF16 = 0, GEMV_OUT_F32 = 1, GEMV_OUT_ADD = 2, GEMV_OUT_SILU = 3 };
//   bf16 [R, n], f32 [R, n], added into the f32 residual stream [R, n] (the residual add), or
//   for interleaved gate|up columns, silu(gate) * up as bf16 [R, n / 2] (a warp takes both
//   columns of a pair; each is rounded to bf16 first, as the unfused path stores them).
#define GEMV_LOADS 4

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

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
  const int per_unit = out_mode == GEMV_OUT_SILU ? 2 : 1, units = n / per_unit;
  const int items = first < units ? ((units - 1 - first) / stride + 1) * per_unit * chunks : 0;
  uint4 next[GEMV_LOADS];
  if (items > 0) gemv_load((const uint4*)(w + (size_t)first * per_unit * k), lane, k8, next);
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
        if (out_mode == GEMV_OUT_SILU && col % 2 == 0) {
          gate[m] = sum;
        } else if (lane == 0 && m < r) {
          const size_t o = (size_t)m * n + col;
          if (out_mode == GEMV_OUT_BF16) ((bf16*)out)[o] = __float2bfloat16(sum);
          else if (out_mode == GEMV_OUT_F32) ((float*)out)[o] = sum;
          else if (out_mode == GEMV_OUT_ADD) ((float*)out)[o] += sum;
          else
            ((bf16*)out)[(size_t)m * units + col / 2] = __float2bfloat16(
                silu_times(__bfloat162float(__float2bfloat16(gate[m])),
                           __bfloat162float(__float2bfloat16(sum))));
        }
      }
    }
    col = ncol;
    c = nc;
  }
}

// Threads per block (`GEMV_THREADS` in kernels.rs) and two blocks per multiprocessor: the
// bound caps registers at 64.
#define GEMV(R, PRO)                                                                  \
  extern "C" __global__ void __launch_bounds__(512, 2)                                 \
      gemv_r##R##_bf16(const bf16* w, int n, int k, int r, int in_mode, const void* in, \
                       const uint32_t* rows, const bf16* norm, float eps, int out_mode, \
                       void* out) {                                                   \
    gemv<R, PRO>(w, n, k, r, in_mode, in, rows, norm, eps, out_mode, out);            \
  }
GEMV(1, 2)
GEMV(2, 1)
