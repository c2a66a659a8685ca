//! The output handle every kernel set writes through.

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
