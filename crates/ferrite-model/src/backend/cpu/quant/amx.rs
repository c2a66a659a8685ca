//! Intel AMX tiles (Sapphire Rapids and later) for the int8 matmul.
//!
//! One tile product of 16 tokens' activation codes (`A`, signed, read in place from the
//! quantized rows) and a 16-row weight panel (`B`, unsigned codes in the 4-byte interleaved
//! order the tile unit reads, repacked per task) gives all 256 (token, row) dots of one block
//! of 32 exactly in int32. AVX-512 then scales them and accumulates block after block, lanes
//! = weight rows. Each (token, row) result is the same f32 sequence whatever the tile, so a
//! token's output does not depend on what shares the step.

// Tiles index accumulators and token rows by the same position; range loops say so plainly.
#![allow(clippy::needless_range_loop)]

use super::activations::QuantizedActs;
use super::packed::{Codes, PackedWeight, BLOCK};
use super::tile::Out;
use crate::backend::Rounding;
use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

/// Weight rows per panel (the B tile's 16 int32 columns).
pub(super) const PANEL: usize = 16;
/// Tokens per tile (the A tile's rows); the activation codes are padded to a multiple.
pub const TOKENS: usize = 16;
/// Bytes of one block's B tile: 8 rows of 16 weight rows x 4 codes.
const B_TILE: usize = 512;

/// `arch_prctl` request for the tile data state, and that state's number (Linux).
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
const XFEATURE_XTILEDATA: libc::c_long = 18;

/// True when the CPU has AMX-INT8 and the kernel lets this process use the tiles (asked
/// once; Linux grants tile state per process on request).
pub(super) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // Leaf 7 is read only when reported; EDX bits 24, 25: AMX-TILE, AMX-INT8.
        let amx = __cpuid(0).eax >= 7 && (__cpuid_count(7, 0).edx >> 24) & 0b11 == 0b11;
        // SAFETY: a plain syscall with integer arguments.
        amx && unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    })
}

/// The `ldtilecfg` operand: palette, then each tile's bytes per row and rows.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

thread_local! {
    static SCRATCH: RefCell<Panel> = RefCell::default();
}

impl TileConfig {
    /// Palette 1 with tile `t` shaped `shapes[t]` = (rows, bytes per row).
    fn new(shapes: &[(u8, u16)]) -> Self {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for (t, &(rows, colsb)) in shapes.iter().enumerate() {
            (c.rows[t], c.colsb[t]) = (rows, colsb);
        }
        c
    }

    fn load(&self) {
        // SAFETY: `available` holds (the callers' check); the config is 64 aligned bytes.
        unsafe { asm!("ldtilecfg [{}]", in(reg) self as *const TileConfig, options(nostack)) };
    }
}

/// Loads the matmul's tile shapes on this thread: tmm0/tmm3 the int32 results (16 tokens x
/// 16 rows), tmm1/tmm4 the activation codes and their fine residuals (16 tokens x 32), tmm2
/// the weight panel (8 x 16 rows x 4 codes). Tiles are released after each use, so no
/// thread holds tile state (8 KiB more for every context switch to save) between matmuls.
fn configure() {
    TileConfig::new(&[(16, 64), (16, 32), (8, 64), (16, 64), (16, 32)]).load();
}

