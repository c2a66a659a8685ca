//! Speculation with the target's multi-token-prediction head (Qwen3-Next, Qwen3.5): right
//! after the target's step, the head runs over the rows of every request that speculates,
//! each row's token moved one ahead (the next prompt token, the accepted drafts, the token
//! sampled after them), reading the target's hidden states where the step left them. It
//! runs over prefill chunks too, so that its K/V hold the whole context. The row of the last
//! accepted token gives the first draft; each further draft is one more pass of the head
//! over its own hidden state, one row per proposing request (as vLLM chains it).

use crate::draft::{draft_on, Proposing};
use crate::sampler::argmax;
use crate::step::PackedStep;
use crate::step::StepModel;
use anyhow::Result;
use ferrite_core::output::SampledToken;
use ferrite_core::request::RequestId;
use ferrite_core::scheduler::SchedulerOutput;
use std::collections::HashMap;

/// Runs the head after the target's step `target` (packed from `out`, one sequence per
/// request in order) drew `sampled`; returns each proposing request's draft.
pub fn propose(
    model: &mut dyn StepModel,
    out: &SchedulerOutput,
    target: &PackedStep,
    sampled: &HashMap<RequestId, Vec<SampledToken>>,
    block_size: usize,
) -> Result<HashMap<RequestId, Vec<u32>>> {
    let mut step = PackedStep::default();
    let mut live = Vec::new();
    for (i, r) in out.requests.iter().enumerate() {
        let Some(run) = &r.spec.mtp_run else {
            continue;
        };
        let drawn = sampled.get(&r.req_id);
        // The rows whose hidden state holds: after a verify, the last known token's and the
        // accepted drafts' (a rejected draft's row is not the request's text).
        let valid = match drawn {
            Some(d) if !r.spec.draft.is_empty() => {
                r.token_ids.len() - r.spec.draft.len() + d.len() - 1
            }
            _ => r.token_ids.len(),
        };
        let next = match (run.next, drawn.and_then(|d| d.last())) {
            (Some(t), _) => t,
            (None, Some(t)) => t.token_id,
            (None, None) => continue, // its sampling failed
        };
        let mut tokens = r.token_ids[1..valid].to_vec();
        tokens.push(next);
        step.push(&tokens, r.start_pos, &r.block_tables, block_size);
        let state_slot = r.state.map(|st| st.slot);
        step.state.slots.extend(state_slot);
        let first = target.cu_seqlens_q[i];
        step.hidden.rows.extend(first..first + valid as u32);
        if run.propose > 0 {
            let row = step.num_tokens() as u32 - 1;
            step.logits_indices.push(row);
            live.push(Proposing {
                id: r.req_id,
                tables: r.block_tables.clone(),
                state_slot,
                // The row's position is the sampled token's minus one: the next pass feeds
                // the first draft one position on.
                next_pos: r.start_pos + valid,
                row,
                left: run.propose,
                tokens: Vec::with_capacity(run.propose),
            });
        }
    }
    if step.num_tokens() == 0 {
        return Ok(HashMap::new());
    }
    step.finish();
    let vocab = model.vocab_size();
    let drawn = model.forward_mtp(&step, false)?;
    let drawn = drawn.chunks(vocab).map(argmax).collect();
    draft_on(live, drawn, block_size, |s| {
        Ok(model
            .forward_mtp(s, true)?
            .chunks(vocab)
            .map(argmax)
            .collect())
    })
}
