//! The communicator a rank's collectives go through.

use anyhow::Result;

/// Collectives and point-to-point messages over host buffers among the ranks of one group.
/// Every rank calls each collective in the same order with buffers of the same length.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// `buf` becomes the element-wise sum of every rank's `buf`.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// Every rank's `local` (equal lengths), concatenated in rank order, on `root` only
    /// (`out` is ignored elsewhere).
    fn gather(&self, root: usize, local: &[f32], out: &mut [f32]) -> Result<()>;
    /// `root`'s bytes on every rank (their length included).
    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()>;
    fn send(&self, to: usize, buf: &[f32]) -> Result<()>;
    /// Exactly `buf.len()` values from `from`.
    fn recv(&self, from: usize, buf: &mut [f32]) -> Result<()>;
    /// Ends every rank's process: a rank that failed mid-step would leave the others
    /// waiting in a collective it never joins.
    fn abort(&self, code: i32) -> !;
}
