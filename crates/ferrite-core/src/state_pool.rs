//! Recurrent-state slots: models with linear-attention layers (gated delta-net) keep, per
//! running request, a fixed-size state beside its KV blocks. The pool of slots is sized once
//! at start-up; a request holds one from admission to finish, abort or preemption (a
//! preempted request recomputes from its first token, so its state starts over). Slots are
//! plain indices into the state tensors the runner owns.

use crate::request::RequestId;
use std::collections::HashMap;

pub type StateSlot = u32;

#[derive(Debug)]
pub struct StatePool {
    free: Vec<StateSlot>,
    owners: HashMap<RequestId, StateSlot>,
    len: usize,
}

impl StatePool {
    pub fn new(len: usize) -> Self {
        Self {
            // Popped from the end: the lowest slots go first.
            free: (0..len as StateSlot).rev().collect(),
            owners: HashMap::new(),
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// `id`'s slot, taken from the free ones if it has none; `None` when none is free.
    pub fn acquire(&mut self, id: RequestId) -> Option<StateSlot> {
        if let Some(&s) = self.owners.get(&id) {
            return Some(s);
        }
        let s = self.free.pop()?;
        self.owners.insert(id, s);
        Some(s)
    }

    pub fn slot(&self, id: RequestId) -> Option<StateSlot> {
        self.owners.get(&id).copied()
    }

    /// Gives `id`'s slot back (nothing if it holds none).
    pub fn release(&mut self, id: RequestId) {
        if let Some(s) = self.owners.remove(&id) {
            self.free.push(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_owned_once_and_come_back() {
        let mut p = StatePool::new(2);
        assert_eq!(p.acquire(7), Some(0));
        assert_eq!(p.acquire(7), Some(0));
        assert_eq!(p.acquire(8), Some(1));
        assert_eq!(p.acquire(9), None);
        p.release(7);
        assert_eq!(p.acquire(9), Some(0));
        p.release(8);
        p.release(9);
        p.release(9);
        assert_eq!(p.num_free(), 2);
    }
}
