//! A mutable slice that parallel tasks write at disjoint places (matmul tiles, attention
//! tiles), without collecting per-task results and copying them afterwards.

use std::marker::PhantomData;

#[derive(Clone, Copy)]
pub struct DisjointSlice<'a> {
    ptr: *mut f32,
    len: usize,
    _slice: PhantomData<&'a mut [f32]>,
}

// SAFETY: tasks only touch disjoint ranges (the callers' contract, see `range`), and the
// parallel loop that shares the slice ends before the borrow does.
unsafe impl Send for DisjointSlice<'_> {}
unsafe impl Sync for DisjointSlice<'_> {}

impl<'a> DisjointSlice<'a> {
    pub fn new(s: &'a mut [f32]) -> Self {
        Self {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _slice: PhantomData,
        }
    }

    /// Elements `start..start + len`.
    ///
    /// # Safety
    /// No other task reads or writes these elements while the returned slice lives.
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range(&self, start: usize, len: usize) -> &'a mut [f32] {
        assert!(start + len <= self.len, "disjoint range out of bounds");
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}