fn release() {
    // SAFETY: `configure` ran on this thread.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// One weight panel in the tile unit's order, with its scales (and `U4` offsets) as f32
/// lanes per block.
#[derive(Default)]
struct Panel {
    /// `[blocks][8][16 rows][4 codes]`.
    b: Vec<u8>,
    /// `[blocks][16 rows]`.
    d: Vec<f32>,
    m: Vec<f32>,
}

/// `out[t, r] = sum_k a[t, k] * w[r, k]` for weight rows `rows` (whole panels but the last)
/// and every token.
pub(super) fn matmul_rows(
    w: &PackedWeight,
    a: &QuantizedActs,
    rows: std::ops::Range<usize>,
    out: Out,
) {
    let tiles = a.rows >= TILE_MIN_TOKENS;
    if tiles {
        configure();
    }
    SCRATCH.with_borrow_mut(|p| {
        for r0 in rows.clone().step_by(PANEL) {
            let nr = PANEL.min(rows.end - r0);
            // SAFETY: the CPU has AVX-512 and AMX (`Isa::Amx` is supported), tiles are
            // configured, `r0 + nr <= w.rows` and the codes are padded to whole tiles.
            unsafe {
                let fine = a.rounding == Rounding::Fine;
                if !tiles {
                    match (w.codes, fine) {
                        (Codes::U4, false) => columns::<true, false>(w, a, r0, nr, out),
                        (Codes::U4, true) => columns::<true, true>(w, a, r0, nr, out),
                        (Codes::U8, false) => columns::<false, false>(w, a, r0, nr, out),
                        (Codes::U8, true) => columns::<false, true>(w, a, r0, nr, out),
                    }
                    continue;
                }
                repack(w, r0, nr, p);
                for t0 in (0..a.rows).step_by(TOKENS) {
                    let nt = TOKENS.min(a.rows - t0);
                    match (w.codes, fine) {
                        (Codes::U4, false) => tile::<true, false>(w, p, a, t0, nt, r0, nr, out),
                        (Codes::U4, true) => tile::<true, true>(w, p, a, t0, nt, r0, nr, out),
                        (Codes::U8, false) => tile::<false, false>(w, p, a, t0, nt, r0, nr, out),
                        (Codes::U8, true) => tile::<false, true>(w, p, a, t0, nt, r0, nr, out),
                    }
                }
            }
        }
    });
    if tiles {
        release();
    }
}

/// Lays rows `r0..r0 + nr` of `w` out as B tiles (rows past `nr` zero) with their scales.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn repack(w: &PackedWeight, r0: usize, nr: usize, p: &mut Panel) {
    let nb = w.blocks;
    p.b.resize(nb * B_TILE, 0);
    p.d.resize(nb * PANEL, 0.0);
    p.m.resize(if w.codes == Codes::U4 { nb * PANEL } else { 0 }, 0.0);
    let lanes: __mmask16 = if nr == PANEL { 0xFFFF } else { (1 << nr) - 1 };
    let row_bytes = match w.codes {
        Codes::U4 => nb * 16,
        Codes::U8 => nb * BLOCK,
    };
    let rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(row_bytes as i32),
    );
    let codes = w.data.as_ptr().add(r0 * row_bytes);
    let gather = |at: *const u8| {
        _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), lanes, rows, at as *const i32)
    };
    let dst = p.b.as_mut_ptr() as *mut __m512i;
    match w.codes {
        Codes::U8 => {
            for b in 0..nb {
                for k4 in 0..8 {
                    let g = gather(codes.add(b * BLOCK + k4 * 4));
                    _mm512_storeu_si512(dst.add(b * 8 + k4), g);
                }
            }
        }
        Codes::U4 => {
            // A pair's 32 bytes: block 2q's code j in byte j's low nibble, 2q + 1's high.
            let nibble = _mm512_set1_epi8(0x0F);
            for q in 0..nb / 2 {
                for k4 in 0..8 {
                    let g = gather(codes.add(q * BLOCK + k4 * 4));
                    let lo = _mm512_and_si512(g, nibble);
                    let hi = _mm512_and_si512(_mm512_srli_epi32(g, 4), nibble);
                    _mm512_storeu_si512(dst.add(2 * q * 8 + k4), lo);
                    _mm512_storeu_si512(dst.add((2 * q + 1) * 8 + k4), hi);
                }
            }
        }
    }
    for q in 0..nb / 2 {
        let (even, odd) = pair_scales(w.d.as_ptr(), nb, r0, q, lanes);
        _mm512_storeu_ps(p.d.as_mut_ptr().add(2 * q * PANEL), even);
        _mm512_storeu_ps(p.d.as_mut_ptr().add((2 * q + 1) * PANEL), odd);
        if w.codes == Codes::U4 {
            let (even, odd) = pair_scales(w.m.as_ptr(), nb, r0, q, lanes);
            _mm512_storeu_ps(p.m.as_mut_ptr().add(2 * q * PANEL), even);
            _mm512_storeu_ps(p.m.as_mut_ptr().add((2 * q + 1) * PANEL), odd);
        }
    }
}

