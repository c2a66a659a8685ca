//! Prefix caching for models with recurrent state (linear-attention layers): a cached prefix
//! is worth something only with the state after it, so the state after some full prompt
//! blocks is checkpointed — written by the step in place into a checkpoint slot beside the
//! running ones — keyed by that block's chained hash. A hit restores the attention blocks and
//! the state at the deepest checkpointed block of the cached prefix. Checkpoints are evicted
//! least recently used first; one written by a step counts only once the step has run.

use crate::prefix_hash::BlockHash;
use crate::state_pool::StateSlot;
use std::collections::{BTreeMap, HashMap};

#[derive(Debug)]
pub struct StateCheckpoints {
    /// Valid checkpoints: their slot and last use.
    by_hash: HashMap<BlockHash, (StateSlot, u64)>,
    /// Least recently used first.
    lru: BTreeMap<u64, BlockHash>,
    free: Vec<StateSlot>,
    /// Slots the step in flight writes, and the hash each will hold.
    pending: Vec<(StateSlot, BlockHash)>,
    clock: u64,
    len: usize,
}

impl StateCheckpoints {
    /// Checkpoint slots `first..first + len` of the state tensors.
    pub fn new(first: StateSlot, len: usize) -> Self {
        Self {
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            free: (first..first + len as StateSlot).rev().collect(),
            pending: Vec::new(),
            clock: 0,
            len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn len(&self) -> usize {
        self.len
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The slot holding the state after the block of `hash`, marked used.
    pub fn lookup(&mut self, hash: &BlockHash) -> Option<StateSlot> {
        let (slot, last) = *self.by_hash.get(hash)?;
        let now = self.tick();
        self.lru.remove(&last);
        self.lru.insert(now, *hash);
        self.by_hash.insert(*hash, (slot, now));
        Some(slot)
    }

    /// The slot of a valid checkpoint of `hash`, its use not counted.
    pub fn peek(&self, hash: &BlockHash) -> Option<StateSlot> {
        self.by_hash.get(hash).map(|e| e.0)
    }

    pub fn contains(&self, hash: &BlockHash) -> bool {
        self.by_hash.contains_key(hash) || self.pending.iter().any(|(_, h)| h == hash)
    }

    /// A slot for the step in flight to write the state after the block of `hash` into: a
    /// free one, else the least recently used one not in `busy` (the step's restores).
    pub fn reserve(&mut self, hash: BlockHash, busy: &[StateSlot]) -> Option<StateSlot> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let (&at, &victim) = self
                    .lru
                    .iter()
                    .find(|(_, h)| !busy.contains(&self.by_hash[*h].0))?;
                self.lru.remove(&at);
                self.by_hash.remove(&victim).expect("listed").0
            }
        };
        self.pending.push((slot, hash));
        Some(slot)
    }

    /// The step in flight ran: what it wrote is valid.
    pub fn commit(&mut self) {
        for (slot, hash) in std::mem::take(&mut self.pending) {
            let now = self.tick();
            self.lru.insert(now, hash);
            self.by_hash.insert(hash, (slot, now));
        }
    }

    /// The step in flight failed: its slots go back unwritten.
    pub fn abandon(&mut self) {
        for (slot, _) in std::mem::take(&mut self.pending) {
            self.free.push(slot);
        }
    }

    pub fn clear(&mut self) {
        self.abandon();
        for (_, (slot, _)) in self.by_hash.drain() {
            self.free.push(slot);
        }
        self.lru.clear();
    }

    /// Slots holding a checkpoint or being written (for leak checks: with `free`, all).
    pub fn num_used(&self) -> usize {
        self.len - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> BlockHash {
        [i; 32]
    }

    #[test]
    fn checkpoints_count_once_committed_and_evict_the_least_recent() {
        let mut c = StateCheckpoints::new(4, 2);
        let a = c.reserve(h(1), &[]).unwrap();
        assert_eq!(c.lookup(&h(1)), None, "not valid before its step ran");
        c.commit();
        assert_eq!(c.lookup(&h(1)), Some(a));
        let b = c.reserve(h(2), &[]).unwrap();
        c.commit();
        assert_ne!(a, b);
        assert!((4..6).contains(&a) && (4..6).contains(&b));
        c.lookup(&h(1));
        // Full: the least recently used (h2) goes, unless a restore of this step reads it.
        assert_eq!(c.reserve(h(3), &[b]), Some(a));
        c.abandon();
        assert_eq!(c.lookup(&h(1)), None);
        assert_eq!(c.lookup(&h(2)), Some(b));
        assert_eq!(c.reserve(h(3), &[]), Some(a));
        c.commit();
        c.clear();
        assert_eq!(c.num_used(), 0);
    }
}
