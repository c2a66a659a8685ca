#pragma once
#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// Paged varlen attention over one packed step: prefill chunks and decodes in one launch.
// Program (tile, kv_head, split): a tile is up to TQ = MMA_ROWS / G consecutive query tokens of
// one request, all G query heads of the KV head (so each K/V row read serves every head of the
// group). Tile t of request i starts at cu_q[i] / TQ + i, so the request is found by binary
// search (vLLM's unified-attention layout) and the grid is sized from T and B alone. Split s
// covers positions [s, s + 1) * split_keys of the tile's keys; with splits > 1 it writes
// unnormalized partials for `merge_splits`.
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

// Combines the splits of each query row: grid T*H blocks, D threads.
extern "C" __global__ void merge_splits_bf16(const float* part_acc, const float* part_ml,
                                             bf16* out, int splits, int D, const bf16* sinks,
                                             int H) {
  wait_for_previous_kernel();
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
  if (sinks) l += __expf(__bfloat162float(sinks[row % H]) - m);
  out[row * D + threadIdx.x] = __float2bfloat16(l > 0.f ? acc / l : 0.f);
}

// ---------------------------------------------------------------------------------------------
// On tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate), flash-attention style, for
// head sizes 32, 64, 128 and 256: a program takes 64 query rows, walks its share of the keys in
// tiles of 64 (32 for heads of 256) staged in shared memory through the block table (coalesced
// 16-byte loads), and keeps the softmax online in registers. Decodes
// fill few rows of a tile; warps without rows skip the math, and splits of the key range keep
// the multiprocessors busy on long contexts.
constexpr int MMA_ROWS = 64;
constexpr int MMA_KEYS = 64;
constexpr int MMA_THREADS = 128;

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

// 8 codes (`raw`) times their token's scale `s`, as 8 bf16 into shared memory at `dst`.
template <Kv KV>
__device__ __forceinline__ void stage8(bf16* dst, uint2 raw, float s) {
  const uint8_t* c = reinterpret_cast<const uint8_t*>(&raw);
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int e = 0; e < 4; e++)
    o[e] = pack_bf16(kv_decode<KV>(c[2 * e]) * s, kv_decode<KV>(c[2 * e + 1]) * s);
  *reinterpret_cast<uint4*>(dst) = out;
}

template <int D, Kv KV>
__device__ void attention_tile_mma(const bf16* __restrict__ q, const void* __restrict__ kc,
                                   const void* __restrict__ vc, const float* __restrict__ ksc,
                                   const float* __restrict__ vsc, const uint32_t* cu_q,
                                   const uint32_t* seq_k, const uint32_t* tables, int max_blocks,
                                   int num_seqs, int H, int Hkv, int block_size, float scale,
                                   int window, float softcap, const bf16* sinks, int splits,
                                   int split_keys, bf16* out,
                                   float* part_acc, float* part_ml) {
  // Keys per tile: 64, or 32 for heads of 256 (their tiles and accumulators are twice as big).
  constexpr int KEYS = D == 256 ? 32 : MMA_KEYS;
  constexpr int LD = D + 8;  // padded rows: ldmatrix rows land in distinct banks
  constexpr int KS = D / 16, DN = D / 8, NJ = KEYS / 8;
  __shared__ __align__(16) bf16 ks_[KEYS][LD];
  __shared__ __align__(16) bf16 vs_[KEYS][LD];
  const int G = H / Hkv;
  const int hk = blockIdx.y, split = blockIdx.z, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  Tile tl;
  if (!find_tile(cu_q, seq_k, num_seqs, MMA_ROWS / G, window, tl)) return;
  const int seq = tl.seq, q0 = tl.q0, t_begin = tl.t_begin, first_pos = tl.first_pos;
  const int nrows = tl.nt * G, k_start = tl.k_start, k_end = tl.k_end;
  // This split's keys: [split, split + 1) * split_keys (whole 64-key tiles) of the positions,
  // walked in tiles aligned to positions 0, KEYS, ...: a row's partial sums then cover the
  // same keys in the same tiles whatever rows share its program (a decode, or a verify window
  // whose first row starts the sliding window earlier).
  const int s_begin = max(k_start, split * split_keys);
  const int s_end = min(k_end, (split + 1) * split_keys);
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

  for (int kb = s_begin / KEYS * KEYS; kb < s_end; kb += KEYS) {
    __syncthreads();  // the previous tile is no longer read
    // Stage the tile with cp.async (global to shared, no registers): look up every page
    // first, then issue all of this thread's 16-byte copies back to back, so they are in
    // flight together instead of one round trip each; keys outside the split are zero-filled.
    constexpr int LOADS = KEYS * D / 8 / MMA_THREADS;
    size_t at[LOADS];
#pragma unroll
    for (int j = 0; j < LOADS; j++) {
      const int i = tid + j * MMA_THREADS, k = kb + i / (D / 8);
      at[j] = k >= s_begin && k < s_end ? (((size_t)table[k / block_size] * Hkv + hk) * block_size + k % block_size) * D +
                              (i % (D / 8)) * 8
                        : SIZE_MAX;
    }
    if (KV == Kv::Bf16) {
#pragma unroll
      for (int j = 0; j < LOADS; j++) {
        const int i = tid + j * MMA_THREADS, key = i / (D / 8), c = (i % (D / 8)) * 8;
        const bool in = at[j] != SIZE_MAX;
        cp_async16(&ks_[key][c], static_cast<const bf16*>(kc) + (in ? at[j] : 0), in);
        cp_async16(&vs_[key][c], static_cast<const bf16*>(vc) + (in ? at[j] : 0), in);
      }
      asm volatile("cp.async.wait_all;\n" ::);
    } else {
      // 8 codes (8 bytes) per load, widened to bf16 with their token's scale on the way in.
      uint2 kr[LOADS], vr[LOADS];
#pragma unroll
      for (int j = 0; j < LOADS; j++) {
        const bool in = at[j] != SIZE_MAX;
        kr[j] = in ? *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(kc) + at[j])
                   : make_uint2(0, 0);
        vr[j] = in ? *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(vc) + at[j])
                   : make_uint2(0, 0);
      }
#pragma unroll
      for (int j = 0; j < LOADS; j++) {
        const int i = tid + j * MMA_THREADS, key = i / (D / 8), c = (i % (D / 8)) * 8;
        const bool in = at[j] != SIZE_MAX;
        const float sk = in ? ksc[at[j] / D] : 0.f, sv = in ? vsc[at[j] / D] : 0.f;
        stage8<KV>(&ks_[key][c], kr[j], sk);
        stage8<KV>(&vs_[key][c], vr[j], sv);
      }
    }
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
    // Mask, scale, online softmax (each row's 64 scores sit in one quad of lanes). The
    // multiplies and subtractions are written as `__f*_rn`, which the compiler never fuses
    // into an FMA: fused or not could differ between the unrolled copies for rows g and
    // g + 8, and a row would round otherwise in another place of its tile.
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int row = h ? r1 : r0, pos = h ? pos1 : pos0;
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const int key = kb + j * 8 + (lane % 4) * 2 + e;
          float x = __fmul_rn(s[j][2 * h + e], scale);
          if (softcap > 0.f) x = __fmul_rn(softcap, tanhf(__fdiv_rn(x, softcap)));
          const bool ok = row < nrows && key >= s_begin && key < s_end && key <= pos &&
                          (window <= 0 || key > pos - window);
          x = ok ? __fmul_rn(x, log2e) : -INFINITY;
          s[j][2 * h + e] = x;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[h], mx);
      const float corr = m_new == -INFINITY ? 1.f : exp2f(__fsub_rn(m[h], m_new));
      m[h] = m_new;
      l[h] = __fmul_rn(l[h], corr);
