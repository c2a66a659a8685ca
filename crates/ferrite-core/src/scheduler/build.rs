//! Building a step: decodes first, then running prefills cut to the step's time target,
//! then waiting requests admitted FCFS; each planned request's inputs.

use super::*;
use crate::kv_cache_manager::BlockTables;
use crate::prefix_hash::BlockHash;

/// The step being built: the token budget left, what is planned, who was preempted.
struct StepPlan {
    budget: usize,
    /// (request, tokens this step, its draft).
    planned: Vec<(RequestId, usize, Vec<u32>)>,
    preempted: Vec<RequestId>,
    /// What the step holds so far, decodes first.
    shape: StepShape,
    timed: TimedStep,
}

/// What a step being built has spent of its time target.
#[derive(Default)]
struct TimedStep {
    /// It holds decodes: prefill chunks are cut to the target.
    decodes: bool,
    /// Its decodes alone.
    decode_shape: StepShape,
    /// The one chunk of [`MIN_PREFILL_CHUNK`] past the target was given.
    floor: bool,
}

impl Scheduler {
    /// Builds the next step. Running requests first (decodes and unfinished prefills, in
    /// admission order), then waiting requests FCFS while budget, seats and blocks allow.
    pub fn schedule(&mut self) -> SchedulerOutput {
        // Checkpoints a step wrote count once `update` saw it run.
        self.checkpoints.abandon();
        self.restores.clear();
        let mut plan = StepPlan {
            budget: self.config.max_num_batched_tokens,
            planned: Vec::new(),
            preempted: Vec::new(),
            shape: StepShape::default(),
            timed: TimedStep::default(),
        };
        // Decodes come first in the step's time: prefill chunks get what they leave.
        for id in &self.running {
            let r = &self.requests[id];
            if r.num_tokens() - r.num_computed_tokens == 1 {
                plan.shape.add_chunk(r.num_computed_tokens, 1);
                plan.timed.decodes = true;
            }
        }
        plan.timed.decode_shape = plan.shape;
        self.schedule_running(&mut plan);
        // vLLM V1 admits nothing new in a step that had to preempt.
        if plan.preempted.is_empty() {
            self.admit_waiting(&mut plan);
        }
        // A checkpoint this step restores is not overwritten by one it writes.
        let busy: Vec<StateSlot> = self.restores.values().copied().collect();
        let mut runs = self.draft_runs(&plan.planned);
        let mut mtp_runs = self.mtp_runs(&plan.planned);
        let requests = plan
            .planned
            .into_iter()
            .map(|(id, n, draft)| {
                let run = runs.remove(&id);
                let mut r = self.scheduled_request(id, n, draft, run, &busy);
                r.spec.mtp_run = mtp_runs.remove(&id);
                r
            })
            .collect();
        SchedulerOutput {
            requests,
            num_batched_tokens: self.config.max_num_batched_tokens - plan.budget,
            preempted: plan.preempted,
        }
    }

