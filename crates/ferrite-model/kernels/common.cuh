// Helpers every kernel file uses: warp and block reductions, bf16 packing.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

// Programmatic dependent launch (sm_90): a kernel launched "chained" (`Kernels::launch_chained`)
// may start while the kernel before it in the stream still runs, so its launch and whatever it
// reads that no earlier kernel writes (weights) overlap that kernel's tail. It must call this
// before reading or writing anything an earlier kernel touches; it returns once the earlier
// kernel has finished and its writes are visible. A no-op on older GPUs (launched unchained).
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

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

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}


__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// How the KV pages store a value: bf16, or an 8-bit code times a scale per token and KV head.
enum class Kv { Bf16, Fp8, Int8 };

// `x / s` as a code: e4m3 rounded to nearest even, saturating at 448, or int8 rounded to
// nearest even; 0 for a head of zeros (s = 0).
template <Kv KV>
__device__ __forceinline__ uint8_t kv_encode(float x, float s) {
  if (s == 0.f) return 0;
  if (KV == Kv::Fp8) return __nv_cvt_float_to_fp8(x / s, __NV_SATFINITE, __NV_E4M3);
  return (uint8_t)(int8_t)max(-127, min(127, __float2int_rn(x / s)));
}

// A code's value before its scale: e4m3 through the f16 whose exponent and mantissa it fills
// (value / 256), as the CPU widens it; int8 as it is.
template <Kv KV>
__device__ __forceinline__ float kv_decode(uint8_t c) {
  if (KV == Kv::Fp8) {
    unsigned short bits = (unsigned short)(((c & 0x80) << 8) | ((c & 0x7F) << 7));
    return __half2float(__ushort_as_half(bits)) * 256.f;
  }
  return (float)(int8_t)c;
}
