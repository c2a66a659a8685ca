//! What the engine streams back for each request, and what the runner returns for a step.

use crate::request::{FinishReason, RequestId};
use std::collections::HashMap;

/// A token's log-probability and its top alternatives (most likely first).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// 1-based rank of `token_id` in the distribution.
    pub rank: usize,
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SampledToken {
    pub token_id: u32,
    pub logprobs: Option<TokenLogprob>,
}

/// The runner's answer to one [`crate::scheduler::SchedulerOutput`].
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// Each sampled request's tokens: one, or with a draft the accepted drafts and one more.
    pub sampled: HashMap<RequestId, Vec<SampledToken>>,
    /// Logprobs of the prompt tokens computed this step, in prompt order.
    pub prompt_logprobs: HashMap<RequestId, Vec<TokenLogprob>>,
    /// Rows that failed after the forward pass (a bug in sampling or a grammar, never bad
    /// input): only these requests fail, with the reason.
    pub failed: HashMap<RequestId, String>,
    /// Each pooling request whose prompt the step completed: its pooled hidden state.
    pub pooled: HashMap<RequestId, Vec<f32>>,
    /// The draft model's proposals for each request's next step (speculation with a draft
    /// model).
    pub drafts: HashMap<RequestId, Vec<u32>>,
}

/// One streamed piece of a request's result.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestOutput {
    /// Text that became final this step (stop strings and broken UTF-8 held back).
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// Sent once, with the first output: entry 0 (the first prompt token) is always `None`.
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    pub finish_reason: Option<FinishReason>,
    /// The stop string that finished the request (`finish_reason` stop), if one did.
    pub stop_str: Option<String>,
    pub num_prompt_tokens: usize,
    pub num_output_tokens: usize,
    /// Prompt tokens the prefix cache served when the request was first scheduled.
    pub num_cached_tokens: usize,
    /// Seconds from arrival to first scheduling; sent with the first output.
    pub queue_time: Option<f64>,
    /// A pooling request's pooled hidden state (its only output).
    pub embedding: Option<Vec<f32>>,
}
