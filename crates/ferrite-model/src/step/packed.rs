//! One engine step flattened onto a single token axis, as the model consumes it.

use serde::{Deserialize, Serialize};

/// A KV group's view of the step (see `ferrite_core::kv_layout`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct KvTables {
    /// `[B, max_blocks]`, row-major, unused entries 0; blocks a window dropped are
    /// `u32::MAX` (never read: they are outside every query's window).
    pub block_tables: Vec<u32>,
    pub max_blocks: usize,
    /// `[T]`: cache slot (`block * block_size + offset`) of each new token.
    pub slot_mapping: Vec<u32>,
    /// Per request, its table's length, until `finish` lays them out.
    row_lens: Vec<usize>,
}

/// No padding anywhere: `T` is the sum of every request's new tokens this step.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PackedStep {
    /// `[T]`
    pub input_ids: Vec<u32>,
    /// `[T]`: each token's own position in its request.
    pub positions: Vec<u32>,
    /// `[B + 1]`
    pub cu_seqlens_q: Vec<u32>,
    /// `[B]`: K/V length after this step.
    pub seq_lens_k: Vec<u32>,
    /// One per KV group.
    pub kv: Vec<KvTables>,
    /// Rows whose logits are needed (sampled tokens, prompt logprobs).
    pub logits_indices: Vec<u32>,
    /// The requests' recurrent states (models with linear-attention layers).
    pub state: StepState,
    /// Hidden states kept for, or read by, an MTP head.
    pub hidden: StepHidden,
    /// An embedding or cross-encoder step.
    pub pooling: StepPooling,
}

/// The recurrent states a step reads and writes, per request (empty: the model has no
/// linear-attention layers).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StepState {
    /// `[B]`: each request's state slot. A request whose chunk starts at position 0 starts
    /// its state over.
    pub slots: Vec<u32>,
    /// `[B]` beside `slots` (or empty: none): a checkpoint slot whose state the request
    /// starts from (a prefix-cache hit), or [`NO_SLOT`].
    pub restores: Vec<u32>,
    /// `[B]` beside `slots` (or empty: none): `[n, slot]`, the state after the chunk's first
    /// `n` tokens written into checkpoint `slot`, or `[0, NO_SLOT]`.
    pub saves: Vec<[u32; 2]>,
    /// `[B]` beside `slots` (or empty: none): `[n, first]`, the state after each of the
    /// chunk's tokens from the `n`-th on, but the last, written into slots `first`,
    /// `first + 1`, ... (a verify step: the state after each accepted-draft count), or
    /// `[0, NO_SLOT]`.
    pub drafts: Vec<[u32; 2]>,
}

/// The hidden states an MTP head continues from.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StepHidden {
    /// An MTP head's step: the row of the previous step's hidden states each row continues
    /// from (empty: the same rows).
    pub rows: Vec<u32>,
    /// An MTP head reads this step's hidden states after it: a backend that drops its
    /// activations keeps them, and the step runs eagerly (no captured graph).
    pub keep: bool,
}

/// What an encoder's step needs beyond the tokens.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StepPooling {
    /// The `logits_indices` rows' hidden states are the output, not logits.
    pub on: bool,
    /// `[T]` each token's segment (pair inputs of cross-encoders); empty: all 0.
    pub token_types: Vec<u32>,
}

/// No state slot (see [`StepState::restores`]).
pub const NO_SLOT: u32 = u32::MAX;

