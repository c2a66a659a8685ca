//! V1-style scheduler: one token budget per step shared by decodes and prefill chunks,
//! FCFS admission against free KV blocks (and, for models with recurrent layers, a free state
//! slot), preemption by recompute when blocks run out.

use crate::kv_cache_manager::KvCacheManager;
use crate::kv_layout::max_blocks;
use crate::request::{FinishReason, Request, RequestId, RequestStatus};
use crate::sampling::SamplingParams;
use crate::spec_decode::{DraftRun, SpecStats};
use crate::state_checkpoints::StateCheckpoints;
use crate::state_pool::{StatePool, StateSlot};
use crate::step_cost::{StepCost, StepShape};
use std::collections::{HashMap, VecDeque};

mod config;
mod output;
mod speculation;

pub use config::*;
pub use output::*;

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

pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    states: StatePool,
    checkpoints: StateCheckpoints,
    /// Admitted this step from a checkpoint: the slot to restore in its first chunk.
    restores: HashMap<RequestId, StateSlot>,
    /// Sets of draft-state slots (see [`SchedulerConfig::draft_state_sets`]), by set index.
    draft_states: StatePool,
    /// Requests whose last verify step rejected a draft: the draft-state slot holding the
    /// state after the accepted tokens, restored by its next step.
    rollbacks: HashMap<RequestId, StateSlot>,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    num_preemptions: u64,
    /// Per request: rows before this position already had prompt logprobs computed.
    prompt_logprobs_done: HashMap<RequestId, usize>,
    spec_stats: SpecStats,
    /// The step-time target and its cost model, refitted from every step run.
    step_time: Option<StepTime>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        assert!(config.max_num_batched_tokens > 0 && config.max_num_seqs > 0);
        let step_time = config.step_time.clone();
        let kv = KvCacheManager::new(
            config.num_blocks,
            config.block_size,
            config.kv_groups.clone(),
            config.prefix_caching,
        );
        Self {
            states: StatePool::new(config.state_slots),
            checkpoints: StateCheckpoints::new(
                config.state_slots as StateSlot,
                config.state_checkpoints,
            ),
            restores: HashMap::new(),
            draft_states: StatePool::new(config.draft_state_sets),
            rollbacks: HashMap::new(),
            config,
            kv,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            num_preemptions: 0,
            prompt_logprobs_done: HashMap::new(),
            spec_stats: SpecStats::default(),
            step_time,
        }
    }

    /// Folds a step's measured time into the cost model.
    pub fn observe_step(&mut self, out: &SchedulerOutput, seconds: f64) {
        if let Some(st) = &mut self.step_time {
            let mut shape = StepShape::default();
            for r in &out.requests {
                shape.add_chunk(r.start_pos, r.token_ids.len());
            }
            tracing::debug!(
                "step of {} tokens ({} requests, {:.2}M pairs): {:.1} ms, predicted {:.1} ms",
                shape.tokens,
                out.requests.len(),
                shape.pairs / 1e6,
                seconds * 1e3,
                st.cost.predict(shape) * 1e3
            );
            st.cost.observe(shape, seconds);
        }
    }

    /// The cost model as it stands (for logs and tests).
    pub fn step_cost(&self) -> Option<&StepCost> {
        self.step_time.as_ref().map(|s| &s.cost)
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

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Resolves the output cap and refuses requests that could never be served. A cap past
    /// the context left is cut to it (clients send fixed caps: Claude Code 32,000), and the
    /// request ends with the length reason there, as llama.cpp's server does; only a prompt
    /// that leaves no room is refused.
    pub fn check_admissible(
        &self,
        prompt_len: usize,
        params: &SamplingParams,
    ) -> Result<usize, AdmissionError> {
        if prompt_len == 0 {
            return Err(AdmissionError::EmptyPrompt);
        }
        let max_len = self.config.max_model_len;
        let room = max_len.saturating_sub(prompt_len);
        if room == 0 {
            return Err(AdmissionError::TooLong {
                max_model_len: max_len,
                prompt: prompt_len,
            });
        }
        let requested = params
            .max_tokens
            .map_or(room, |m| (m.max(1) as usize).min(room));
        let total = prompt_len + requested;
        let c = &self.config;
        let needed = max_blocks(&c.kv_groups, total, c.block_size, c.max_num_batched_tokens);
        if needed > self.kv.num_blocks() {
            return Err(AdmissionError::TooManyBlocks {
                needed,
                available: self.kv.num_blocks(),
            });
        }
        Ok(requested)
    }

    /// Refuses a pooling input (prefill only) that could never be computed: longer than
    /// `max_model_len`, or than one step when prompts are not chunked.
    pub fn check_pooling_admissible(&self, prompt_len: usize) -> Result<(), AdmissionError> {
        let c = &self.config;
        let max = match c.whole_prompts {
            true => c.max_model_len.min(c.max_num_batched_tokens),
            false => c.max_model_len,
        };
        match prompt_len {
            0 => Err(AdmissionError::EmptyPrompt),
            p if p > max => Err(AdmissionError::InputTooLong { max, prompt: p }),
            _ => Ok(()),
        }
    }

    pub fn add_request(&mut self, req: Request) {
        let id = req.id;
        assert!(
            self.requests.insert(id, req).is_none(),
            "request {id} added twice"
        );
        self.waiting.push_back(id);
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    pub fn spec_stats(&self) -> &SpecStats {
        &self.spec_stats
    }

    pub fn kv_usage(&self) -> f64 {
        self.kv.usage()
    }

    /// Prompt tokens looked up in the prefix cache, and found there.
    pub fn prefix_cache_stats(&self) -> (u64, u64) {
        (self.kv.queried_tokens, self.kv.hit_tokens)
    }

    pub fn reset_prefix_cache(&mut self) {
        self.kv.reset_prefix_cache();
        self.checkpoints.clear();
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn num_free_blocks(&self) -> usize {
        self.kv.num_free_blocks()
    }

    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }

    pub fn running_ids(&self) -> &[RequestId] {
        &self.running
    }

    pub fn waiting_ids(&self) -> impl Iterator<Item = &RequestId> {
        self.waiting.iter()
    }

    /// Builds the next step. Running requests first (decodes and unfinished prefills, in
    /// admission order), then waiting requests FCFS while budget, seats and blocks allow.
    pub fn schedule(&mut self) -> SchedulerOutput {
        // Checkpoints a step wrote count once `update` saw it run.
        self.checkpoints.abandon();
        self.restores.clear();
        let mut budget = self.config.max_num_batched_tokens;
        let mut planned: Vec<(RequestId, usize, Vec<u32>)> = Vec::new();
        let mut preempted = Vec::new();
        // Decodes come first in the step's time: prefill chunks get what they leave.
        let mut shape = StepShape::default();
        let mut timed = TimedStep::default();
        for id in &self.running {
            let r = &self.requests[id];
            if r.num_tokens() - r.num_computed_tokens == 1 {
                shape.add_chunk(r.num_computed_tokens, 1);
                timed.decodes = true;
            }
        }
        timed.decode_shape = shape;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let req = &self.requests[&id];
            let left = req.num_tokens() - req.num_computed_tokens;
            let mut num_new = left.min(budget);
            if left > 1 {
                num_new = self.timed_chunk(&shape, &mut timed, req.num_computed_tokens, num_new);
                if num_new == 0 {
                    i += 1; // this prefill waits for a step with time left
                    continue;
                }
                shape.add_chunk(req.num_computed_tokens, num_new);
            }
            let mut draft = match req.num_tokens() - req.num_computed_tokens {
                1 => self.draft(req, budget - 1),
                _ => Vec::new(),
            };
            // With recurrent state a draft needs a set of slots to take its state back.
            if !draft.is_empty()
                && !self.states.is_empty()
                && self.draft_states.acquire(id).is_none()
            {
                draft.clear();
            }
            let next = req.num_computed_tokens;
            // A draft never costs another request its blocks: without room, it is dropped.
            if !draft.is_empty()
                && !self
                    .kv
                    .allocate_slots(id, next, next + num_new + draft.len(), &Vec::new())
            {
                draft.clear();
            }
            let num_new = num_new + draft.len();
            let target = next + num_new;
            let mut scheduled = true;
            while !self.kv.allocate_slots(id, next, target, &Vec::new()) {
                // Preempt the newest running request; if that is this one, it waits.
                let victim = self.running.pop().expect("running is not empty");
                self.preempt(victim);
                preempted.push(victim);
                if victim == id {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            planned.push((id, num_new, draft));
            budget -= num_new;
            i += 1;
        }

        // vLLM V1 admits nothing new in a step that had to preempt.
        if preempted.is_empty() {
            while let Some(&id) = self.waiting.front() {
                if budget == 0 || self.running.len() >= self.config.max_num_seqs {
                    break;
                }
                if !self.states.is_empty() && self.states.num_free() == 0 {
                    break;
                }
                let req = &self.requests[&id];
                // A new (or preempted) request starts from its longest cached prefix.
                let mut hit = self.kv.find_cached_prefix(req);
                let mut restore = None;
                if !self.states.is_empty() {
                    // With recurrent state, only as deep as a checkpoint of the state reaches.
                    let n = hit[0].len();
                    let deepest = (1..=n).rev().find_map(|k| {
                        let hash = self.kv.block_hash(req, k - 1)?;
                        self.checkpoints.peek(&hash).map(|slot| (k, slot, hash))
                    });
                    let k = deepest.map_or(0, |d| d.0);
                    if k < n {
                        hit = self.kv.find_cached_prefix_within(req, k);
                    }
                    restore = deepest.map(|(_, slot, hash)| (slot, hash));
                }
                let computed = hit[0].len() * self.config.block_size;
                let mut num_new = (req.num_tokens() - computed).min(budget);
                if self.config.whole_prompts && num_new < req.num_tokens() - computed {
                    break; // waits for a step with room for all of it
                }
                if !self.config.whole_prompts {
                    num_new = self.timed_chunk(&shape, &mut timed, computed, num_new);
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
                planned.push((id, num_new, Vec::new()));
                shape.add_chunk(computed, num_new);
                budget -= num_new;
            }
        }

        // A checkpoint this step restores is not overwritten by one it writes.
        let busy: Vec<StateSlot> = self.restores.values().copied().collect();
        let mut runs = self.draft_runs(&planned);
        let mut mtp_runs = self.mtp_runs(&planned);
        let requests = planned
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
            num_batched_tokens: self.config.max_num_batched_tokens - budget,
            preempted,
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

    fn preempt(&mut self, id: RequestId) {
        self.kv.free(id);
        self.states.release(id);
        self.release_draft_states(id);
        let req = self.requests.get_mut(&id).unwrap();
        req.status = RequestStatus::Preempted;
        req.num_computed_tokens = 0;
        req.draft_pos = 0;
        req.proposed.clear();
        req.num_preemptions += 1;
        self.num_preemptions += 1;
        self.waiting.push_front(id);
    }

    /// Applies a step's results: advances progress, appends sampled tokens (a request with
    /// a draft gets its accepted drafts and one more), finishes requests that hit EOS, a stop
    /// id or a length limit.
    pub fn update(
        &mut self,
        output: &SchedulerOutput,
        sampled: &HashMap<RequestId, Vec<u32>>,
    ) -> Vec<RequestUpdate> {
        self.checkpoints.commit();
        let mut updates = Vec::with_capacity(output.requests.len());
        for s in &output.requests {
            let Some(req) = self.requests.get_mut(&s.req_id) else {
                continue; // finished by an abort while the step ran
            };
            let drawn = sampled.get(&s.req_id).map_or(&[][..], Vec::as_slice);
            let mut new_tokens = Vec::with_capacity(drawn.len());
            let mut finished = None;
            for &t in drawn {
                req.output_token_ids.push(t);
                new_tokens.push(t);
                finished = req.check_stop(self.config.max_model_len);
                if finished.is_some() {
                    break;
                }
            }
            let draft = &s.spec.draft;
            req.num_computed_tokens = if draft.is_empty() {
                req.num_computed_tokens + s.token_ids.len()
            } else {
                // K/V holds the last known token and the accepted drafts; a rejected draft's
                // slots are written over by the next step.
                let accepted = drawn.len().saturating_sub(1).min(draft.len());
                self.spec_stats.record(draft.len(), accepted);
                let drafts = s.state.and_then(|st| st.drafts);
                if let Some(first) = drafts.filter(|_| accepted < draft.len()) {
                    // The state after the accepted tokens, for the next step to start from.
                    self.rollbacks
                        .insert(s.req_id, first + accepted as StateSlot);
                }
                (s.start_pos + 1 + accepted).min(req.num_tokens())
            };
            req.proposed.clear();
            if let Some(run) = &s.spec.draft_run {
                // The sampled token was fed to the draft model when it proposed.
                req.draft_pos = match run.with_step {
                    true => {
                        req.num_computed_tokens + (run.propose > 0 && !drawn.is_empty()) as usize
                    }
                    false => run.start + run.catch_up.len(),
                };
            }
            self.kv.cache_blocks(req);
            if s.pooling.pool {
                finished = Some(FinishReason::Stop);
            }
            updates.push(RequestUpdate {
                req_id: s.req_id,
                new_tokens,
                finished,
            });
            if let Some(reason) = finished {
                self.finish(s.req_id, reason);
            }
        }
        updates
    }

    /// Ends a request (stop string, abort, or a stop condition) and frees its blocks.
    /// Returns the request if it was still known.
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) -> Option<Request> {
        let mut req = self.requests.remove(&id)?;
        req.status = RequestStatus::Finished(reason);
        self.kv.forget(id);
        self.states.release(id);
        self.release_draft_states(id);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        self.prompt_logprobs_done.remove(&id);
        Some(req)
    }

    /// Blocks owned by live requests (for leak checks).
    pub fn num_blocks_in_use(&self) -> usize {
        self.kv.num_blocks() - self.kv.num_free_blocks()
    }

    /// State slots held by live requests (for leak checks).
    pub fn num_state_slots_in_use(&self) -> usize {
        self.states.len() - self.states.num_free()
    }

    /// Sets of draft-state slots held by live requests (for leak checks).
    pub fn num_draft_state_sets_in_use(&self) -> usize {
        self.draft_states.len() - self.draft_states.num_free()
    }

    /// Checkpoint slots holding a state (they stay, as cached blocks do, until evicted).
    pub fn num_state_checkpoints(&self) -> usize {
        self.checkpoints.num_used()
    }

    /// `id`'s block tables, one per KV group.
    pub fn block_tables(&self, id: RequestId) -> &[Vec<crate::block_pool::BlockId>] {
        self.kv.block_tables(id)
    }
}
