//! What the scheduler hands the model runner each step, and what it takes back.

use crate::constraint::Constraint;
use crate::kv_cache_manager::BlockTables;
use crate::request::{FinishReason, RequestId};
use crate::sampling::SamplingParams;
use crate::spec_decode::{DraftRun, MtpRun};
use crate::state_pool::StateSlot;
use std::sync::Arc;

/// What the sampler needs for a row that produces a token this step.
#[derive(Clone, Debug)]
pub struct SampleSpec {
    pub params: Arc<SamplingParams>,
    /// Index of the token about to be generated. With a seed, the draw depends only on
    /// `(seed, output_index)`, so it is reproducible whatever else shares the step.
    pub output_index: usize,
    /// Tokens that must not be sampled yet (EOS and stop ids before `min_tokens`).
    pub banned_token_ids: Vec<u32>,
    /// Prompt and output so far, present only when penalties are set.
    pub penalty_context: Option<(Vec<u32>, Vec<u32>)>,
    /// The request's grammar (structured output): the executor masks the row with it and
    /// commits the drawn token to it.
    pub constraint: Option<Constraint>,
}

/// Prompt logprobs to compute for some rows of a prefill chunk.
#[derive(Clone, Debug)]
pub struct PromptLogprobSpec {
    /// Offset of the first row (within this request's chunk) that predicts a prompt token.
    pub first_row: usize,
    /// The prompt token each such row predicts.
    pub targets: Vec<u32>,
    pub num_alternatives: usize,
}

#[derive(Clone, Debug)]
pub struct ScheduledRequest {
    pub req_id: RequestId,
    /// Tokens fed this step: a prefill chunk or the last sampled token.
    pub token_ids: Vec<u32>,
    /// Position of `token_ids[0]`: the number of tokens already in the KV cache.
    pub start_pos: usize,
    /// One per KV group.
    pub block_tables: BlockTables,
    /// Present when the step reaches the last known token, so a new token is sampled.
    pub sample: Option<SampleSpec>,
    /// Recurrent state (models with linear-attention layers).
    pub state: Option<StateStep>,
    /// Pooling (embedding models).
    pub pooling: PoolStep,
    /// Speculative decoding.
    pub spec: SpecStep,
    pub prompt_logprobs: Option<PromptLogprobSpec>,
}

/// Where a request's recurrent state lives this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateStep {
    /// The request's slot; its state starts over when `start_pos` is 0.
    pub slot: StateSlot,
    /// A prefix-cache hit (or a rejected draft taken back): the slot whose state the request
    /// starts from.
    pub restore: Option<StateSlot>,
    /// After this many of the chunk's tokens (a full prompt block's end), the state is
    /// written into this checkpoint slot.
    pub save: Option<(usize, StateSlot)>,
    /// A verify step: the first of `draft.len()` slots that receive the state after the last
    /// known token and each draft but the last, in order.
    pub drafts: Option<StateSlot>,
}

/// A pooling request's part of a step.
#[derive(Clone, Debug, Default)]
pub struct PoolStep {
    /// The step completes the prompt: its hidden states are pooled.
    pub pool: bool,
    /// The chunk's token segments (pair inputs), beside `token_ids`; empty: all 0.
    pub token_type_ids: Vec<u32>,
}

/// Speculative decoding's part of a step.
#[derive(Clone, Debug, Default)]
pub struct SpecStep {
    /// Draft tokens fed after the last known one (`token_ids` ends with them): each of the
    /// last `draft.len() + 1` rows is sampled, and drafts are kept while they match.
    pub draft: Vec<u32>,
    /// Speculation with a draft model: what it runs for this request after the step.
    pub draft_run: Option<DraftRun>,
    /// Speculation with an MTP head: what it runs for this request after the step.
    pub mtp_run: Option<MtpRun>,
}

impl ScheduledRequest {
    /// K/V length after this step.
    pub fn seq_len(&self) -> usize {
        self.start_pos + self.token_ids.len()
    }
}

/// The only contract between the scheduler and the model runner.
#[derive(Clone, Debug, Default)]
pub struct SchedulerOutput {
    pub requests: Vec<ScheduledRequest>,
    pub num_batched_tokens: usize,
    pub preempted: Vec<RequestId>,
}

impl SchedulerOutput {
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
}

/// A request's change after a step, for the output processor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestUpdate {
    pub req_id: RequestId,
    /// Tokens appended this step (more than one when drafts were accepted), up to the one
    /// that finished the request.
    pub new_tokens: Vec<u32>,
    pub finished: Option<FinishReason>,
}