impl PackedStep {
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.seq_lens_k.len()
    }

    /// Whether some request restores or checkpoints its recurrent state this step.
    pub fn moves_state(&self) -> bool {
        let s = &self.state;
        s.restores.iter().any(|&r| r != NO_SLOT)
            || s.saves.iter().any(|s| s[1] != NO_SLOT)
            || s.drafts.iter().any(|s| s[1] != NO_SLOT)
    }

    /// Positions and token ids within what a model of `max_positions` positions and a
    /// vocabulary of `vocab` serves.
    pub fn check(&self, max_positions: usize, vocab: usize) -> anyhow::Result<()> {
        if let Some(&p) = self.positions.iter().max() {
            if p as usize >= max_positions {
                anyhow::bail!("position {p} is beyond the model's {max_positions} positions");
            }
        }
        if let Some(&id) = self.input_ids.iter().find(|&&id| id as usize >= vocab) {
            anyhow::bail!("token id {id} is outside the vocabulary of {vocab}");
        }
        Ok(())
    }

    /// Appends one request's chunk: `tokens` at positions `start..`, K/V in `tables` (one
    /// per KV group).
    pub fn push(&mut self, tokens: &[u32], start: usize, tables: &[Vec<u32>], block_size: usize) {
        if self.cu_seqlens_q.is_empty() {
            self.cu_seqlens_q.push(0);
        }
        if self.kv.is_empty() {
            self.kv = vec![KvTables::default(); tables.len()];
        }
        assert_eq!(self.kv.len(), tables.len(), "one block table per KV group");
        for (i, &tok) in tokens.iter().enumerate() {
            self.input_ids.push(tok);
            self.positions.push((start + i) as u32);
        }
        for (kv, blocks) in self.kv.iter_mut().zip(tables) {
            for pos in start..start + tokens.len() {
                let block = blocks[pos / block_size];
                kv.slot_mapping
                    .push(block * block_size as u32 + (pos % block_size) as u32);
            }
            // Stored ragged until `finish` pads them to one width.
            kv.block_tables.extend_from_slice(blocks);
            kv.row_lens.push(blocks.len());
        }
        self.cu_seqlens_q.push(self.input_ids.len() as u32);
        self.seq_lens_k.push((start + tokens.len()) as u32);
    }

    /// The start-up profiling step: one request of `tokens` prompt tokens in blocks
    /// `0..` of every one of `groups` KV groups, its last row sampled.
    pub fn profile(tokens: usize, block_size: usize, vocab_size: usize, groups: usize) -> Self {
        let mut step = Self::default();
        let ids: Vec<u32> = (0..tokens as u32).map(|i| i % vocab_size as u32).collect();
        let table: Vec<u32> = (0..tokens.div_ceil(block_size) as u32).collect();
        step.push(&ids, 0, &vec![table; groups.max(1)], block_size);
        step.logits_indices.push(tokens as u32 - 1);
        step.state.slots.push(0);
        step.finish();
        step
    }

    /// Lays the block tables out as `[B, max_blocks]`.
    pub fn finish(&mut self) {
        for kv in &mut self.kv {
            let width = kv.row_lens.iter().copied().max().unwrap_or(0);
            let mut table = vec![0u32; kv.row_lens.len() * width];
            let mut at = 0;
            for (i, &n) in kv.row_lens.iter().enumerate() {
                table[i * width..i * width + n].copy_from_slice(&kv.block_tables[at..at + n]);
                at += n;
            }
            kv.block_tables = table;
            kv.max_blocks = width;
            kv.row_lens.clear();
        }
    }

    /// The step's requests cut into at most `n` consecutive runs of about equal tokens (a
    /// pipeline's micro-batches); each a step of its own whose logits rows, in order, are
    /// this step's.
    pub fn micro_batches(&self, n: usize) -> Vec<PackedStep> {
        let (seqs, tokens) = (self.num_seqs(), self.num_tokens());
        let n = n.min(seqs).max(1);
        if n == 1 {
            return vec![self.clone()];
        }
        let mut cuts = vec![0];
        for i in 1..seqs {
            let done = cuts.len() * tokens / n;
            if self.cu_seqlens_q[i] as usize >= done && cuts.len() < n {
                cuts.push(i);
            }
        }
        cuts.push(seqs);
        cuts.windows(2).map(|w| self.requests(w[0]..w[1])).collect()
    }

    /// Requests `r` of this (finished) step as a step of their own.
    fn requests(&self, r: std::ops::Range<usize>) -> PackedStep {
        let t = self.cu_seqlens_q[r.start] as usize..self.cu_seqlens_q[r.end] as usize;
        let per_seq = |v: &[u32]| match v.is_empty() {
            true => Vec::new(),
            false => v[r.clone()].to_vec(),
        };
        let per_token = |v: &[u32]| match v.is_empty() {
            true => Vec::new(),
            false => v[t.clone()].to_vec(),
        };
        let pairs = |v: &[[u32; 2]]| match v.is_empty() {
            true => Vec::new(),
            false => v[r.clone()].to_vec(),
        };
        assert!(self.hidden.rows.is_empty(), "an MTP step is not cut");
        PackedStep {
            input_ids: per_token(&self.input_ids),
            positions: per_token(&self.positions),
            cu_seqlens_q: self.cu_seqlens_q[r.start..=r.end]
                .iter()
                .map(|&c| c - t.start as u32)
                .collect(),
            seq_lens_k: per_seq(&self.seq_lens_k),
            kv: self
                .kv
                .iter()
                .map(|kv| KvTables {
                    block_tables: kv.block_tables[r.start * kv.max_blocks..r.end * kv.max_blocks]
                        .to_vec(),
                    max_blocks: kv.max_blocks,
                    slot_mapping: per_token(&kv.slot_mapping),
                    row_lens: Vec::new(),
                })
                .collect(),
            logits_indices: self
                .logits_indices
                .iter()
                .filter(|&&i| t.contains(&(i as usize)))
                .map(|&i| i - t.start as u32)
                .collect(),
            state: StepState {
                slots: per_seq(&self.state.slots),
                restores: per_seq(&self.state.restores),
                saves: pairs(&self.state.saves),
                drafts: pairs(&self.state.drafts),
            },
            hidden: StepHidden {
                rows: Vec::new(),
                keep: self.hidden.keep,
            },
            pooling: StepPooling {
                on: self.pooling.on,
                token_types: per_token(&self.pooling.token_types),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_hold_every_request_and_logits_row_once_in_order() {
        let mut step = PackedStep::default();
        let tables = [vec![0u32, 1, 2]];
        for (len, start) in [(30, 0), (1, 17), (5, 3), (1, 40), (12, 0)] {
            step.push(&vec![7; len], start, &tables, 16);
            step.logits_indices.push(step.num_tokens() as u32 - 1);
        }
        step.finish();
        let parts = step.micro_batches(3);
        assert_eq!(parts.len(), 3);
        let ids: Vec<u32> = parts.iter().flat_map(|p| p.input_ids.clone()).collect();
        assert_eq!(ids, step.input_ids);
        let mut offset = 0;
        let mut rows = Vec::new();
        for p in &parts {
            assert_eq!(p.cu_seqlens_q[0], 0);
            assert_eq!(*p.cu_seqlens_q.last().unwrap() as usize, p.num_tokens());
            assert_eq!(p.kv[0].block_tables.len(), p.num_seqs() * 3);
            rows.extend(p.logits_indices.iter().map(|&i| i + offset));
            offset += p.num_tokens() as u32;
        }
        assert_eq!(rows, step.logits_indices);
        let seqs: Vec<u32> = parts.iter().flat_map(|p| p.seq_lens_k.clone()).collect();
        assert_eq!(seqs, step.seq_lens_k);
    }
}
