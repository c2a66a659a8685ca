//! Intel AMX tiles (Sapphire Rapids and later) for the int8 matmul.
//!
//! Weights lie in panels of 16 rows ([`Layout::Panels`]): per block, 8 groups of 16 rows x 4
//! codes, the order of an AMX `B` tile and of a `vpdpbusd` whose lanes are the 16 rows. One
//! tile product of 16 tokens' activation codes (`A`, signed, read in place) and a panel's
//! block gives all 256 (token, row) dots of that block exactly in int32; below
//! [`TILE_MIN_TOKENS`] tokens, 8 `vpdpbusd`s against the token's broadcast codes give the same
//! 16 dots. AVX-512 then scales them and accumulates block after block, lanes = rows. Each
//! (token, row) result is the same f32 sequence on either path, so a token's output does not
//! depend on what shares the step.

// Tiles index accumulators and token rows by the same position; range loops say so plainly.
#![allow(clippy::needless_range_loop)]

use super::activations::QuantizedActs;
use super::packed::{Codes, Layout, PackedWeight, BLOCK, PANEL_ROWS};
use super::tile::Out;
use crate::backend::Rounding;
use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

/// Weight rows per panel (the B tile's 16 int32 columns).
const PANEL: usize = PANEL_ROWS;
/// Tokens per tile (the A tile's rows); the activation codes are padded to a multiple.
const TOKENS: usize = 16;
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
    /// A `U4` panel's codes unpacked to one byte each, `[blocks][8][16 rows][4]`.
    static UNPACKED: RefCell<Vec<u8>> = RefCell::default();
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

/// Below this many tokens a matmul takes [`columns`]: the tile's fixed cost (and a `U4`
/// panel's unpacking) pay off only over enough tokens (measured by `examples/qgemm_speed`).
const TILE_MIN_TOKENS: usize = 8;

/// `out[t, r] = sum_k a[t, k] * w[r, k]` for weight rows `rows` (whole panels but the last)
/// and every token.
pub(super) fn matmul_rows(
    w: &PackedWeight,
    a: &QuantizedActs,
    rows: std::ops::Range<usize>,
    out: Out,
) {
    assert_eq!(w.layout, Layout::Panels, "AMX kernels read panels");
    let tiles = a.rows >= TILE_MIN_TOKENS;
    if tiles {
        configure();
    }
    let fine = a.rounding == Rounding::Fine;
    UNPACKED.with_borrow_mut(|unpacked| {
        for r0 in rows.clone().step_by(PANEL) {
            let nr = PANEL.min(rows.end - r0);
            let panel = r0 / PANEL;
            // SAFETY: the CPU has AVX-512 and AMX (`Isa::Amx` is supported), tiles are
            // configured, the panel exists and the codes are padded to whole tiles.
            unsafe {
                if !tiles {
                    match (w.codes, fine) {
                        (Codes::U4, false) => columns::<true, false>(w, a, panel, nr, out),
                        (Codes::U4, true) => columns::<true, true>(w, a, panel, nr, out),
                        (Codes::U8, false) => columns::<false, false>(w, a, panel, nr, out),
                        (Codes::U8, true) => columns::<false, true>(w, a, panel, nr, out),
                    }
                    continue;
                }
                let b_tiles = match w.codes {
                    Codes::U4 => {
                        unpack(w, panel, unpacked);
                        unpacked.as_ptr()
                    }
                    Codes::U8 => w.data.as_ptr().add(panel * w.blocks * B_TILE),
                };
                for t0 in (0..a.rows).step_by(TOKENS) {
                    let nt = TOKENS.min(a.rows - t0);
                    let at = (t0, nt, panel, nr);
                    match (w.codes, fine) {
                        (Codes::U4, false) => tile::<true, false>(w, b_tiles, a, at, out),
                        (Codes::U4, true) => tile::<true, true>(w, b_tiles, a, at, out),
                        (Codes::U8, false) => tile::<false, false>(w, b_tiles, a, at, out),
                        (Codes::U8, true) => tile::<false, true>(w, b_tiles, a, at, out),
                    }
                }
            }
        }
    });
    if tiles {
        release();
    }
}

/// A `U4` panel's codes one byte each: a pair's 512 bytes hold block `2q` in the low nibbles
/// and `2q + 1` in the high ones.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn unpack(w: &PackedWeight, panel: usize, out: &mut Vec<u8>) {
    let nb = w.blocks;
    out.resize(nb * B_TILE, 0);
    let src = w.data.as_ptr().add(panel * (nb / 2) * B_TILE) as *const __m512i;
    let dst = out.as_mut_ptr() as *mut __m512i;
    let nibble = _mm512_set1_epi8(0x0F);
    for q in 0..nb / 2 {
        for k4 in 0..8 {
            let x = _mm512_loadu_si512(src.add(q * 8 + k4));
            _mm512_storeu_si512(dst.add(2 * q * 8 + k4), _mm512_and_si512(x, nibble));
            let hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), nibble);
            _mm512_storeu_si512(dst.add((2 * q + 1) * 8 + k4), hi);
        }
    }
}

/// Block `b`'s scales and (`U4`) offsets of the panel's 16 rows, as f32 lanes.
#[inline(always)]
unsafe fn block_scales<const U4: bool>(
    w: &PackedWeight,
    panel: usize,
    b: usize,
) -> (__m512, __m512) {
    // No closure here: it would not inherit the caller's target features.
    let at = (panel * w.blocks + b) * PANEL;
    let d = _mm512_cvtph_ps(_mm256_loadu_si256(w.d.as_ptr().add(at) as *const _));
    let m = if U4 {
        _mm512_cvtph_ps(_mm256_loadu_si256(w.m.as_ptr().add(at) as *const _))
    } else {
        _mm512_setzero_ps()
    };
    (d, m)
}

