//! The fixed pool of KV blocks. Blocks are plain indices into the cache tensors the runner owns.
//! With prefix caching, full blocks keep their hash after being freed and wait in an LRU free
//! queue; they are evicted only when a new block is needed.

use crate::prefix_hash::BlockHash;
use std::collections::{BTreeMap, HashMap};

pub type BlockId = u32;

#[derive(Debug, Clone, Default)]
struct BlockMeta {
    ref_cnt: u32,
    hash: Option<BlockHash>,
    /// Token ids the block holds, kept to confirm hits when the hash is not collision-resistant.
    tokens: Vec<u32>,
    /// Position in the free queue (present iff `ref_cnt == 0`).
    free_seq: Option<u64>,
}

#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    /// LRU order: the first entry is evicted first.
    free: BTreeMap<u64, BlockId>,
    next_seq: u64,
    cached: HashMap<BlockHash, BlockId>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        let mut pool = Self {
            blocks: vec![BlockMeta::default(); num_blocks],
            free: BTreeMap::new(),
            next_seq: 0,
            cached: HashMap::new(),
        };
        for b in 0..num_blocks as BlockId {
            pool.push_free(b);
        }
        pool
    }

    fn push_free(&mut self, b: BlockId) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.free.insert(seq, b);
        self.blocks[b as usize].free_seq = Some(seq);
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks not referenced by any request (cached ones included: they can be evicted).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    pub fn ref_cnt(&self, b: BlockId) -> u32 {
        self.blocks[b as usize].ref_cnt
    }

    /// Takes `n` blocks from the head of the free queue, evicting their cached contents;
    /// none at all when fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, b) = self.free.pop_first().expect("counted above");
            let meta = &mut self.blocks[b as usize];
            debug_assert_eq!(
                meta.ref_cnt, 0,
                "block {b} in the free queue while referenced"
            );
            meta.free_seq = None;
            meta.ref_cnt = 1;
            meta.tokens.clear();
            if let Some(h) = meta.hash.take() {
                if self.cached.get(&h) == Some(&b) {
                    self.cached.remove(&h);
                }
            }
            out.push(b);
        }
        Some(out)
    }

    /// The cached block for `hash` holding `tokens` (compared when `check_tokens`).
    pub fn lookup(&self, hash: &BlockHash, tokens: &[u32], check_tokens: bool) -> Option<BlockId> {
        let &b = self.cached.get(hash)?;
        (!check_tokens || self.blocks[b as usize].tokens == tokens).then_some(b)
    }

    /// Takes a reference on cached blocks (a prefix hit), pulling free ones out of the queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            let meta = &mut self.blocks[b as usize];
            if let Some(seq) = meta.free_seq.take() {
                self.free.remove(&seq);
            }
            meta.ref_cnt += 1;
        }
    }

    /// How many of `blocks` sit in the free queue (a hit on them uses up free blocks).
    pub fn num_free_among(&self, blocks: &[BlockId]) -> usize {
        blocks
            .iter()
            .filter(|&&b| self.blocks[b as usize].ref_cnt == 0)
            .count()
    }

    /// Drops one reference per block, in the given order; unreferenced blocks join the tail
    /// of the free queue (so blocks freed first are evicted first).
    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            let meta = &mut self.blocks[b as usize];
            assert!(
                meta.ref_cnt > 0,
                "block {b} freed more often than referenced"
            );
            meta.ref_cnt -= 1;
            if meta.ref_cnt == 0 {
                self.push_free(b);
            }
        }
    }

    /// Records that `b` is full and holds `tokens` with chained hash `hash`. A second block
    /// with the same contents stays uncached (the first one serves hits).
    pub fn cache_full_block(&mut self, b: BlockId, hash: BlockHash, tokens: &[u32]) {
        let meta = &mut self.blocks[b as usize];
        if meta.hash.is_some() || self.cached.contains_key(&hash) {
            return;
        }
        meta.hash = Some(hash);
        meta.tokens = tokens.to_vec();
        self.cached.insert(hash, b);
    }

    /// Forgets every cached prefix (blocks in use keep their contents).
    pub fn reset_cache(&mut self) {
        self.cached.clear();
        for m in &mut self.blocks {
            m.hash = None;
            m.tokens.clear();
        }
    }

    /// Fraction of blocks held by requests.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.blocks.len() as f64
    }
}
