//! A step's index arrays (see [`PackedStep`]) in one buffer of u32 words: each kernel gets
//! the offsets of the arrays it reads.

use super::device::Gpu;
use super::tensors::write_kept;
use crate::step::PackedStep;
use anyhow::Result;

/// An array the step does not have.
pub const NONE: u32 = u32::MAX;

/// One KV group's slots and block tables, as offsets into the step's words.
pub struct GroupAt {
    pub slots: u32,
    pub tables: u32,
    pub max_blocks: u32,
}

pub struct StepInputs {
    pub buf: wgpu::Buffer,
    pub ids: u32,
    pub positions: u32,
    pub cu_seqlens_q: u32,
    pub seq_lens_k: u32,
    /// The rows that need logits.
    pub rows: u32,
    pub groups: Vec<GroupAt>,
    /// The recurrent states' slots, restores, saves and drafts (`[n, slot]` pairs);
    /// [`NONE`] where the step has none.
    pub state: [u32; 4],
    pub num_seqs: usize,
    pub num_tokens: usize,
}

impl StepInputs {
    /// Written into `kept` (grown when the step needs more): a buffer bound the same way
    /// every step keeps its bind groups.
    pub fn upload(gpu: &Gpu, step: &PackedStep, kept: &mut Option<wgpu::Buffer>) -> Result<Self> {
        let mut words = Vec::new();
        let mut put = |a: &[u32]| {
            let at = words.len() as u32;
            words.extend_from_slice(a);
            at
        };
        let ids = put(&step.input_ids);
        let positions = put(&step.positions);
        let cu_seqlens_q = put(&step.cu_seqlens_q);
        let seq_lens_k = put(&step.seq_lens_k);
        let rows = put(&step.logits_indices);
        let groups = step
            .kv
            .iter()
            .map(|kv| GroupAt {
                slots: put(&kv.slot_mapping),
                tables: put(&kv.block_tables),
                max_blocks: kv.max_blocks as u32,
            })
            .collect();
        let mut put_some = |a: &[u32]| if a.is_empty() { NONE } else { put(a) };
        let st = &step.state;
        let state = [
            put_some(&st.slots),
            put_some(&st.restores),
            put_some(st.saves.as_flattened()),
            put_some(st.drafts.as_flattened()),
        ];
        let buf = write_kept(gpu, "step inputs", kept, &words)?;
        Ok(Self {
            buf,
            ids,
            positions,
            cu_seqlens_q,
            seq_lens_k,
            rows,
            groups,
            state,
            num_seqs: step.num_seqs(),
            num_tokens: step.num_tokens(),
        })
    }
}
