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

// c[4] += A B on tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate): `a` the A
// fragment (rows lane / 4 and + 8; k pairs 2 (lane % 4) and + 8), b0 / b1 the B fragment.
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared without passing through registers; zero-fills when !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0));
}

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
