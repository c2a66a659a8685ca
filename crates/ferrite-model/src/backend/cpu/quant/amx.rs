//! Intel AMX tiles (Sapphire Rapids and later) for the int8 matmul.
//!
//! Weights lie in panels of 16 rows ([`Layout::Panels`]): per block, 8 groups of 16 rows x 4
//! codes, the order of an AMX `B` tile and of a `vpdpbusd` whose lanes are the 16 rows. One
//! tile product of 16 tokens' activation codes (`A`, signed, read in place) and a panel's
//! block gives all 256 (token, row) dots of that block exactly in int32; below
//! [`TILE_MIN_TOKENS`] tokens, the [`columns`] kernels give the same dots by `vpdpbusd`.
//! AVX-512 then scales them and accumulates block after block, lanes = rows. Each
//! (token, row) result is the same f32 sequence on either path, so a token's output does not
//! depend on what shares the step.

// Tiles index accumulators and token rows by the same position; range loops say so plainly.
#![allow(clippy::needless_range_loop)]

use super::activations::QuantizedActs;
use super::columns::{self, accumulate, block_scales, correction, store, PANEL, SLOT};
use super::packed::{Codes, Layout, PackedWeight, BLOCK};
use super::tile::Out;
use crate::backend::Rounding;
use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

/// Tokens per tile (the A tile's rows); the activation codes are padded to a multiple.
const TOKENS: usize = 16;
/// Bytes of one block's B tile: 8 rows of 16 weight rows x 4 codes (a panel's slot).
const B_TILE: usize = SLOT;

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

/// Loads the matmul's tile shapes on this thread: tmm0/tmm3 (even blocks) and tmm5/tmm6 (odd
/// blocks) the int32 results (16 tokens x 16 rows) of the codes and of their fine residuals,
/// tmm1/tmm4 the activation codes and residuals (16 tokens x 32), tmm2 the weight panel (8 x
/// 16 rows x 4 codes). Tiles are released after each use, so no thread holds tile state (8 KiB
/// more for every context switch to save) between matmuls.
fn configure() {
    TileConfig::new(&[
        (16, 64),
        (16, 32),
        (8, 64),
        (16, 64),
        (16, 32),
        (16, 64),
        (16, 64),
    ])
    .load();
}

fn release() {
    // SAFETY: `configure` ran on this thread.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Below this many tokens a matmul takes [`columns`]: the tiles' stores and reloads (and a
/// `U4` panel's unpacking) pay off only over enough tokens (`examples/qgemm_speed`, 3072 x 576:
/// 24 tokens 0.130 ms by columns, 0.156 ms by tiles; 32 tokens 0.171 and 0.168).
const TILE_MIN_TOKENS: usize = 32;

/// `out[t, r] = sum_k a[t, k] * w[r, k]` for weight rows `rows` (whole panels but the last)
/// and every token.
pub(super) fn matmul_rows(
    w: &PackedWeight,
    a: &QuantizedActs,
    rows: std::ops::Range<usize>,
    out: Out,
) {
    assert_eq!(w.layout, Layout::Panels, "AMX kernels read panels");
    if a.rows < TILE_MIN_TOKENS {
        return columns::matmul_rows(w, a, rows, out);
    }
    configure();
    let fine = a.rounding == Rounding::Fine;
    UNPACKED.with_borrow_mut(|unpacked| {
        for r0 in rows.clone().step_by(PANEL) {
            let nr = PANEL.min(rows.end - r0);
            let panel = r0 / PANEL;
            // SAFETY: the CPU has AVX-512 and AMX (`Isa::Amx` is supported), tiles are
            // configured, the panel exists and the codes are padded to whole tiles.
            unsafe {
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
    release();
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

/// Block `b`'s tile products for tokens from `t0` stored into `dq` (and `dr`, fine): into
/// result tiles tmm0/tmm3 for even blocks, tmm5/tmm6 for odd ones, so a block's products are
/// under way while the one before is scaled.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn products<const F: bool>(
    b: usize,
    a: &QuantizedActs,
    t0: usize,
    lda: usize,
    b_tiles: *const u8,
    dq: *mut i32,
    dr: *mut i32,
) {
    macro_rules! product {
        ($q:literal, $r:literal) => {{
            asm!(
                "tileloadd tmm1, [{a} + {lda}*1]",
                "tileloadd tmm2, [{b} + {ldb}*1]",
                concat!("tilezero ", $q),
                concat!("tdpbsud ", $q, ", tmm1, tmm2"),
                concat!("tilestored [{c} + {ldc}*1], ", $q),
                a = in(reg) a.q.as_ptr().add(t0 * lda + b * BLOCK),
                lda = in(reg) lda,
                b = in(reg) b_tiles.add(b * B_TILE),
                ldb = in(reg) 64usize,
                c = in(reg) dq,
                ldc = in(reg) 64usize,
                options(nostack),
            );
            if F {
                asm!(
                    "tileloadd tmm4, [{a} + {lda}*1]",
                    concat!("tilezero ", $r),
                    concat!("tdpbsud ", $r, ", tmm4, tmm2"),
                    concat!("tilestored [{c} + {ldc}*1], ", $r),
                    a = in(reg) a.r.as_ptr().add(t0 * lda + b * BLOCK),
                    lda = in(reg) lda,
                    c = in(reg) dr,
                    ldc = in(reg) 64usize,
                    options(nostack),
                );
            }
        }};
    }
    if b.is_multiple_of(2) {
        product!("tmm0", "tmm3");
    } else {
        product!("tmm5", "tmm6");
    }
}

/// Tokens `t0..t0 + nt` times the panel's rows (`at` = (t0, nt, panel, nr)), `b_tiles` the
/// panel's codes one byte each (`[blocks][512]`): per block a tile product, then
/// [`accumulate`] per token, the next block's product issued before this one is scaled.
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
    // Two of each: block b's products land in [b % 2].
    let mut dq = [Dots([0; TOKENS * PANEL]), Dots([0; TOKENS * PANEL])];
    let mut dr = [Dots([0; TOKENS * PANEL]), Dots([0; TOKENS * PANEL])];
    let mut acc = [_mm512_setzero_ps(); TOKENS];
    let issue = |b: usize, dq: &mut [Dots; 2], dr: &mut [Dots; 2]| {
        let (q, r) = (dq[b % 2].0.as_mut_ptr(), dr[b % 2].0.as_mut_ptr());
        products::<F>(b, a, t0, lda, b_tiles, q, r);
    };
    issue(0, &mut dq, &mut dr);
    for b in 0..nb {
        if b + 1 < nb {
            issue(b + 1, &mut dq, &mut dr);
        }
        let (q, r) = (&dq[b % 2].0, &dr[b % 2].0);
        let (dw, mw) = block_scales::<U4>(w, panel, b);
        // All 16 rows of the tile, padding included (the activations are padded to whole
        // tiles): a loop of fixed length keeps the accumulators in registers.
        for j in 0..TOKENS {
            let ab = (t0 + j) * nb + b;
            let mut dot = _mm512_load_si512(q.as_ptr().add(j * PANEL) as *const _);
            if F {
                let fine = _mm512_load_si512(r.as_ptr().add(j * PANEL) as *const _);
                dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), fine);
            }
            let dot = _mm512_add_epi32(dot, _mm512_set1_epi32(correction::<U4, F>(a, ab)));
            acc[j] = accumulate::<U4>(acc[j], dot, dw, mw, a, ab);
        }
    }
    store(&acc[..nt], t0, panel, nr, out);
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
