//! Speculation with a draft model: after the target's step, a smaller model with the same
//! tokenizer catches up on the tokens the step accepted and proposes the next step's drafts.
//! Its K/V live in its own pages of the request's blocks (the target's table), so it needs no
//! blocks of its own; every request's catch-up is one packed step, and each further draft
//! token one decode step over all proposing requests.

use crate::backend::Backend;
use crate::models::Model;
use crate::step::PackedStep;
use crate::step::StepModel;
use crate::tokenizer::ModelTokenizer;
use anyhow::{bail, Result};
use ferrite_core::output::SampledToken;
use ferrite_core::request::RequestId;
use ferrite_core::scheduler::{ScheduledRequest, SchedulerOutput};
use std::collections::HashMap;

/// Refuses a draft model whose tokens are not the target's, or that cannot share its blocks.
pub fn check_pair<B: Backend>(
    target: &Model<B>,
    target_tokenizer: &ModelTokenizer,
    draft: &Model<B>,
    draft_tokenizer: &ModelTokenizer,
) -> Result<()> {
    let (t, d) = (&target.config, &draft.config);
    if t.vocab_size != d.vocab_size
        || target_tokenizer.tokenizer.get_vocab(true) != draft_tokenizer.tokenizer.get_vocab(true)
    {
        bail!(
            "the draft model's tokenizer is not the target's ({} and {} tokens): a draft model must share the target's vocabulary",
            d.vocab_size,
            t.vocab_size
        );
    }
    if draft.state_bytes_per_slot() > 0 {
        bail!("the draft model has linear-attention layers, whose state cannot take back a rejected draft");
    }
    if full_group(target).is_none() {
        bail!("a draft model needs a target with a full-attention layer: its K/V follow that layer's block table");
    }
    if draft.max_positions() < target.max_positions() {
        bail!(
            "the draft model serves {} positions, fewer than the target's {} (--max-model-len)",
            draft.max_positions(),
            target.max_positions()
        );
    }
    Ok(())
}

/// The target's first KV group that keeps every block.
fn full_group<B: Backend>(target: &Model<B>) -> Option<usize> {
    target.layout.groups.iter().position(Option::is_none)
}

pub struct DraftModel {
    model: Box<dyn StepModel>,
    /// The target's KV group whose table the draft model reads: one that keeps every block.
    group: usize,
    /// The draft model's own KV groups: each reads that one table.
    draft_groups: usize,
    block_size: usize,
}

/// A request still drafting: where its next draft token goes and what it has proposed.
pub(crate) struct Proposing {
    pub id: RequestId,
    pub tables: Vec<Vec<u32>>,
    /// Its recurrent-state slot (a model with linear-attention layers).
    pub state_slot: Option<u32>,
    pub next_pos: usize,
    /// Its row in the last pass.
    pub row: u32,
    pub left: usize,
    pub tokens: Vec<u32>,
}

/// Drafts for every request in `live` (in the order of the first pass's rows, which drew
/// `drawn`): each further pass feeds every request still drafting its last draft token at
/// its next position, one row each, and `pass` draws one token per row.
pub(crate) fn draft_on(
    mut live: Vec<Proposing>,
    mut drawn: Vec<u32>,
    block_size: usize,
    mut pass: impl FnMut(&PackedStep) -> Result<Vec<u32>>,
) -> Result<HashMap<RequestId, Vec<u32>>> {
    let mut proposals = HashMap::new();
    loop {
        for (p, t) in live.iter_mut().zip(drawn) {
            p.tokens.push(t);
            p.left -= 1;
        }
        let (done, drafting): (Vec<_>, Vec<_>) = live.into_iter().partition(|p| p.left == 0);
        proposals.extend(done.into_iter().map(|p| (p.id, p.tokens)));
        live = drafting;
        if live.is_empty() {
            return Ok(proposals);
        }
        let mut step = PackedStep::default();
        for (row, p) in live.iter_mut().enumerate() {
            let last = *p.tokens.last().expect("drafted above");
            step.push(&[last], p.next_pos, &p.tables, block_size);
            step.state.slots.extend(p.state_slot);
            step.hidden.rows.push(p.row);
            step.logits_indices.push(row as u32);
            p.next_pos += 1;
            p.row = row as u32;
        }
        step.finish();
        drawn = pass(&step)?;
    }
}

impl DraftModel {
    /// `draft` proposing for `target` (checked by [`check_pair`]), its cache allocated.
    pub fn beside<B: Backend + 'static>(
        target: &Model<B>,
        draft: Model<B>,
        block_size: usize,
    ) -> Self {
        Self {
            group: full_group(target).expect("checked by check_pair"),
            draft_groups: draft.layout.groups.len(),
            model: Box::new(draft),
            block_size,
        }
    }

    pub fn describe(&self) -> String {
        self.model.describe()
    }

    /// The tokens the draft model is fed for `r` after its step, and how many it proposes
    /// (`None`: nothing to run).
    fn feed(
        r: &ScheduledRequest,
        sampled: &HashMap<RequestId, Vec<SampledToken>>,
    ) -> Option<(Vec<u32>, usize)> {
        let run = r.spec.draft_run.as_ref()?;
        let mut tokens = run.catch_up.clone();
        let mut propose = 0;
        if run.with_step {
            let drawn = sampled.get(&r.req_id);
            if r.sample.is_some() && drawn.is_none() {
                return None; // the request failed in sampling
            }
            // The known token and the accepted drafts; a rejected draft's rows are not fed.
            let rows = drawn.map_or(r.token_ids.len(), |d| {
                let drafts = r.spec.draft.len();
                r.token_ids.len() - drafts - 1 + d.len().min(drafts + 1)
            });
            tokens.extend(&r.token_ids[..rows]);
            if let Some(t) = drawn.and_then(|d| d.last()).filter(|_| run.propose > 0) {
                tokens.push(t.token_id);
                propose = run.propose;
            }
        }
        (!tokens.is_empty()).then_some((tokens, propose))
    }

    /// Runs the draft model after the target's step `out` drew `sampled`; returns each
    /// proposing request's draft for its next step.
    pub fn propose(
        &mut self,
        out: &SchedulerOutput,
        sampled: &HashMap<RequestId, Vec<SampledToken>>,
    ) -> Result<HashMap<RequestId, Vec<u32>>> {
        let bs = self.block_size;
        let mut step = PackedStep::default();
        let mut live = Vec::new();
        for r in &out.requests {
            let Some((tokens, propose)) = Self::feed(r, sampled) else {
                continue;
            };
            let start = r.spec.draft_run.as_ref().map_or(0, |d| d.start);
            let tables = vec![r.block_tables[self.group].clone(); self.draft_groups];
            step.push(&tokens, start, &tables, bs);
            if propose > 0 {
                step.logits_indices.push(step.num_tokens() as u32 - 1);
                live.push(Proposing {
                    id: r.req_id,
                    tables,
                    state_slot: None,
                    next_pos: start + tokens.len(),
                    row: 0,
                    left: propose,
                    tokens: Vec::with_capacity(propose),
                });
            }
        }
        if step.num_tokens() == 0 {
            return Ok(HashMap::new());
        }
        step.finish();
        if live.is_empty() {
            // Catching up only: K/V written, no row's logits wanted.
            self.model.forward(&step)?;
            return Ok(HashMap::new());
        }
        let drawn = self.model.forward_argmax(&step)?;
        // Each draft token is fed to draft the next one.
        let model = &mut self.model;
        draft_on(live, drawn, bs, |s| model.forward_argmax(s))
    }
}
