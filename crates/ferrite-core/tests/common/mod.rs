//! A mock model for scheduler tests: it keeps a simulated KV cache of token ids, written and
//! read through the block tables and slots the scheduler hands out, and its next token is a
//! hash of the history it reads back. A block shared by mistake, a wrong table or a lost
//! token changes the output.

use ferrite_core::scheduler::SchedulerOutput;
use std::collections::HashMap;

pub struct MockModel {
    pub slots: Vec<Option<u32>>,
    block_size: usize,
    vocab: u32,
}

impl MockModel {
    pub fn new(num_blocks: usize, block_size: usize, vocab: u32) -> Self {
        Self {
            slots: vec![None; num_blocks * block_size],
            block_size,
            vocab,
        }
    }

    pub fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    pub fn execute(&mut self, out: &SchedulerOutput) -> HashMap<u64, u32> {
        let mut sampled = HashMap::new();
        for r in &out.requests {
            for (i, &t) in r.token_ids.iter().enumerate() {
                let s = self.slot(&r.block_table, r.start_pos + i);
                self.slots[s] = Some(t);
            }
            if r.sample.is_some() {
                let mut h: u64 = 1469598103934665603;
                for pos in 0..r.seq_len() {
                    let t = self.slots[self.slot(&r.block_table, pos)].expect("slot written");
                    h = (h ^ t as u64).wrapping_mul(1099511628211);
                }
                sampled.insert(r.req_id, (h % self.vocab as u64) as u32);
            }
        }
        sampled
    }
}
