#pragma once
#include "common.cuh"

// Splits one token's fused QKV row, adds the bias, applies the per-head Q/K RMSNorm (Qwen3),
// rotates Q and K, writes Q to `q_out [T, H, D]` and K/V into the cache at the token's slot:
// bf16, or (`KV` 8-bit) codes with one scale per token and KV head, `[blocks, Hkv, block_size]`
// (`amax / 448` for fp8 e4m3, `amax / 127` for int8, as the CPU backend stores them).
// Grid: (T, head groups); a warp per head, so a decode's few tokens still spread over many
// warps (a block per token walking all heads was a chain of dependent loads per warp);
// dynamic shared memory: D floats per warp.
template <Kv KV>
__device__ void qkv_rope_write(
    const bf16* qkv, const bf16* bias, const bf16* q_norm, const bf16* k_norm, float eps,
    const uint32_t* positions, const float* cos_t, const float* sin_t, const uint32_t* slots,
    bf16* q_out, void* k_cache, void* v_cache, float* k_scales, float* v_scales, int H, int Hkv,
    int D, int rope_dim, int neox, int block_size) {
  extern __shared__ float sh[];
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
  wait_for_previous_kernel();
  size_t t = blockIdx.x;
  const bf16* row = qkv + t * (size_t)(H + 2 * Hkv) * D;
  int pos = positions[t], half = rope_dim / 2;
  size_t slot = slots[t], blk = slot / block_size, off = slot % block_size;
  float* v = sh + warp * D;
  float kept[8];  // an 8-bit K/V head's values, D <= 256 over 32 lanes
  for (int h = blockIdx.y * nwarps + warp; h < H + 2 * Hkv; h += gridDim.y * nwarps) {
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
      if (is_q) {
        q_out[(t * H + h) * D + d] = __float2bfloat16(r);
      } else if (KV == Kv::Bf16) {
        int hk = is_k ? h - H : h - H - Hkv;
        size_t at = ((blk * Hkv + hk) * block_size + off) * D + d;
        static_cast<bf16*>(is_k ? k_cache : v_cache)[at] = __float2bfloat16(r);
      } else {
        kept[d / 32] = r;
      }
    }
    if (KV != Kv::Bf16 && !is_q) {
      // The head's scale from its largest value, then its codes.
      int hk = is_k ? h - H : h - H - Hkv;
      size_t row = (blk * Hkv + hk) * block_size + off;
      float amax = 0.f;
      for (int d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(kept[d / 32]));
      amax = warp_max(amax);
      float s = amax / (KV == Kv::Fp8 ? 448.f : 127.f);
      if (lane == 0) (is_k ? k_scales : v_scales)[row] = s;
      uint8_t* codes = static_cast<uint8_t*>(is_k ? k_cache : v_cache) + row * D;
      for (int d = lane; d < D; d += 32) codes[d] = kv_encode<KV>(kept[d / 32], s);
    }
    __syncwarp();
  }
}

#define QKV_ROPE_WRITE(NAME, KV)                                                                \
  extern "C" __global__ void NAME(                                                              \
      const bf16* qkv, const bf16* bias, const bf16* q_norm, const bf16* k_norm, float eps,     \
      const uint32_t* positions, const float* cos_t, const float* sin_t, const uint32_t* slots, \
      bf16* q_out, void* k_cache, void* v_cache, float* k_scales, float* v_scales, int H,       \
      int Hkv, int D, int rope_dim, int neox, int block_size) {                                 \
    qkv_rope_write<KV>(qkv, bias, q_norm, k_norm, eps, positions, cos_t, sin_t, slots, q_out,   \
                       k_cache, v_cache, k_scales, v_scales, H, Hkv, D, rope_dim, neox,         \
                       block_size);                                                             \
  }
QKV_ROPE_WRITE(qkv_rope_write_bf16, Kv::Bf16)
QKV_ROPE_WRITE(qkv_rope_write_fp8, Kv::Fp8)
QKV_ROPE_WRITE(qkv_rope_write_int8, Kv::Int8)
