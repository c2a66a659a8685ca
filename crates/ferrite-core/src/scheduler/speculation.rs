//! Speculative decoding's side of scheduling: which requests draft, how many tokens, what
//! the draft model or MTP head runs after the step, and the draft-state slots of a model
//! with recurrent state.

use super::Scheduler;
use crate::request::{Request, RequestId};
use crate::spec_decode::{DraftRun, MtpRun, Proposer, Speculation};
use std::collections::HashMap;

impl Scheduler {
    /// Whether `req` speculates this step: speculation is on, the batch is small enough and
    /// nothing about the request changes from token to token inside a window (grammars,
    /// penalties, bans, logprobs).
    pub(super) fn speculates(&self, req: &Request) -> Option<&Speculation> {
        let spec = self.config.speculation.as_ref()?;
        let p = &req.params;
        let plain = req.constraint.is_none()
            && p.logprobs.is_none()
            && !p.has_penalties()
            && p.bad_words.is_empty()
            && req.output_token_ids.len() >= p.min_tokens();
        // With recurrent state only a request with a set of draft-state slots can take a
        // rejected draft back.
        let rolls_back = self.states.is_empty()
            || self.draft_states.slot(req.id).is_some()
            || self.draft_states.num_free() > 0;
        (plain && self.running.len() <= spec.disable_by_batch_size && rolls_back).then_some(spec)
    }

    /// Draft tokens for a decode of `req` (at most `budget`) when it speculates.
    pub(super) fn draft(&self, req: &Request, budget: usize) -> Vec<u32> {
        let Some(spec) = self.speculates(req) else {
            return Vec::new();
        };
        // Each step yields the accepted drafts and one token more.
        let limit = (req
            .max_output_tokens
            .saturating_sub(req.output_token_ids.len() + 1))
        .min(
            self.config
                .max_model_len
                .saturating_sub(req.num_tokens() + 1),
        )
        .min(budget);
        if spec.proposer.runs_after_step() {
            return req.proposed[..limit.min(req.proposed.len())].to_vec();
        }
        let tokens: Vec<u32> = (0..req.num_tokens()).map(|i| req.token_at(i)).collect();
        spec.propose(&tokens, limit)
    }

    /// The draft model's work after this step, per planned request that speculates: it
    /// catches up on what it lacks and proposes for requests that sample, within one step
    /// budget of rows; room for the proposal's K/V comes from free blocks only.
    pub(super) fn draft_runs(
        &mut self,
        planned: &[(RequestId, usize, Vec<u32>)],
    ) -> HashMap<RequestId, DraftRun> {
        let mut runs = HashMap::new();
        let k = match &self.config.speculation {
            Some(Speculation {
                k,
                proposer: Proposer::DraftModel { .. },
                ..
            }) => *k,
            _ => return runs,
        };
        let mut budget = self.config.max_num_batched_tokens;
        for (id, num_new, draft) in planned {
            let req = &self.requests[id];
            if self.speculates(req).is_none() {
                continue;
            }
            let start = req.num_computed_tokens;
            // Ahead by the token it was fed last step at most: that one is fed again.
            let from = req.draft_pos.min(start);
            let catch_up: Vec<u32> = (from..start).map(|i| req.token_at(i)).collect();
            if catch_up.len() + num_new + 1 > budget {
                // Too far behind for this step (speculation paused for a while, or a
                // prefix-cache hit): known tokens only, proposals once it has caught up.
                let n = catch_up.len().min(budget);
                if n > 0 {
                    budget -= n;
                    let catch_up = catch_up[..n].to_vec();
                    runs.insert(
                        *id,
                        DraftRun {
                            start: from,
                            catch_up,
                            with_step: false,
                            propose: 0,
                        },
                    );
                }
                continue;
            }
            let propose = self.room_to_propose(*id, *num_new, draft.len(), k);
            budget -= catch_up.len() + num_new + (propose > 0) as usize;
            runs.insert(
                *id,
                DraftRun {
                    start: from,
                    catch_up,
                    with_step: true,
                    propose,
                },
            );
        }
        runs
    }

    /// Tokens a proposer may draft after this step of `id` (`num_new` rows, `drafted` of
    /// them drafts) for its next one: 0 unless the step samples; within `k`, max_tokens and
    /// the model's length, and the blocks hold them (free blocks only).
    pub(super) fn room_to_propose(
        &mut self,
        id: RequestId,
        num_new: usize,
        drafted: usize,
        k: usize,
    ) -> usize {
        let req = &self.requests[&id];
        let (start, end) = (req.num_computed_tokens, req.num_computed_tokens + num_new);
        if end - drafted != req.num_tokens() {
            return 0;
        }
        let propose = k
            .min(
                req.max_output_tokens
                    .saturating_sub(req.output_token_ids.len() + 2),
            )
            .min(self.config.max_model_len.saturating_sub(end));
        match propose > 0
            && self
                .kv
                .allocate_slots(id, start, end + propose, &Vec::new())
        {
            true => propose,
            false => 0,
        }
    }

    /// The MTP head's work after this step, per planned request that speculates: it runs
    /// over every chunk (its K/V must hold the whole context) and proposes after those that
    /// sample.
    pub(super) fn mtp_runs(
        &mut self,
        planned: &[(RequestId, usize, Vec<u32>)],
    ) -> HashMap<RequestId, MtpRun> {
        let mut runs = HashMap::new();
        let k = match &self.config.speculation {
            Some(Speculation {
                k,
                proposer: Proposer::Mtp,
                ..
            }) => *k,
            _ => return runs,
        };
        for (id, num_new, draft) in planned {
            let req = &self.requests[id];
            if req.pooling || self.speculates(req).is_none() {
                continue;
            }
            let known_end = req.num_computed_tokens + num_new - draft.len();
            let next = (known_end < req.num_tokens()).then(|| req.token_at(known_end));
            let propose = self.room_to_propose(*id, *num_new, draft.len(), k);
            runs.insert(*id, MtpRun { next, propose });
        }
        runs
    }

    /// Gives back what a request holds for speculation on a model with recurrent state.
    pub(super) fn release_draft_states(&mut self, id: RequestId) {
        self.draft_states.release(id);
        self.rollbacks.remove(&id);
    }

    /// The draft model's proposals after a step, each for its request's next decode.
    pub fn set_proposals(&mut self, proposals: HashMap<RequestId, Vec<u32>>) {
        for (id, tokens) in proposals {
            if let Some(req) = self.requests.get_mut(&id) {
                req.proposed = tokens;
            }
        }
    }
}
