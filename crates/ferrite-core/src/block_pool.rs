//! The fixed pool of KV blocks. Blocks are plain indices into the cache tensors the runner owns.

use std::collections::VecDeque;

pub type BlockId = u32;

#[derive(Debug)]
pub struct BlockPool {
    num_blocks: usize,
    free: VecDeque<BlockId>,
    in_use: Vec<bool>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            num_blocks,
            free: (0..num_blocks as BlockId).collect(),
            in_use: vec![false; num_blocks],
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Takes `n` blocks, or none at all when fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        let blocks: Vec<BlockId> = self.free.drain(..n).collect();
        for &b in &blocks {
            debug_assert!(!self.in_use[b as usize], "block {b} handed out twice");
            self.in_use[b as usize] = true;
        }
        Some(blocks)
    }

    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            assert!(self.in_use[b as usize], "block {b} freed twice");
            self.in_use[b as usize] = false;
            self.free.push_back(b);
        }
    }

    /// Fraction of blocks held by requests.
    pub fn usage(&self) -> f64 {
        if self.num_blocks == 0 {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.num_blocks as f64
    }
}
