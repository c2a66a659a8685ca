//! The output handle every kernel set writes through.

use crate::backend::cpu::disjoint::DisjointSlice;

/// The `[tokens, rows]` output matrix, written by disjoint tiles from several threads.
#[derive(Clone, Copy)]
pub(super) struct Out<'a> {
    pub y: DisjointSlice<'a>,
    pub ld: usize,
}

impl<'a> Out<'a> {
    #[inline(always)]
    pub fn set(self, t: usize, r: usize, v: f32) {
        // SAFETY: every (token, row) element belongs to exactly one tile.
        unsafe { self.y.range(t * self.ld + r, 1)[0] = v }
    }

    /// Rows `r0..r0 + n` of token `t`'s output.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub fn row(self, t: usize, r0: usize, n: usize) -> &'a mut [f32] {
        // SAFETY: as for `set`.
        unsafe { self.y.range(t * self.ld + r0, n) }
    }
}