/// The f16 values of blocks `2q` and `2q + 1` of rows `r0..r0 + 16` (`[rows, nb]`; lanes
/// outside `lanes` zero) as f32 lanes: both halves of the dword at block `2q`.
#[inline(always)]
unsafe fn pair_scales(
    src: *const half::f16,
    nb: usize,
    r0: usize,
    q: usize,
    lanes: __mmask16,
) -> (__m512, __m512) {
    let rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(2 * nb as i32),
    );
    let g = _mm512_mask_i32gather_epi32::<1>(
        _mm512_setzero_si512(),
        lanes,
        rows,
        src.add(r0 * nb + 2 * q) as *const i32,
    );
    let even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    let odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
    (even, odd)
}

/// One block's step for one token, lanes = 16 weight rows: `dot` the exact block dots
/// (corrections included), `dw`/`mw` the rows' scales/offsets, `ab` the (token, block) index.
/// Both kernels end in it, so their results agree bit for bit.
#[inline(always)]
unsafe fn accumulate<const U4: bool>(
    acc: __m512,
    dot: __m512i,
    dw: __m512,
    mw: __m512,
    a: &QuantizedActs,
    ab: usize,
) -> __m512 {
    let scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[ab]));
    let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    if U4 {
        _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[ab]), acc)
    } else {
        acc
    }
}

/// The integer added to a block's raw dot: `U8` codes stand for `code - 128`.
#[inline(always)]
unsafe fn correction<const U4: bool, const F: bool>(a: &QuantizedActs, ab: usize) -> i32 {
    match (U4, F) {
        (true, _) => 0,
        (false, false) => a.block_corr[ab],
        (false, true) => 256 * a.block_corr[ab] + a.block_corr_r[ab],
    }
}

/// Tokens `t0..t0 + nt` times panel rows `r0..r0 + nr`: per block, tile dots then
/// `acc = fma(dot, d_w * d_a, acc)` (and `acc = fma(m_w, s_a, acc)` for `U4`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const U4: bool, const F: bool>(
    w: &PackedWeight,
    p: &Panel,
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    r0: usize,
    nr: usize,
    out: Out,
) {
    #[repr(align(64))]
    struct Dots([i32; TOKENS * PANEL]);
    let nb = w.blocks;
    let lda = nb * BLOCK;
    let (mut dq, mut dr) = (Dots([0; TOKENS * PANEL]), Dots([0; TOKENS * PANEL]));
    let mut acc = [_mm512_setzero_ps(); TOKENS];
    for b in 0..nb {
        let panel = p.b.as_ptr().add(b * B_TILE);
        let codes = a.q.as_ptr().add(t0 * lda + b * BLOCK);
        asm!(
            "tileloadd tmm1, [{a} + {lda}*1]",
            "tileloadd tmm2, [{b} + {ldb}*1]",
            "tilezero tmm0",
            "tdpbsud tmm0, tmm1, tmm2",
            "tilestored [{c} + {ldc}*1], tmm0",
            a = in(reg) codes,
            lda = in(reg) lda,
            b = in(reg) panel,
            ldb = in(reg) 64usize,
            c = in(reg) dq.0.as_mut_ptr(),
            ldc = in(reg) 64usize,
            options(nostack),
        );
        if F {
            asm!(
                "tileloadd tmm4, [{a} + {lda}*1]",
                "tilezero tmm3",
                "tdpbsud tmm3, tmm4, tmm2",
                "tilestored [{c} + {ldc}*1], tmm3",
                a = in(reg) a.r.as_ptr().add(t0 * lda + b * BLOCK),
                lda = in(reg) lda,
                c = in(reg) dr.0.as_mut_ptr(),
                ldc = in(reg) 64usize,
                options(nostack),
            );
        }
        let dw = _mm512_loadu_ps(p.d.as_ptr().add(b * PANEL));
        let mw = if U4 {
            _mm512_loadu_ps(p.m.as_ptr().add(b * PANEL))
        } else {
            _mm512_setzero_ps()
        };
        for j in 0..TOKENS {
            if j >= nt {
                break;
            }
            let ab = (t0 + j) * nb + b;
            let mut dot = _mm512_load_si512(dq.0.as_ptr().add(j * PANEL) as *const _);
            if F {
                let fine = _mm512_load_si512(dr.0.as_ptr().add(j * PANEL) as *const _);
                dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), fine);
            }
            let dot = _mm512_add_epi32(dot, _mm512_set1_epi32(correction::<U4, F>(a, ab)));
            acc[j] = accumulate::<U4>(acc[j], dot, dw, mw, a, ab);
        }
    }
    let lanes: __mmask16 = if nr == PANEL { 0xFFFF } else { (1 << nr) - 1 };
    for j in 0..nt {
        let row = out.row(t0 + j, r0, nr);
        _mm512_mask_storeu_ps(row.as_mut_ptr(), lanes, acc[j]);
    }
}