/// One block's step for one token, lanes = 16 weight rows: `dot` the exact block dots
/// (corrections included), `ab` the (token, block) index. Both kernels end in it, so their
/// results agree bit for bit.
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

/// Tokens `t0..t0 + nt` times the panel's rows (`at` = (t0, nt, panel, nr)), `b_tiles` the
/// panel's codes one byte each (`[blocks][512]`): per block a tile product, then
/// [`accumulate`] per token.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
unsafe fn tile<const U4: bool, const F: bool>(
    w: &PackedWeight,
    b_tiles: *const u8,
    a: &QuantizedActs,
    (t0, nt, panel, nr): (usize, usize, usize, usize),
    out: Out,
) {
    #[repr(align(64))]
    struct Dots([i32; TOKENS * PANEL]);
    let nb = w.blocks;
    let lda = nb * BLOCK;
    let (mut dq, mut dr) = (Dots([0; TOKENS * PANEL]), Dots([0; TOKENS * PANEL]));
    let mut acc = [_mm512_setzero_ps(); TOKENS];
    for b in 0..nb {
        asm!(
            "tileloadd tmm1, [{a} + {lda}*1]",
            "tileloadd tmm2, [{b} + {ldb}*1]",
            "tilezero tmm0",
            "tdpbsud tmm0, tmm1, tmm2",
            "tilestored [{c} + {ldc}*1], tmm0",
            a = in(reg) a.q.as_ptr().add(t0 * lda + b * BLOCK),
            lda = in(reg) lda,
            b = in(reg) b_tiles.add(b * B_TILE),
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
        let (dw, mw) = block_scales::<U4>(w, panel, b);
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
    store(&acc[..nt], t0, panel, nr, out);
}

/// Token `t0 + j`'s 16 row results `acc[j]` into the output (the first `nr` of them).
#[inline(always)]
unsafe fn store(acc: &[__m512], t0: usize, panel: usize, nr: usize, out: Out) {
    let lanes: __mmask16 = if nr == PANEL { 0xFFFF } else { (1 << nr) - 1 };
    for (j, acc) in acc.iter().enumerate() {
        let row = out.row(t0 + j, panel * PANEL, nr);
        _mm512_mask_storeu_ps(row.as_mut_ptr(), lanes, *acc);
    }
}

/// The 16 rows' exact dots with one block of a token's codes `x` (`[32]`): `codes[k4]` holds
/// the rows' codes `4 k4 .. 4 k4 + 4`, each multiplied by the same 4 broadcast codes.
#[inline(always)]
unsafe fn block_dot(codes: &[__m512i; 8], x: *const i8) -> __m512i {
    let x = x as *const i32;
    // Two chains: `vpdpbusd`'s latency, not its throughput, would bound one.
    let (mut even, mut odd) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for k in (0..8).step_by(2) {
        even = _mm512_dpbusd_epi32(even, codes[k], _mm512_set1_epi32(x.add(k).read_unaligned()));
        odd = _mm512_dpbusd_epi32(
            odd,
            codes[k + 1],
            _mm512_set1_epi32(x.add(k + 1).read_unaligned()),
        );
    }
    _mm512_add_epi32(even, odd)
}

/// Every token (fewer than [`TILE_MIN_TOKENS`]) times the panel's rows by `vpdpbusd`, lanes
/// = rows, then the same [`accumulate`] as [`tile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn columns<const U4: bool, const F: bool>(
    w: &PackedWeight,
    a: &QuantizedActs,
    panel: usize,
    nr: usize,
    out: Out,
) {
    const MAX: usize = TILE_MIN_TOKENS;
    let nt = a.rows;
    assert!(nt < MAX, "{nt} tokens take the tiles");
    let nb = w.blocks;
    let lda = nb * BLOCK;
    let nibble = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); MAX];
    // One slot (`U4`: a pair of blocks, `U8`: a block) of the panel at a time.
    let slots = if U4 { nb / 2 } else { nb };
    let src = w.data.as_ptr().add(panel * slots * B_TILE) as *const __m512i;
    let mut block = |b: usize, codes: &[__m512i; 8]| {
        let (dw, mw) = block_scales::<U4>(w, panel, b);
        for t in 0..nt {
            let at = t * lda + b * BLOCK;
            let mut dot = block_dot(codes, a.q.as_ptr().add(at));
            if F {
                let fine = block_dot(codes, a.r.as_ptr().add(at));
                dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), fine);
            }
            let ab = t * nb + b;
            let dot = _mm512_add_epi32(dot, _mm512_set1_epi32(correction::<U4, F>(a, ab)));
            acc[t] = accumulate::<U4>(acc[t], dot, dw, mw, a, ab);
        }
    };
    for s in 0..slots {
        let raw: [__m512i; 8] = std::array::from_fn(|k4| _mm512_loadu_si512(src.add(s * 8 + k4)));
        if U4 {
            block(2 * s, &raw.map(|x| _mm512_and_si512(x, nibble)));
            block(
                2 * s + 1,
                &raw.map(|x| _mm512_and_si512(_mm512_srli_epi16(x, 4), nibble)),
            );
        } else {
            block(s, &raw);
        }
    }
    store(&acc[..nt], 0, panel, nr, out);
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
