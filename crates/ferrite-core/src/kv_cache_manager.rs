//! Which blocks each request holds (one block table per KV group, see [`KvLayout`]), slot
//! allocation for the tokens of a step, blocks a sliding window no longer reads handed back,
//! and prefix caching: full blocks are hashed (chained) and reused by any later request with
//! the same prefix.

use crate::block_pool::{BlockId, BlockPool};
use crate::kv_layout::{first_needed_block, GroupWindow};
use crate::prefix_hash::{BlockHash, HashAlgo};
use crate::request::{Request, RequestId};
use std::collections::HashMap;

/// A block-table entry a window no longer reads: its block went back to the pool.
pub const NULL_BLOCK: BlockId = BlockId::MAX;

/// Per group, the blocks of one request (`NULL_BLOCK` where a window dropped one).
pub type BlockTables = Vec<Vec<BlockId>>;

#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    groups: Vec<GroupWindow>,
    tables: HashMap<RequestId, BlockTables>,
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

/// The pool's key of group `g`'s copy of a block: the groups' blocks of one prefix hold
/// different layers, so each group caches under its own key.
fn group_key(hash: &BlockHash, g: usize) -> BlockHash {
    let mut k = *hash;
    for (b, x) in k.iter_mut().zip((g as u64).to_le_bytes()) {
        *b ^= x;
    }
    k
}

