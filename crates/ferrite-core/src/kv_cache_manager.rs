//! Which blocks each request holds, slot allocation for the tokens of a step, and prefix
//! caching: full blocks are hashed (chained) and reused by any later request with the same
//! prefix.

use crate::block_pool::{BlockId, BlockPool};
use crate::prefix_hash::{BlockHash, HashAlgo};
use crate::request::{Request, RequestId};
use std::collections::HashMap;

#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    tables: HashMap<RequestId, Vec<BlockId>>,
    /// `None` when prefix caching is off.
    prefix: Option<HashAlgo>,
    /// Per request: chained hashes of its full blocks so far.
    hashes: HashMap<RequestId, Vec<BlockHash>>,
    /// Per request: how many of its blocks were offered to the cache.
    num_cached: HashMap<RequestId, usize>,
    /// Prompt tokens looked up and found, for the hit-rate metrics.
    pub queried_tokens: u64,
    pub hit_tokens: u64,
}

impl KvCacheManager {
    pub fn new(num_blocks: usize, block_size: usize, prefix: Option<HashAlgo>) -> Self {
        assert!(block_size > 0, "block size must be positive");
        Self {
            pool: BlockPool::new(num_blocks),
            block_size,
            tables: HashMap::new(),
            prefix,
            hashes: HashMap::new(),
            num_cached: HashMap::new(),
            queried_tokens: 0,
            hit_tokens: 0,
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

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn blocks_for_tokens(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    fn block_tokens(&self, req: &Request, b: usize) -> Vec<u32> {
        (b * self.block_size..(b + 1) * self.block_size)
            .map(|i| req.token_at(i))
            .collect()
    }

    /// Extends `req`'s chain of block hashes over its first `num_tokens` tokens.
    fn hash_blocks(&mut self, req: &Request, num_tokens: usize) {
        let Some(algo) = self.prefix else { return };
        let full = num_tokens / self.block_size;
        let have = self.hashes.get(&req.id).map_or(0, Vec::len);
        let mut new = Vec::new();
        for b in have..full {
            let tokens = self.block_tokens(req, b);
            let chain = self.hashes.get(&req.id);
            let parent = b.checked_sub(1).map(|p| {
                if p < have {
                    chain.unwrap()[p]
                } else {
                    new[p - have]
                }
            });
            let salt = if b == 0 {
                req.params.cache_salt.as_deref()
            } else {
                None
            };
            new.push(algo.block_hash(parent.as_ref(), &tokens, salt));
        }
        self.hashes.entry(req.id).or_default().extend(new);
    }

    /// The longest chain of cached blocks that starts `req`'s tokens. It never covers the
    /// last token: that one is always computed, for its logits. Requests that want prompt
    /// logprobs compute their whole prompt.
    pub fn find_cached_prefix(&mut self, req: &Request) -> Vec<BlockId> {
        let Some(algo) = self.prefix else {
            return Vec::new();
        };
        if req.params.prompt_logprobs.is_some() {
            return Vec::new();
        }
        let max_blocks = (req.num_tokens() - 1) / self.block_size;
        self.hash_blocks(req, max_blocks * self.block_size);
        let hashes = &self.hashes[&req.id];
        let mut hit = Vec::new();
        for (b, h) in hashes.iter().take(max_blocks).enumerate() {
            let tokens = self.block_tokens(req, b);
            match self.pool.lookup(h, &tokens, algo.needs_token_check()) {
                Some(block) => hit.push(block),
                None => break,
            }
        }
        hit
    }

    /// Counts an admitted request's lookup for the hit-rate metrics.
    pub fn note_prefix_lookup(&mut self, queried_tokens: usize, hit_tokens: usize) {
        if self.prefix.is_some() {
            self.queried_tokens += queried_tokens as u64;
            self.hit_tokens += hit_tokens as u64;
        }
    }

    /// Makes sure `req` owns enough blocks to hold `total_tokens` tokens of K/V, starting a
    /// new request's table with the cached blocks `hit`. Returns false (and changes nothing)
    /// when the pool cannot supply them.
    pub fn allocate_slots(&mut self, req: RequestId, total_tokens: usize, hit: &[BlockId]) -> bool {
        let needed = self.blocks_for_tokens(total_tokens);
        let have = self.tables.get(&req).map_or(hit.len(), Vec::len);
        let new = needed.saturating_sub(have);
        // Hit blocks waiting in the free queue stop being free once referenced.
        if new + self.pool.num_free_among(hit) > self.pool.num_free() {
            return false;
        }
        if !self.tables.contains_key(&req) {
            self.pool.touch(hit);
            self.tables.insert(req, hit.to_vec());
        }
        if new > 0 {
            let blocks = self.pool.allocate(new).expect("checked above");
            self.tables.get_mut(&req).unwrap().extend(blocks);
        }
        true
    }

    /// Offers `req`'s newly completed blocks (those whose K/V are all computed) to the cache.
    pub fn cache_blocks(&mut self, req: &Request) {
        if self.prefix.is_none() {
            return;
        }
        let full = req.num_computed_tokens / self.block_size;
        let done = self.num_cached.get(&req.id).copied().unwrap_or(0);
        if full <= done {
            return;
        }
        self.hash_blocks(req, full * self.block_size);
        for b in done..full {
            let tokens = self.block_tokens(req, b);
            let (block, hash) = (self.tables[&req.id][b], self.hashes[&req.id][b]);
            self.pool.cache_full_block(block, hash, &tokens);
        }
        self.num_cached.insert(req.id, full);
    }

    pub fn block_table(&self, req: RequestId) -> &[BlockId] {
        self.tables.get(&req).map_or(&[], Vec::as_slice)
    }

    /// Returns every block of `req` to the pool, tail first: the head of a prompt (the part
    /// most likely shared) is evicted last.
    pub fn free(&mut self, req: RequestId) {
        if let Some(blocks) = self.tables.remove(&req) {
            self.pool.free(blocks.into_iter().rev());
        }
        self.num_cached.remove(&req);
    }

    /// Forgets a finished request's hash chain too.
    pub fn forget(&mut self, req: RequestId) {
        self.free(req);
        self.hashes.remove(&req);
    }

    pub fn reset_prefix_cache(&mut self) {
        self.pool.reset_cache();
        self.num_cached.clear();
    }

    pub fn num_requests(&self) -> usize {
        self.tables.len()
    }
}
