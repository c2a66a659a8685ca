//! The output handle every kernel set writes through.

use crate::backend::cpu::disjoint::DisjointSlice;

/// The `[tokens, rows]` output matrix, written by disjoint tiles from several threads.
#[derive(Clone, Copy)]
pub(super) struct Out<'a> {
    pub y: DisjointSlice<'a>,
    pub ld: usize,
}

impl Out<'_> {
    #[inline(always)]
    pub fn set(self, t: usize, r: usize, v: f32) {
        // SAFETY: every (token, row) element belongs to exactly one tile.
        unsafe { self.y.range(t * self.ld + r, 1)[0] = v }
    }
}
