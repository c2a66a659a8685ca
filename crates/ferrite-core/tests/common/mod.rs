//! A mock model for scheduler tests: it keeps a simulated KV cache of token ids, written and
//! read through the block tables and slots the scheduler hands out, and its next token is a
//! hash of the history it reads back (per KV group: all of it, or the group's window). A block
//! shared by mistake, a wrong table, a lost token or a block read after a window dropped it
//! changes the output (or panics on the dropped entry).

use ferrite_core::kv_layout::GroupWindow;
use ferrite_core::scheduler::SchedulerOutput;
use std::collections::HashMap;

pub struct MockModel {
    pub slots: Vec<Option<u32>>,
    /// The draft model's own pages of the same blocks (speculation with a draft model).
    pub draft_slots: Vec<Option<u32>>,
    /// Per recurrent-state slot: a hash of every token the slot's request has fed since its
    /// first (reset when a request starts at position 0), mixed into the next token (a
    /// verify step's rows each see the state after their own token).
    pub states: Vec<u64>,
    block_size: usize,
    vocab: u32,
    groups: Vec<GroupWindow>,
}

impl MockModel {
    pub fn new(num_blocks: usize, block_size: usize, vocab: u32, groups: &[GroupWindow]) -> Self {
        Self {
            slots: vec![None; num_blocks * block_size],
            draft_slots: vec![None; num_blocks * block_size],
            states: Vec::new(),
            block_size,
            vocab,
            groups: groups.to_vec(),
        }
    }

    pub fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// The positions group `g` reads for a query at `pos`.
    pub fn reads(&self, g: usize, pos: usize) -> std::ops::Range<usize> {
        self.groups[g].map_or(0, |w| (pos + 1).saturating_sub(w))..pos + 1
    }

    /// Each sampled request's tokens: the next token of its history, or with a draft, the
    /// drafts while each is the next token of what precedes it, then one more.
    pub fn execute(&mut self, out: &SchedulerOutput) -> HashMap<u64, Vec<u32>> {
        let mut sampled = HashMap::new();
        for r in &out.requests {
            assert_eq!(r.block_tables.len(), self.groups.len());
            // The state after each row (a model without state: none).
            let mut row_states = Vec::new();
            if let Some(state) = &r.state {
                let s = state.slot;
                let mut st = self.states[s as usize];
                if r.start_pos == 0 {
                    st = 7;
                }
                // A prefix-cache hit starts from the checkpoint of its prefix.
                if let Some(c) = state.restore {
                    assert!(r.start_pos > 0, "a restore starts past a cached prefix");
                    st = self.states[c as usize];
                }
                for (i, &t) in r.token_ids.iter().enumerate() {
                    st = (st ^ t as u64).wrapping_mul(1099511628211);
                    row_states.push(st);
                    if let Some((n, c)) = state.save.filter(|(n, _)| *n == i + 1) {
                        assert_ne!(c, s, "a checkpoint slot is not a running slot");
                        assert!(n <= r.token_ids.len());
                        self.states[c as usize] = st;
                    }
                }
                // A verify step keeps the state after the known token and each draft but
                // the last, for the next step to take a rejected draft back.
                if let Some(first) = state.drafts {
                    assert!(!r.spec.draft.is_empty(), "draft states without a draft");
                    let known = r.token_ids.len() - r.spec.draft.len();
                    for m in known..r.token_ids.len() {
                        let slot = first as usize + m - known;
                        assert_ne!(slot, s as usize, "a draft slot is not a running slot");
                        self.states[slot] = row_states[m - 1];
                    }
                }
                self.states[s as usize] = st;
            }
            for table in &r.block_tables {
                for (i, &t) in r.token_ids.iter().enumerate() {
                    let s = self.slot(table, r.start_pos + i);
                    self.slots[s] = Some(t);
                }
            }
            if r.sample.is_some() {
                let first = r.seq_len() - 1 - r.spec.draft.len();
                let mut drawn = Vec::new();
                for (j, pos) in (first..r.seq_len()).enumerate() {
                    let mut h: u64 = 1469598103934665603;
                    for (g, table) in r.block_tables.iter().enumerate() {
                        for p in self.reads(g, pos) {
                            let t = self.slots[self.slot(table, p)].expect("slot written");
                            h = (h ^ t as u64).wrapping_mul(1099511628211);
                        }
                    }
                    if let Some(st) = row_states.get(pos - r.start_pos) {
                        h ^= st;
                    }
                    let t = (h % self.vocab as u64) as u32;
                    drawn.push(t);
                    if r.spec.draft.get(j) != Some(&t) {
                        break;
                    }
                }
                sampled.insert(r.req_id, drawn);
            }
        }
        sampled
    }

    /// A mock draft model after the step: it feeds what each request's draft run says into
    /// its own pages through the first full-attention group's table (checking that what it
    /// holds before the run is the target's history) and proposes the next token of its
    /// history, wrong one time in four.
    pub fn propose(
        &mut self,
        out: &SchedulerOutput,
        sampled: &HashMap<u64, Vec<u32>>,
    ) -> HashMap<u64, Vec<u32>> {
        let mut proposals = HashMap::new();
        let Some(g) = self.groups.iter().position(Option::is_none) else {
            return proposals;
        };
        for r in &out.requests {
            let Some(run) = &r.spec.draft_run else {
                continue;
            };
            let table = &r.block_tables[g];
            for p in 0..run.start {
                let s = self.slot(table, p);
                assert_eq!(
                    self.draft_slots[s], self.slots[s],
                    "draft K/V at {p} is stale"
                );
            }
            let mut fed = run.catch_up.clone();
            let drawn = sampled.get(&r.req_id);
            let mut propose = 0;
            if run.with_step {
                let rows = drawn.map_or(r.token_ids.len(), |d| {
                    r.token_ids.len() - r.spec.draft.len() - 1 + d.len()
                });
                fed.extend(&r.token_ids[..rows]);
                if let Some(&t) = drawn.and_then(|d| d.last()).filter(|_| run.propose > 0) {
                    fed.push(t);
                    propose = run.propose;
                }
            }
            for (i, &t) in fed.iter().enumerate() {
                let s = self.slot(table, run.start + i);
                self.draft_slots[s] = Some(t);
            }
            let mut pos = run.start + fed.len();
            let mut tokens = Vec::new();
            while tokens.len() < propose {
                let mut h: u64 = 1469598103934665603;
                for p in 0..pos {
                    let t = self.draft_slots[self.slot(table, p)].expect("draft slot written");
                    h = (h ^ t as u64).wrapping_mul(1099511628211);
                }
                let mut t = (h % self.vocab as u64) as u32;
                if (h >> 17).is_multiple_of(4) {
                    t = (t + 1) % self.vocab;
                }
                tokens.push(t);
                if tokens.len() < propose {
                    // The next draft token is fed: its slot must be the request's.
                    let s = self.slot(table, pos);
                    self.draft_slots[s] = Some(t);
                    pos += 1;
                }
            }
            if propose > 0 {
                proposals.insert(r.req_id, tokens);
            }
        }
        proposals
    }
}
