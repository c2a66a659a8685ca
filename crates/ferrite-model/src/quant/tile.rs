//! What every kernel set shares: the output handle and the `U4` offset term.

/// The `[tokens, rows]` output matrix, written by disjoint tiles from several threads.
#[derive(Clone, Copy)]
pub(super) struct Out {
    pub ptr: *mut f32,
    pub ld: usize,
}

// SAFETY: tiles write disjoint elements; the matmul waits for every tile before returning.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    #[inline(always)]
    pub fn set(self, t: usize, r: usize, v: f32) {
        // SAFETY: the matmul checked that `t < tokens` and `r < rows`, the buffer's shape.
        unsafe { *self.ptr.add(t * self.ld + r) = v }
    }
}

/// `sum_b m[b] * s[b]`: the `U4` blocks' offsets times the activation block sums, in a
/// fixed 8-lane order so every kernel set and tile shape rounds it the same way.
#[inline(always)]
pub(super) fn offset_term(m: &[f32], s: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (mc, sc) = (m.chunks_exact(8), s.chunks_exact(8));
    let (mr, sr) = (mc.remainder(), sc.remainder());
    for (m, s) in mc.zip(sc) {
        for k in 0..8 {
            lanes[k] += m[k] * s[k];
        }
    }
    for (k, (m, s)) in mr.iter().zip(sr).enumerate() {
        lanes[k] += m * s;
    }
    lanes.iter().sum()
}