    /// The running requests' next tokens (and drafts), in admission order; blocks short,
    /// the newest running request is preempted.
    fn schedule_running(&mut self, plan: &mut StepPlan) {
        let mut i = 0;
        while i < self.running.len() && plan.budget > 0 {
            let id = self.running[i];
            let req = &self.requests[&id];
            let left = req.num_tokens() - req.num_computed_tokens;
            let mut num_new = left.min(plan.budget);
            if left > 1 {
                let start = req.num_computed_tokens;
                num_new = self.timed_chunk(&plan.shape, &mut plan.timed, start, num_new);
                if num_new == 0 {
                    i += 1; // this prefill waits for a step with time left
                    continue;
                }
                plan.shape.add_chunk(start, num_new);
            }
            let draft = self.room_for_draft(id, num_new, plan.budget);
            let next = self.requests[&id].num_computed_tokens;
            let num_new = num_new + draft.len();
            let mut scheduled = true;
            while !self
                .kv
                .allocate_slots(id, next, next + num_new, &Vec::new())
            {
                // Preempt the newest running request; if that is this one, it waits.
                let victim = self.running.pop().expect("running is not empty");
                self.preempt(victim);
                plan.preempted.push(victim);
                if victim == id {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            plan.planned.push((id, num_new, draft));
            plan.budget -= num_new;
            i += 1;
        }
    }

    /// The draft a decoding request verifies beside its `num_new` tokens: none when it is
    /// not decoding, when recurrent state has no set of slots to take back, or when its
    /// blocks do not fit (a draft never costs another request its blocks).
    fn room_for_draft(&mut self, id: RequestId, num_new: usize, budget: usize) -> Vec<u32> {
        let req = &self.requests[&id];
        let next = req.num_computed_tokens;
        let mut draft = match req.num_tokens() - next {
            1 => self.draft(req, budget - 1),
            _ => Vec::new(),
        };
        if !draft.is_empty() && !self.states.is_empty() && self.draft_states.acquire(id).is_none() {
            draft.clear();
        }
        if !draft.is_empty()
            && !self
                .kv
                .allocate_slots(id, next, next + num_new + draft.len(), &Vec::new())
        {
            draft.clear();
        }
        draft
    }

    /// Waiting requests, first come first served, while budget, seats, state slots and
    /// blocks allow; the head of the queue waits rather than be overtaken.
    fn admit_waiting(&mut self, plan: &mut StepPlan) {
        while let Some(&id) = self.waiting.front() {
            if plan.budget == 0 || self.running.len() >= self.config.max_num_seqs {
                break;
            }
            if !self.states.is_empty() && self.states.num_free() == 0 {
                break;
            }
            let (hit, restore) = self.cached_start(id);
            let req = &self.requests[&id];
            let computed = hit[0].len() * self.config.block_size;
            let mut num_new = (req.num_tokens() - computed).min(plan.budget);
            if self.config.whole_prompts && num_new < req.num_tokens() - computed {
                break; // waits for a step with room for all of it
            }
            if !self.config.whole_prompts {
                num_new = self.timed_chunk(&plan.shape, &mut plan.timed, computed, num_new);
                if num_new == 0 {
                    break; // FCFS: it waits for a step with time left
                }
            }
            if !self
                .kv
                .allocate_slots(id, computed, computed + num_new, &hit)
            {
                break; // FCFS: the head of the queue waits for blocks, nobody overtakes it
            }
            self.waiting.pop_front();
            if !self.states.is_empty() {
                self.states.acquire(id).expect("a slot is free");
            }
            if let Some((slot, hash)) = restore.filter(|_| computed > 0) {
                self.checkpoints.lookup(&hash);
                self.restores.insert(id, slot);
            }
            let req = self.requests.get_mut(&id).unwrap();
            self.kv.note_prefix_lookup(req.num_tokens(), computed);
            req.num_computed_tokens = computed;
            req.status = RequestStatus::Running;
            self.running.push(id);
            plan.planned.push((id, num_new, Vec::new()));
            plan.shape.add_chunk(computed, num_new);
            plan.budget -= num_new;
        }
    }

    /// A new (or preempted) request's longest cached prefix; with recurrent state, only as
    /// deep as a checkpoint of the state reaches, and that checkpoint (slot, block hash).
    fn cached_start(&mut self, id: RequestId) -> (BlockTables, Option<(StateSlot, BlockHash)>) {
        let req = &self.requests[&id];
        let mut hit = self.kv.find_cached_prefix(req);
        if self.states.is_empty() {
            return (hit, None);
        }
        let n = hit[0].len();
        let deepest = (1..=n).rev().find_map(|k| {
            let hash = self.kv.block_hash(req, k - 1)?;
            self.checkpoints.peek(&hash).map(|slot| (k, slot, hash))
        });
        let k = deepest.map_or(0, |d| d.0);
        if k < n {
            hit = self.kv.find_cached_prefix_within(req, k);
        }
        (hit, deepest.map(|(_, slot, hash)| (slot, hash)))
    }

    /// A prefill chunk of at most `n` tokens after `start` cached ones, cut to the step-time
    /// target when the step has decodes (`shape`: what the step holds so far, decodes first);
    /// 0: it waits. A step whose decodes leave no time still takes one chunk of
    /// [`MIN_PREFILL_CHUNK`] (`floor`: whether one was given).
    fn timed_chunk(&self, shape: &StepShape, t: &mut TimedStep, start: usize, n: usize) -> usize {
        let Some(st) = self.step_time.as_ref().filter(|_| t.decodes) else {
            return n;
        };
        let target = match st.target {
            StepTarget::Fixed(secs) => secs,
            StepTarget::Relative { factor, floor_secs } => {
                (factor * st.cost.predict(t.decode_shape)).max(floor_secs)
            }
        };
        let chunk = st.cost.chunk_within(*shape, start, n, target);
        tracing::trace!(
            "decodes {:.1} ms predicted, target {:.1} ms: a chunk of {chunk} of {n} tokens",
            st.cost.predict(t.decode_shape) * 1e3,
            target * 1e3
        );
        match chunk {
            0 if !t.floor => {
                t.floor = true;
                n.min(MIN_PREFILL_CHUNK)
            }
            c => c,
        }
    }

    fn scheduled_request(
        &mut self,
        id: RequestId,
        num_new: usize,
        draft: Vec<u32>,
        draft_run: Option<DraftRun>,
        busy: &[StateSlot],
    ) -> ScheduledRequest {
        let req = &self.requests[&id];
        let start = req.num_computed_tokens;
        // Checkpoint the state at the last full prompt block this chunk completes, unless
        // one of that prefix exists.
        let bs = self.config.block_size;
        let end = (start + num_new).min(req.num_prompt_tokens()) / bs * bs;
        let state_save = match self.states.is_empty() || self.checkpoints.is_empty() {
            true => None,
            false => (end > start)
                .then(|| self.kv.block_hash(req, end / bs - 1))
                .flatten()
                .filter(|h| !self.checkpoints.contains(h))
                .and_then(|h| self.checkpoints.reserve(h, busy))
                .map(|slot| (end - start, slot)),
        };
        let known = num_new - draft.len();
        let mut token_ids: Vec<u32> = (start..start + known).map(|i| req.token_at(i)).collect();
        token_ids.extend(&draft);
        let completes = start + known == req.num_tokens();
        let sample = (completes && !req.pooling).then(|| {
            let p = &req.params;
            let mut banned = if req.output_token_ids.len() < p.min_tokens() {
                let mut b = p.stop_token_ids.clone();
                if !p.ignore_eos {
                    b.extend(req.eos_token_ids.iter().copied());
                }
                b
            } else {
                Vec::new()
            };
            banned.extend(p.bad_word_bans(&req.output_token_ids));
            SampleSpec {
                params: p.clone(),
                output_index: req.output_token_ids.len(),
                banned_token_ids: banned,
                penalty_context: p
                    .has_penalties()
                    .then(|| (req.prompt_token_ids.clone(), req.output_token_ids.clone())),
                constraint: req.constraint.clone(),
            }
        });
        let prompt_logprobs = req.params.prompt_logprobs.and_then(|k| {
            let prompt_len = req.num_prompt_tokens();
            let done = self.prompt_logprobs_done.get(&id).copied().unwrap_or(0);
            let first = start.max(done);
            let end = (start + num_new).min(prompt_len.saturating_sub(1));
            (first < end).then(|| PromptLogprobSpec {
                first_row: first - start,
                targets: req.prompt_token_ids[first + 1..end + 1].to_vec(),
                num_alternatives: k as usize,
            })
        });
        if let Some(spec) = &prompt_logprobs {
            self.prompt_logprobs_done
                .insert(id, start + spec.first_row + spec.targets.len());
        }
        let draft_states = match (draft.is_empty(), &self.config.speculation) {
            (false, Some(spec)) if !self.states.is_empty() => {
                let first = (self.config.state_slots + self.config.state_checkpoints) as StateSlot;
                let set = self.draft_states.slot(id).expect("acquired with the draft");
                Some(first + set * spec.k as StateSlot)
            }
            _ => None,
        };
        let rollback = self.rollbacks.remove(&id);
        ScheduledRequest {
            req_id: id,
            token_ids,
            start_pos: start,
            block_tables: self.kv.block_tables(id).to_vec(),
            sample,
            prompt_logprobs,
            state: self.states.slot(id).map(|slot| StateStep {
                slot,
                restore: self.restores.get(&id).copied().or(rollback),
                save: state_save,
                drafts: draft_states,
            }),
            pooling: PoolStep {
                pool: completes && req.pooling,
                token_type_ids: req
                    .token_type_ids
                    .as_ref()
                    .map_or(Vec::new(), |t| t[start..start + known].to_vec()),
            },
            spec: SpecStep {
                draft,
                draft_run,
                mtp_run: None,
            },
        }
    }
}
