//! The paged KV cache: one K and one V buffer per layer, allocated once at start-up and
//! never resized. A block keeps each KV head's slice contiguous: V `[num_blocks, kv_heads,
//! block_size, head_dim]`, K transposed `[num_blocks, kv_heads, head_dim, block_size]` so
//! attention reads a block's keys for one dimension as one vector.
//!
//! Values are f16 by default (half the bytes decode reads of f32), or bf16, or 8-bit codes
//! (`--kv-cache-dtype fp8|int8`) with one f32 scale per token and head, `[num_blocks,
//! kv_heads, block_size]`: attention widens each block it reads to f32 once
//! ([`Pages::widen_k`], [`Pages::widen_v`]).

use super::quant::Isa;
use super::resident::resident_zeros;
use crate::kv_dtype::KvCacheDtype;
use float8::F8E4M3;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl CacheShape {
    /// Elements of one token's K (or V) row.
    pub fn row(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// One layer's K or V values in the layout above.
pub enum Pages {
    /// Exact (`--kv-cache-dtype float32`, the CPU's exact path with f32 weights).
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    /// e4m3 codes and their scales (`x = scale * e4m3(code)`).
    Fp8 {
        codes: Vec<u8>,
        scales: Vec<f32>,
    },
    /// int8 codes and their scales (`x = scale * code`).
    Int8 {
        codes: Vec<i8>,
        scales: Vec<f32>,
    },
}

/// The largest e4m3 magnitude (the scale maps a head's largest value onto it).
const FP8_MAX: f32 = 448.0;

impl Pages {
    /// Zeros for `n` values of `head_dim`-wide heads (and their scales), resident from
    /// start-up on.
    pub fn zeros(dtype: KvCacheDtype, n: usize, head_dim: usize) -> Self {
        let scales = || resident_zeros::<f32>(n / head_dim);
        match dtype {
            KvCacheDtype::Fp32 => Pages::F32(resident_zeros(n)),
            KvCacheDtype::Auto | KvCacheDtype::Fp16 => Pages::F16(resident_zeros(n)),
            KvCacheDtype::Bf16 => Pages::Bf16(resident_zeros(n)),
            KvCacheDtype::Fp8 => Pages::Fp8 {
                codes: resident_zeros(n),
                scales: scales(),
            },
            KvCacheDtype::Int8 => Pages::Int8 {
                codes: resident_zeros(n),
                scales: scales(),
            },
        }
    }

    pub fn dtype(&self) -> KvCacheDtype {
        match self {
            Pages::F32(_) => KvCacheDtype::Fp32,
            Pages::F16(_) => KvCacheDtype::Fp16,
            Pages::Bf16(_) => KvCacheDtype::Bf16,
            Pages::Fp8 { .. } => KvCacheDtype::Fp8,
            Pages::Int8 { .. } => KvCacheDtype::Int8,
        }
    }

    /// Stores `x` (one token's values of one head) at elements `at, at + stride, ...`, its
    /// scale (8-bit types) at `scale_at`.
    fn store(&mut self, x: &[f32], at: usize, stride: usize, scale_at: usize) {
        let put = |i: usize| at + i * stride;
        match self {
            Pages::F32(v) => x.iter().enumerate().for_each(|(i, &x)| v[put(i)] = x),
            Pages::F16(v) => x
                .iter()
                .enumerate()
                .for_each(|(i, &x)| v[put(i)] = f16::from_f32(x)),
            Pages::Bf16(v) => x
                .iter()
                .enumerate()
                .for_each(|(i, &x)| v[put(i)] = bf16::from_f32(x)),
            Pages::Fp8 { codes, scales } => {
                let scale = amax(x) / FP8_MAX;
                scales[scale_at] = scale;
                for (i, &x) in x.iter().enumerate() {
                    codes[put(i)] = match scale {
                        0.0 => 0,
                        s => F8E4M3::from_f32(x / s).to_bits(),
                    };
                }
            }
            Pages::Int8 { codes, scales } => {
                let scale = amax(x) / 127.0;
                scales[scale_at] = scale;
                for (i, &x) in x.iter().enumerate() {
                    codes[put(i)] = match scale {
                        0.0 => 0,
                        s => (x / s).round_ties_even().clamp(-127.0, 127.0) as i8,
                    };
                }
            }
        }
    }

    /// The (block, head) slice `head` (`block * kv_heads + h`) of K, `[d, bs]` (head_dim,
    /// block_size), in f32 into `dst`, through the kernels of `isa`.
    pub fn widen_k(&self, head: usize, d: usize, bs: usize, dst: &mut [f32], isa: Isa) {
        self.widen(head, d, bs, Side::K, dst, isa)
    }

    /// The (block, head) slice `head` of V, `[bs, d]`, in f32 into `dst`.
    pub fn widen_v(&self, head: usize, d: usize, bs: usize, dst: &mut [f32], isa: Isa) {
        self.widen(head, d, bs, Side::V, dst, isa)
    }

    fn widen(&self, head: usize, d: usize, bs: usize, side: Side, dst: &mut [f32], isa: Isa) {
        let n = d * bs;
        let (at, sc) = (head * n, head * bs);
        assert_eq!(dst.len(), n);
        // 16 values per instruction where the CPU has AVX-512, 8 with NEON: half's slice
        // conversion goes 8 at a time through a feature check per chunk (one value at a
        // time on Arm), most of a decode's attention time.
        match self {
            // SAFETY (all): the CPU has the set's features (`isa` is supported); the
            // lengths are equal.
            #[cfg(target_arch = "x86_64")]
            Pages::F16(v) if isa.vector() == Isa::Avx512Vnni => unsafe {
                avx512::widen_f16(&v[at..][..n], dst)
            },
            #[cfg(target_arch = "x86_64")]
            Pages::Bf16(v) if isa.vector() == Isa::Avx512Vnni => unsafe {
                avx512::widen_bf16(&v[at..][..n], dst)
            },
            #[cfg(target_arch = "aarch64")]
            Pages::F16(v) if isa.vector() == Isa::Neon => unsafe {
                neon::widen_f16(&v[at..][..n], dst)
            },
            #[cfg(target_arch = "aarch64")]
            Pages::Bf16(v) if isa.vector() == Isa::Neon => unsafe {
                neon::widen_bf16(&v[at..][..n], dst)
            },
            Pages::F32(v) => dst.copy_from_slice(&v[at..][..n]),
            Pages::F16(v) => v[at..][..n].convert_to_f32_slice(dst),
            Pages::Bf16(v) => v[at..][..n].convert_to_f32_slice(dst),
            Pages::Fp8 { codes, scales } => widen_scaled(
                &codes[at..][..n],
                &scales[sc..][..bs],
                side,
                d,
                bs,
                dst,
                isa,
            ),
            Pages::Int8 { codes, scales } => widen_scaled(
                &codes[at..][..n],
                &scales[sc..][..bs],
                side,
                d,
                bs,
                dst,
                isa,
            ),
        }
    }

    /// Asks for slice `head` (values and scales) to be brought into the cache.
    pub fn prefetch(&self, head: usize, d: usize, bs: usize) {
        let n = d * bs;
        match self {
            Pages::F32(v) => prefetch(&v[head * n..][..n]),
            Pages::F16(v) => prefetch(&v[head * n..][..n]),
            Pages::Bf16(v) => prefetch(&v[head * n..][..n]),
            Pages::Fp8 { codes, .. } => prefetch(&codes[head * n..][..n]),
            Pages::Int8 { codes, .. } => prefetch(&codes[head * n..][..n]),
        }
    }
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// One layer's K and V pages (the layout above), allocated once at start-up.
pub struct LayerCache {
    pub k: Pages,
    pub v: Pages,
    pub shape: CacheShape,
}

impl LayerCache {
    pub fn new(shape: CacheShape, dtype: KvCacheDtype) -> Self {
        let n = shape.num_blocks * shape.block_size * shape.row();
        Self {
            k: Pages::zeros(dtype, n, shape.head_dim),
            v: Pages::zeros(dtype, n, shape.head_dim),
            shape,
        }
    }

    /// Writes each new token's K/V row (`[T, kv_heads * head_dim]`) into its slot.
    pub fn write(&mut self, k: &[f32], v: &[f32], slot_mapping: &[u32]) {
        let shape = self.shape;
        let (row, d, bs) = (shape.row(), shape.head_dim, shape.block_size);
        for ((k, v), &slot) in k
            .chunks_exact(row)
            .zip(v.chunks_exact(row))
            .zip(slot_mapping)
        {
            let (blk, j) = (slot as usize / bs, slot as usize % bs);
            for (h, (k, v)) in k.chunks_exact(d).zip(v.chunks_exact(d)).enumerate() {
                let head = blk * shape.num_kv_heads + h;
                let scale_at = head * bs + j;
                // K transposed (dimension-major), V token-major.
                self.k.store(k, head * d * bs + j, bs, scale_at);
                self.v.store(v, head * d * bs + j * d, 1, scale_at);
            }
        }
    }
}

/// Asks for `data` to be brought into the cache, a line at a time.
#[inline(always)]
fn prefetch<T>(data: &[T]) {
    for line in data.chunks((64 / std::mem::size_of::<T>()).max(1)) {
        // SAFETY: a prefetch hint on a valid address; it never faults.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(line.as_ptr() as *const i8);
        }
        // SAFETY: as above.
        #[cfg(target_arch = "aarch64")]
        unsafe {
            crate::backend::cpu::quant::neon::prefetch(line.as_ptr() as *const u8)
        };
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        let _ = line;
    }
}

/// e4m3 code as the f16 bits of its value / 256: the 4-bit exponent and 3-bit mantissa
/// slot into f16's (bias 15 against 7), subnormals included.
#[inline(always)]
fn fp8_as_f16_bits(c: u8) -> u16 {
    (((c & 0x80) as u16) << 8) | (((c & 0x7F) as u16) << 7)
}

/// Which slice a widening writes: K `[d, bs]` (a scale per column, the token) or V `[bs, d]`
/// (a scale per row).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    K,
    V,
}

/// An 8-bit code's value before its scale.
trait Code: Copy {
    fn value(self) -> f32;
}

/// [`Code`] with the 16-lane loads where the CPU kernels have them.
#[cfg(target_arch = "x86_64")]
use avx512::Lanes;
#[cfg(not(target_arch = "x86_64"))]
use Code as Lanes;

impl Code for u8 {
    /// e4m3: exactly `F8E4M3::to_f32` (the f16 of value / 256, times 256).
    #[inline(always)]
    fn value(self) -> f32 {
        f16::from_bits(fp8_as_f16_bits(self)).to_f32() * 256.0
    }
}

impl Code for i8 {
    #[inline(always)]
    fn value(self) -> f32 {
        self as f32
    }
}

/// `dst = value(code) * scale` of its token, 16 lanes at a time where the CPU has AVX-512
/// (K of 16-token blocks, V of heads a multiple of 16 wide), else one by one; the same
/// product either way.
fn widen_scaled<C: Lanes>(
    codes: &[C],
    scales: &[f32],
    side: Side,
    d: usize,
    bs: usize,
    dst: &mut [f32],
    isa: Isa,
) {
    assert!(codes.len() == d * bs && dst.len() == d * bs && scales.len() == bs);
    #[cfg(target_arch = "x86_64")]
    if isa.vector() == Isa::Avx512Vnni && avx512::widen_scaled(codes, scales, side, d, bs, dst) {
        return;
    }
    let _ = isa;
    match side {
        Side::K => {
            for (row, c) in dst.chunks_exact_mut(bs).zip(codes.chunks_exact(bs)) {
                for ((x, &c), &s) in row.iter_mut().zip(c).zip(scales) {
                    *x = c.value() * s;
                }
            }
        }
        Side::V => {
            for ((row, c), &s) in dst
                .chunks_exact_mut(d)
                .zip(codes.chunks_exact(d))
                .zip(scales)
            {
                row.iter_mut().zip(c).for_each(|(x, &c)| *x = c.value() * s);
            }
        }
    }
}

/// f16 and bf16 pages widened 8 values at a time (`fcvtl` is base Armv8; bf16 is a shift).
#[cfg(target_arch = "aarch64")]
mod neon {
    use crate::backend::cpu::quant::neon::widen4;
    use half::f16;
    use half::slice::HalfFloatSliceExt;
    use std::arch::aarch64::*;

    pub(super) unsafe fn widen_f16(src: &[f16], dst: &mut [f32]) {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let h = vld1q_u16(src.as_ptr().add(i) as *const u16);
            vst1q_f32(dst.as_mut_ptr().add(i), widen4(vget_low_u16(h)));
            vst1q_f32(dst.as_mut_ptr().add(i + 4), widen4(vget_high_u16(h)));
        }
        src[n..].convert_to_f32_slice(&mut dst[n..]);
    }

    pub(super) unsafe fn widen_bf16(src: &[half::bf16], dst: &mut [f32]) {
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let h = vld1q_u16(src.as_ptr().add(i) as *const u16);
            let lo = vshll_n_u16::<16>(vget_low_u16(h));
            let hi = vshll_high_n_u16::<16>(h);
            vst1q_f32(dst.as_mut_ptr().add(i), vreinterpretq_f32_u32(lo));
            vst1q_f32(dst.as_mut_ptr().add(i + 4), vreinterpretq_f32_u32(hi));
        }
        src[n..].convert_to_f32_slice(&mut dst[n..]);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use half::f16;
    use half::slice::HalfFloatSliceExt;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_f16(src: &[f16], dst: &mut [f32]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
        }
        src[n..].convert_to_f32_slice(&mut dst[n..]);
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_bf16(src: &[half::bf16], dst: &mut [f32]) {
        let n = src.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
            let x = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_castsi512_ps(x));
        }
        src[n..].convert_to_f32_slice(&mut dst[n..]);
    }

    /// 16 codes' values before their scales, as [`super::Code::value`] computes them.
    pub(super) trait Lanes: super::Code {
        unsafe fn load16(p: *const Self) -> __m512;
    }

    impl Lanes for u8 {
        #[inline(always)]
        unsafe fn load16(p: *const u8) -> __m512 {
            let c = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
            let bits = _mm256_or_si256(
                _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8),
                _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7F)), 7),
            );
            _mm512_mul_ps(_mm512_cvtph_ps(bits), _mm512_set1_ps(256.0))
        }
    }

    impl Lanes for i8 {
        #[inline(always)]
        unsafe fn load16(p: *const i8) -> __m512 {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
        }
    }

    /// [`super::widen_scaled`] in 16-lane registers; false (nothing written) for shapes it
    /// does not cover.
    pub(super) fn widen_scaled<C: Lanes>(
        codes: &[C],
        scales: &[f32],
        side: super::Side,
        d: usize,
        bs: usize,
        dst: &mut [f32],
    ) -> bool {
        match side {
            super::Side::K if bs == 16 => {
                // SAFETY: the caller checked AVX-512 (its `isa`); rows of 16 in bounds.
                unsafe { widen_k16(codes, scales, dst) };
                true
            }
            super::Side::V if d.is_multiple_of(16) => {
                // SAFETY: as above; `d` is whole registers.
                unsafe { widen_v(codes, scales, d, dst) };
                true
            }
            _ => false,
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn widen_k16<C: Lanes>(codes: &[C], scales: &[f32], dst: &mut [f32]) {
        let s = _mm512_loadu_ps(scales.as_ptr());
        for i in (0..dst.len()).step_by(16) {
            let x = _mm512_mul_ps(C::load16(codes.as_ptr().add(i)), s);
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), x);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn widen_v<C: Lanes>(codes: &[C], scales: &[f32], d: usize, dst: &mut [f32]) {
        for (j, &sj) in scales.iter().enumerate() {
            let s = _mm512_set1_ps(sj);
            for i in (j * d..(j + 1) * d).step_by(16) {
                let x = _mm512_mul_ps(C::load16(codes.as_ptr().add(i)), s);
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), x);
            }
        }
    }
}