impl KvCacheManager {
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        groups: Vec<GroupWindow>,
        prefix: Option<HashAlgo>,
    ) -> Self {
        assert!(block_size > 0, "block size must be positive");
        assert!(!groups.is_empty(), "at least one KV group");
        Self {
            pool: BlockPool::new(num_blocks),
            block_size,
            groups,
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

    pub fn groups(&self) -> &[GroupWindow] {
        &self.groups
    }

    pub fn blocks_for_tokens(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    fn block_tokens(&self, req: &Request, b: usize) -> Vec<u32> {
        (b * self.block_size..(b + 1) * self.block_size)
            .map(|i| req.token_at(i))
            .collect()
    }

    /// The first block group `g` still reads when the next query is at `next`.
    fn first_live(&self, g: usize, next: usize) -> usize {
        self.groups[g].map_or(0, |w| first_needed_block(w, next, self.block_size))
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

    /// Group `g`'s cached copy of `req`'s block `b`.
    fn cached(&self, req: &Request, g: usize, b: usize, algo: HashAlgo) -> Option<BlockId> {
        let key = group_key(&self.hashes[&req.id][b], g);
        let tokens = self.block_tokens(req, b);
        self.pool.lookup(&key, &tokens, algo.needs_token_check())
    }

    /// The longest cached prefix of `req`'s tokens, as block tables: full-attention groups
    /// need every block of it cached, window groups the blocks their window reads from the
    /// first token after it. It never covers the last token: that one is always computed,
    /// for its logits. Requests that want prompt logprobs compute their whole prompt.
    pub fn find_cached_prefix(&mut self, req: &Request) -> BlockTables {
        self.find_cached_prefix_within(req, usize::MAX)
    }

    /// The same, at most `cap` blocks long.
    pub fn find_cached_prefix_within(&mut self, req: &Request, cap: usize) -> BlockTables {
        let none = vec![Vec::new(); self.groups.len()];
        let Some(algo) = self.prefix else {
            return none;
        };
        if req.params.prompt_logprobs.is_some() {
            return none;
        }
        let max_blocks = ((req.num_tokens() - 1) / self.block_size).min(cap);
        self.hash_blocks(req, max_blocks * self.block_size);
        // Full groups: the chain of hits from the first block.
        let mut n = max_blocks;
        for g in (0..self.groups.len()).filter(|&g| self.groups[g].is_none()) {
            n = (0..n)
                .position(|b| self.cached(req, g, b, algo).is_none())
                .unwrap_or(n);
        }
        // Window groups: the longest prefix whose last window is cached in every one (at
        // least its last block, so a hit always means a cached prefix, even for windows too
        // short to reach back into it).
        while n > 0 {
            let lives = (0..self.groups.len()).all(|g| {
                (self.first_live(g, n * self.block_size).min(n - 1)..n)
                    .all(|b| self.cached(req, g, b, algo).is_some())
            });
            if lives {
                break;
            }
            n -= 1;
        }
        (0..self.groups.len())
            .map(|g| {
                let first = self
                    .first_live(g, n * self.block_size)
                    .min(n.saturating_sub(1));
                (0..n)
                    .map(|b| match b >= first {
                        true => self.cached(req, g, b, algo).expect("checked above"),
                        false => NULL_BLOCK,
                    })
                    .collect()
            })
            .collect()
    }

    /// The chained hash of `req`'s full block `b` (prefix caching on, and the block's tokens
    /// known).
    pub fn block_hash(&mut self, req: &Request, b: usize) -> Option<BlockHash> {
        if (b + 1) * self.block_size > req.num_tokens() {
            return None;
        }
        self.hash_blocks(req, (b + 1) * self.block_size);
        self.hashes.get(&req.id)?.get(b).copied()
    }

    /// Counts an admitted request's lookup for the hit-rate metrics.
    pub fn note_prefix_lookup(&mut self, queried_tokens: usize, hit_tokens: usize) {
        if self.prefix.is_some() {
            self.queried_tokens += queried_tokens as u64;
            self.hit_tokens += hit_tokens as u64;
        }
    }

    /// Makes sure `req` owns the blocks to hold `total_tokens` tokens of K/V when its next
    /// token to compute is `next`: window groups first hand back the blocks they will never
    /// read again; a new request's tables start from the cached blocks `hit`. Returns false
    /// (and allocates nothing) when the pool cannot supply them.
    pub fn allocate_slots(
        &mut self,
        req: RequestId,
        next: usize,
        total_tokens: usize,
        hit: &BlockTables,
    ) -> bool {
        let needed = self.blocks_for_tokens(total_tokens);
        if let Some(mut tables) = self.tables.remove(&req) {
            for (g, t) in tables.iter_mut().enumerate() {
                let first = self.first_live(g, next).min(t.len());
                let dropped: Vec<BlockId> = t[..first]
                    .iter_mut()
                    .filter(|b| **b != NULL_BLOCK)
                    .map(|b| std::mem::replace(b, NULL_BLOCK))
                    .collect();
                self.pool.free(dropped.into_iter().rev());
            }
            self.tables.insert(req, tables);
        }
        let current = self.tables.get(&req).unwrap_or(hit);
        let new: usize = current.iter().map(|t| needed.saturating_sub(t.len())).sum();
        let hit_blocks: Vec<BlockId> = if self.tables.contains_key(&req) {
            Vec::new()
        } else {
            hit.iter()
                .flatten()
                .copied()
                .filter(|&b| b != NULL_BLOCK)
                .collect()
        };
        // Hit blocks waiting in the free queue stop being free once referenced.
        if new + self.pool.num_free_among(&hit_blocks) > self.pool.num_free() {
            return false;
        }
        if !self.tables.contains_key(&req) {
            self.pool.touch(&hit_blocks);
            self.tables.insert(req, hit.clone());
        }
        let tables = self.tables.get_mut(&req).unwrap();
        for t in tables.iter_mut() {
            let n = needed.saturating_sub(t.len());
            if n > 0 {
                t.extend(self.pool.allocate(n).expect("checked above"));
            }
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
            let hash = self.hashes[&req.id][b];
            for g in 0..self.groups.len() {
                let block = self.tables[&req.id][g][b];
                if block != NULL_BLOCK {
                    self.pool
                        .cache_full_block(block, group_key(&hash, g), &tokens);
                }
            }
        }
        self.num_cached.insert(req.id, full);
    }

    /// `req`'s block tables, one per group.
    pub fn block_tables(&self, req: RequestId) -> &[Vec<BlockId>] {
        self.tables.get(&req).map_or(&[], Vec::as_slice)
    }

    /// Blocks `req` holds now, over all groups.
    pub fn num_held(&self, req: RequestId) -> usize {
        self.block_tables(req)
            .iter()
            .flatten()
            .filter(|&&b| b != NULL_BLOCK)
            .count()
    }

    /// Returns every block of `req` to the pool, tail first: the head of a prompt (the part
    /// most likely shared) is evicted last.
    pub fn free(&mut self, req: RequestId) {
        if let Some(tables) = self.tables.remove(&req) {
            for t in tables {
                self.pool
                    .free(t.into_iter().rev().filter(|&b| b != NULL_BLOCK));
            }
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