/// Below this many tokens a matmul takes [`columns`]: repacking a panel and a tile's fixed
/// cost pay off only over enough tokens (measured by `examples/qgemm_speed`).
const TILE_MIN_TOKENS: usize = 8;

/// `vpdpbusd` of 16 rows' pair of blocks (lanes 0-7 block `2q`, 8-15 block `2q + 1`) summed
/// to whole-block dots: (`2q` for rows 0..16, `2q + 1` for rows 0..16).
#[inline(always)]
unsafe fn block_sums(d: &[__m512i; PANEL]) -> (__m512i, __m512i) {
    // Rows i, i + 1 interleaved: each 128-bit group holds two partial sums of each.
    let x: [__m512i; 8] = std::array::from_fn(|m| {
        let (a, b) = (d[2 * m], d[2 * m + 1]);
        _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
    });
    // Each 128-bit group g holds the group sums of four rows.
    let y: [__m512i; 4] = std::array::from_fn(|n| {
        let (a, b) = (x[2 * n], x[2 * n + 1]);
        _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
    });
    // Groups 0 + 1 are block 2q, 2 + 3 block 2q + 1: [even, odd] of two row quads.
    let u: [__m512i; 2] = std::array::from_fn(|h| {
        let (a, b) = (y[2 * h], y[2 * h + 1]);
        _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0x88>(a, b),
            _mm512_shuffle_i32x4::<0xDD>(a, b),
        )
    });
    (
        _mm512_shuffle_i32x4::<0x88>(u[0], u[1]),
        _mm512_shuffle_i32x4::<0xDD>(u[0], u[1]),
    )
}