#pragma unroll
      for (int n = 0; n < DN; n++) {
        o[n][2 * h] = __fmul_rn(o[n][2 * h], corr);
        o[n][2 * h + 1] = __fmul_rn(o[n][2 * h + 1], corr);
      }
#pragma unroll
      for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const float p =
              m_new == -INFINITY ? 0.f : exp2f(__fsub_rn(s[j][2 * h + e], m_new));
          s[j][2 * h + e] = p;
          l[h] = __fadd_rn(l[h], p);
        }
    }
    // O += P V: the S accumulators of two key groups are exactly an A fragment.
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; kk++) {
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
    // A sink is one more logit in the softmax (log2 units here), with no value behind it.
    const float lh =
        __fadd_rn(l[h], sinks ? exp2f(__fsub_rn(
                                   __fmul_rn(__bfloat162float(sinks[hk * G + row % G]), log2e), m[h]))
                             : 0.f);
    const float inv = lh > 0.f ? 1.f / lh : 0.f;
    bf16* dst = out + qrow * D;
#pragma unroll
    for (int n = 0; n < DN; n++) {
      *reinterpret_cast<__nv_bfloat162*>(dst + n * 8 + (lane % 4) * 2) =
          __floats2bfloat162_rn(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
  }
}

#define ATTENTION_MMA(D, NAME, KV)                                                               \
  extern "C" __global__ void __launch_bounds__(MMA_THREADS) paged_attention_mma_d##D##_##NAME(  \
      const bf16* q, const void* kc, const void* vc, const float* ksc, const float* vsc,       \
      const uint32_t* cu_q, const uint32_t* seq_k, const uint32_t* tables, int max_blocks,     \
      int num_seqs, int H, int Hkv, int block_size, float scale, int window, float softcap,    \
      const bf16* sinks, int splits, int split_keys, bf16* out, float* part_acc,               \
      float* part_ml) {                                                                        \
    wait_for_previous_kernel();                                                                  \
    attention_tile_mma<D, KV>(q, kc, vc, ksc, vsc, cu_q, seq_k, tables, max_blocks, num_seqs, H, \
                              Hkv, block_size, scale, window, softcap, sinks, splits,           \
                              split_keys, out, part_acc, part_ml);                              \
  }
#define ATTENTION_MMA_ALL(D)          \
  ATTENTION_MMA(D, bf16, Kv::Bf16)    \
  ATTENTION_MMA(D, fp8, Kv::Fp8)      \
  ATTENTION_MMA(D, int8, Kv::Int8)
ATTENTION_MMA_ALL(32)
ATTENTION_MMA_ALL(64)
ATTENTION_MMA_ALL(128)
ATTENTION_MMA_ALL(256)

