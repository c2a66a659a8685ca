//! Quantized matmul over the packed `[T, K]` activation matrix: weights repacked at load
//! ([`packed`]), activations quantized to int8 once per input ([`activations`]), then per
//! instruction set ([`isa`]): AMX tiles of 16 x 16 ([`amx`]), `vpdpbusd` with 16 weight rows
//! for lanes ([`columns`]), or register tiles of up to 4 weight rows x 4 tokens (AVX2, the
//! Arm sets of [`neon`], portable).
//!
//! Every (row, token) result is computed by the same instruction sequence whatever the tile
//! shape or thread split, so a token's output does not depend on what shares the step.

pub mod activations;
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod columns;
pub mod isa;
#[cfg(target_arch = "aarch64")]
pub(super) mod neon;
pub mod packed;
mod portable;
mod tile;

use crate::backend::cpu::disjoint::DisjointSlice;
use crate::backend::Rounding;
use activations::QuantizedActs;
#[cfg(target_arch = "x86_64")]
pub use amx::tile_peak;
pub use isa::Isa;
use packed::{Codes, PackedWeight};
use rayon::prelude::*;
use tile::Out;

/// Register tile: weight rows x tokens.
const TILE_ROWS: usize = 4;
const TILE_TOKENS: usize = 4;
/// Weight rows per parallel task: small enough that a decode's matmul splits into many
/// tasks (an idle thread steals them when another process takes a core), large enough
/// that a task's weights stay in L1 while every token tile reads them.
const TASK_ROWS: usize = 32;
// Panel kernels' tasks are whole panels.
const _: () = assert!(TASK_ROWS.is_multiple_of(packed::PANEL_ROWS));

/// Calls `$m::$f::<R, C, F>(args)` for the runtime tile shape `($r, $c)`, both in 1..=4,
/// and `F` true for fine activations.
macro_rules! by_shape {
    ($m:ident::$f:ident, $r:expr, $c:expr, $a:expr, $($arg:expr),*) => {
        match $a.rounding {
            Rounding::Coarse => by_shape!(@ $m::$f, false, $r, $c, $($arg),*),
            Rounding::Fine => by_shape!(@ $m::$f, true, $r, $c, $($arg),*),
        }
    };
    (@ $m:ident::$f:ident, $fine:literal, $r:expr, $c:expr, $($arg:expr),*) => {
        match ($r, $c) {
            (4, 4) => $m::$f::<4, 4, $fine>($($arg),*), (4, 3) => $m::$f::<4, 3, $fine>($($arg),*),
            (4, 2) => $m::$f::<4, 2, $fine>($($arg),*), (4, 1) => $m::$f::<4, 1, $fine>($($arg),*),
            (3, 4) => $m::$f::<3, 4, $fine>($($arg),*), (3, 3) => $m::$f::<3, 3, $fine>($($arg),*),
            (3, 2) => $m::$f::<3, 2, $fine>($($arg),*), (3, 1) => $m::$f::<3, 1, $fine>($($arg),*),
            (2, 4) => $m::$f::<2, 4, $fine>($($arg),*), (2, 3) => $m::$f::<2, 3, $fine>($($arg),*),
            (2, 2) => $m::$f::<2, 2, $fine>($($arg),*), (2, 1) => $m::$f::<2, 1, $fine>($($arg),*),
            (1, 4) => $m::$f::<1, 4, $fine>($($arg),*), (1, 3) => $m::$f::<1, 3, $fine>($($arg),*),
            (1, 2) => $m::$f::<1, 2, $fine>($($arg),*), (1, 1) => $m::$f::<1, 1, $fine>($($arg),*),
            _ => unreachable!("tile shape"),
        }
    };
}

/// One register tile through the kernel set `isa` (which the CPU must support).
#[allow(clippy::too_many_arguments)]
fn tile(
    isa: Isa,
    w: &PackedWeight,
    r0: usize,
    nr: usize,
    a: &QuantizedActs,
    t0: usize,
    nt: usize,
    out: Out,
) {
    match (isa, w.codes) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `matmul` only passes an `isa` the CPU supports; indices are in bounds.
        (Isa::Avx2, Codes::U4) => unsafe { by_shape!(avx2::tile_u4, nr, nt, a, w, r0, a, t0, out) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, Codes::U8) => unsafe { by_shape!(avx2::tile_u8, nr, nt, a, w, r0, a, t0, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY (all three sets): as above.
        (Isa::NeonI8mm, Codes::U4) => unsafe {
            by_shape!(neon::mmla_tile_u4, nr, nt, a, w, r0, a, t0, out)
        },
        #[cfg(target_arch = "aarch64")]
        (Isa::NeonI8mm, Codes::U8) => unsafe {
            by_shape!(neon::mmla_tile_u8, nr, nt, a, w, r0, a, t0, out)
        },
        #[cfg(target_arch = "aarch64")]
        (Isa::NeonDotprod, Codes::U4) => unsafe {
            by_shape!(neon::sdot_u4, nr, nt, a, w, r0, a, t0, out)
        },
        #[cfg(target_arch = "aarch64")]
        (Isa::NeonDotprod, Codes::U8) => unsafe {
            by_shape!(neon::sdot_u8, nr, nt, a, w, r0, a, t0, out)
        },
        #[cfg(target_arch = "aarch64")]
        (Isa::Neon, Codes::U4) => unsafe {
            by_shape!(neon::smull_u4, nr, nt, a, w, r0, a, t0, out)
        },
        #[cfg(target_arch = "aarch64")]
        (Isa::Neon, Codes::U8) => unsafe {
            by_shape!(neon::smull_u8, nr, nt, a, w, r0, a, t0, out)
        },
        (_, Codes::U4) => by_shape!(portable::tile_u4, nr, nt, a, w, r0, a, t0, out),
        (_, Codes::U8) => by_shape!(portable::tile_u8, nr, nt, a, w, r0, a, t0, out),
    }
}

/// `out[t, r] = sum_k a[t, k] * w[r, k]` for all `a.rows` tokens and `w.rows` rows.
pub fn matmul(w: &PackedWeight, a: &QuantizedActs, out: &mut [f32], isa: Isa) {
    assert!(
        isa.supported(),
        "{} kernels on a CPU without them",
        isa.name()
    );
    assert_eq!(w.blocks, a.blocks, "weight and activation widths differ");
    assert_eq!(
        w.layout,
        isa.layout(),
        "{} kernels on another layout",
        isa.name()
    );
    assert_eq!(out.len(), a.rows * w.rows);
    let out = Out {
        y: DisjointSlice::new(out),
        ld: w.rows,
    };
    let tokens = a.rows;
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Amx | Isa::Avx512Vnni) {
        (0..w.rows.div_ceil(TASK_ROWS))
            .into_par_iter()
            .for_each(|task| {
                let rows = task * TASK_ROWS..((task + 1) * TASK_ROWS).min(w.rows);
                match isa {
                    Isa::Amx => amx::matmul_rows(w, a, rows, out),
                    _ => columns::matmul_rows(w, a, rows, out),
                }
            });
        return;
    }
    (0..w.rows.div_ceil(TASK_ROWS))
        .into_par_iter()
        .for_each(|task| {
            let rows = task * TASK_ROWS..((task + 1) * TASK_ROWS).min(w.rows);
            for t0 in (0..tokens).step_by(TILE_TOKENS) {
                let nt = TILE_TOKENS.min(tokens - t0);
                for r0 in rows.clone().step_by(TILE_ROWS) {
                    tile(isa, w, r0, TILE_ROWS.min(rows.end - r0), a, t0, nt, out);
                }
            }
        });
}
