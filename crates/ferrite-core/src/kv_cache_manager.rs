//! Which blocks each request holds, and slot allocation for the tokens of a step.

use crate::block_pool::{BlockId, BlockPool};
use crate::request::RequestId;
use std::collections::HashMap;

#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    tables: HashMap<RequestId, Vec<BlockId>>,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block size must be positive");
        Self {
            pool: BlockPool::new(num_blocks),
            block_size,
            tables: HashMap::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    pub fn blocks_for_tokens(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Makes sure `req` owns enough blocks to hold `total_tokens` tokens of K/V.
    /// Returns false (and allocates nothing) when the pool cannot supply them.
    pub fn allocate_slots(&mut self, req: RequestId, total_tokens: usize) -> bool {
        let needed = self.blocks_for_tokens(total_tokens);
        let have = self.tables.get(&req).map_or(0, Vec::len);
        if needed <= have {
            return true;
        }
        match self.pool.allocate(needed - have) {
            Some(new) => {
                self.tables.entry(req).or_default().extend(new);
                true
            }
            None => false,
        }
    }

    pub fn block_table(&self, req: RequestId) -> &[BlockId] {
        self.tables.get(&req).map_or(&[], Vec::as_slice)
    }

    /// Returns every block of `req` to the pool (tail first, so the head of a prompt is
    /// reused last once prefix caching keeps freed blocks around).
    pub fn free(&mut self, req: RequestId) {
        if let Some(blocks) = self.tables.remove(&req) {
            self.pool.free(blocks.into_iter().rev());
        }
    }

    pub fn num_requests(&self) -> usize {
        self.tables.len()
    }
}