/// Every token (fewer than [`TILE_MIN_TOKENS`]) times rows `r0..r0 + nr` by `vpdpbusd` on the weights as they
/// are stored: each pair of blocks' dots summed to whole blocks ([`block_sums`]), then the
/// same [`accumulate`] as [`tile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn columns<const U4: bool, const F: bool>(
    w: &PackedWeight,
    a: &QuantizedActs,
    r0: usize,
    nr: usize,
    out: Out,
) {
    const MAX: usize = TILE_MIN_TOKENS;
    let nt = a.rows;
    assert!(nt < MAX, "{nt} tokens take the tiles");
    let nb = w.blocks;
    let lda = nb * BLOCK;
    let lanes: __mmask16 = if nr == PANEL { 0xFFFF } else { (1 << nr) - 1 };
    let nibble = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); MAX];
    let mut codes = [_mm512_setzero_si512(); PANEL];
    for q in 0..nb / 2 {
        for (i, c) in codes.iter_mut().enumerate().take(nr) {
            let r = r0 + i;
            *c = if U4 {
                let x = _mm256_loadu_si256(w.data.as_ptr().add((r * nb + 2 * q) * 16) as *const _);
                let lo = _mm256_and_si256(x, nibble);
                let hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), nibble);
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
            } else {
                _mm512_loadu_si512(w.data.as_ptr().add((r * nb + 2 * q) * BLOCK) as *const _)
            };
        }
        let (dw0, dw1) = pair_scales(w.d.as_ptr(), nb, r0, q, lanes);
        let (mw0, mw1) = if U4 {
            pair_scales(w.m.as_ptr(), nb, r0, q, lanes)
        } else {
            (_mm512_setzero_ps(), _mm512_setzero_ps())
        };
        for t in 0..nt {
            let at = t * lda + 2 * q * BLOCK;
            let xq = _mm512_loadu_si512(a.q.as_ptr().add(at) as *const _);
            let mut d: [__m512i; PANEL] =
                std::array::from_fn(|i| _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[i], xq));
            if F {
                let xr = _mm512_loadu_si512(a.r.as_ptr().add(at) as *const _);
                for i in 0..PANEL {
                    let fine = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[i], xr);
                    d[i] = _mm512_add_epi32(_mm512_slli_epi32(d[i], 8), fine);
                }
            }
            let (even, odd) = block_sums(&d);
            let (b0, b1) = (t * nb + 2 * q, t * nb + 2 * q + 1);
            let even = _mm512_add_epi32(even, _mm512_set1_epi32(correction::<U4, F>(a, b0)));
            let odd = _mm512_add_epi32(odd, _mm512_set1_epi32(correction::<U4, F>(a, b1)));
            acc[t] = accumulate::<U4>(acc[t], even, dw0, mw0, a, b0);
            acc[t] = accumulate::<U4>(acc[t], odd, dw1, mw1, a, b1);
        }
    }
    for t in 0..nt {
        let row = out.row(t, r0, nr);
        _mm512_mask_storeu_ps(row.as_mut_ptr(), lanes, acc[t]);
    }
}

/// `tdpbusd` products per second on this thread from tiles only, four accumulators, with
/// `k` codes per product (64: the unit's full shape; 32: one block, as [`matmul_rows`]
/// takes them): the ceiling the matmul is measured against. `None` without AMX.
pub fn tile_peak(k: usize, iters: usize) -> Option<f64> {
    if !available() {
        return None;
    }
    assert!(k == 32 || k == 64);
    let k4 = (k / 4) as u8;
    let c = TileConfig::new(&[
        (16, 64),
        (16, 64),
        (16, 64),
        (16, 64),
        (16, k as u16),
        (k4, 64),
    ]);
    let codes = vec![1u8; 16 * 64];
    c.load();
    let start = std::time::Instant::now();
    // SAFETY: AMX is available, tiles configured; the loads read 1 KiB of `codes`.
    unsafe {
        asm!(
            "tileloadd tmm4, [{p} + {s}*1]",
            "tileloadd tmm5, [{p} + {s}*1]",
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tdpbusd tmm0, tmm4, tmm5",
            "tdpbusd tmm1, tmm4, tmm5",
            "tdpbusd tmm2, tmm4, tmm5",
            "tdpbusd tmm3, tmm4, tmm5",
            "dec {n}",
            "jnz 2b",
            p = in(reg) codes.as_ptr(),
            s = in(reg) 64usize,
            n = inout(reg) iters => _,
            options(nostack),
        );
    }
    let secs = start.elapsed().as_secs_f64();
    release();
    Some((iters * 4 * 16 * 16 * k * 2) as f64 / secs)
}
