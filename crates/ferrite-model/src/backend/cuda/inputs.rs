//! A step's index arrays on the device (see [`PackedStep`]), and the attention launch
//! parameters of each KV group they imply.

use super::kernels::attention::AttentionMeta;
use crate::step::{PackedStep, NO_SLOT};
use anyhow::Result;
use candle_core::{Device, Tensor};

/// One KV group's slots and block tables.
pub struct GroupInputs {
    pub slots: Tensor,
    /// `[num_seqs, max_blocks]`
    pub block_tables: Tensor,
    pub max_blocks: usize,
}

pub struct StepInputs {
    pub ids: Tensor,
    pub positions: Tensor,
    pub cu_seqlens_q: Tensor,
    pub seq_lens_k: Tensor,
    /// The rows that need logits.
    pub rows: Tensor,
    /// Each request's recurrent-state slot (models with linear-attention layers).
    pub state_slots: Tensor,
    /// When a request restores, checkpoints or verifies drafts with its state this step.
    pub state_moves: Option<StateMoves>,
    pub groups: Vec<GroupInputs>,
    pub num_seqs: usize,
    pub num_tokens: usize,
    /// Most tokens of one request.
    pub max_query_len: usize,
    /// Longest K/V length, or the longest the inputs may ever hold (graphs).
    pub max_seq_len: usize,
    /// Fixed attention splits (graphs); `None`: chosen from the shape.
    pub splits: Option<usize>,
}

/// Per request (see `PackedStep`): the slot its state starts from, `[n, slot]` it checkpoints,
/// and `[n, first]` of the drafts it verifies (`None`: no request has drafts).
pub struct StateMoves {
    pub restores: Tensor,
    pub saves: Tensor,
    pub drafts: Option<Tensor>,
}

pub fn u32s(v: &[u32], dev: &Device) -> Result<Tensor> {
    // A kernel argument may not be empty: a zero-length table still gets one element.
    let v = if v.is_empty() { &[0][..] } else { v };
    Ok(Tensor::from_slice(v, v.len(), dev)?)
}

impl StepInputs {
    /// Copies the step's index arrays to the device.
    pub fn upload(step: &PackedStep, dev: &Device) -> Result<Self> {
        let groups = step
            .kv
            .iter()
            .map(|kv| {
                Ok(GroupInputs {
                    slots: u32s(&kv.slot_mapping, dev)?,
                    block_tables: u32s(&kv.block_tables, dev)?,
                    max_blocks: kv.max_blocks,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            ids: u32s(&step.input_ids, dev)?,
            positions: u32s(&step.positions, dev)?,
            cu_seqlens_q: u32s(&step.cu_seqlens_q, dev)?,
            seq_lens_k: u32s(&step.seq_lens_k, dev)?,
            rows: u32s(&step.logits_indices, dev)?,
            state_slots: u32s(&step.state.slots, dev)?,
            state_moves: match step.moves_state() {
                true => {
                    let saves: Vec<u32> = step.state.saves.iter().flatten().copied().collect();
                    let drafts = match step.state.drafts.iter().any(|d| d[1] != NO_SLOT) {
                        true => {
                            let d: Vec<u32> = step.state.drafts.iter().flatten().copied().collect();
                            Some(u32s(&d, dev)?)
                        }
                        false => None,
                    };
                    Some(StateMoves {
                        restores: u32s(&step.state.restores, dev)?,
                        saves: u32s(&saves, dev)?,
                        drafts,
                    })
                }
                false => None,
            },
            groups,
            num_seqs: step.num_seqs(),
            num_tokens: step.num_tokens(),
            max_query_len: step
                .cu_seqlens_q
                .windows(2)
                .map(|w| (w[1] - w[0]) as usize)
                .max()
                .unwrap_or(0),
            max_seq_len: step.seq_lens_k.iter().copied().max().unwrap_or(0) as usize,
            splits: None,
        })
    }

    /// Attention over KV group `group`.
    pub fn meta(&self, group: usize) -> AttentionMeta<'_> {
        let g = &self.groups[group];
        AttentionMeta {
            cu_seqlens_q: &self.cu_seqlens_q,
            seq_lens_k: &self.seq_lens_k,
            block_tables: &g.block_tables,
            max_blocks: g.max_blocks,
            num_seqs: self.num_seqs,
            num_tokens: self.num_tokens,
            max_seq_len: self.max_seq_len,
            splits: self.splits,
        }
    }
}
