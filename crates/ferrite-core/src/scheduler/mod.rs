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

mod build;
mod config;
mod output;
mod speculation;

pub use config::*;
pub use output::*;

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
