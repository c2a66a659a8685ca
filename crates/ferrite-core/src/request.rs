//! A request as the scheduler sees it: token ids, progress, and why it finished.

use crate::constraint::Constraint;
use crate::sampling::SamplingParams;
use std::sync::Arc;

pub type RequestId = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or `max_model_len` reached.
    Length,
    /// The client went away or asked to cancel.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    Running,
    /// Blocks were taken back; it waits again and recomputes its tokens.
    Preempted,
    Finished(FinishReason),
}

#[derive(Clone, Debug)]
pub struct Request {
    pub id: RequestId,
    pub prompt_token_ids: Vec<u32>,
    pub output_token_ids: Vec<u32>,
    pub params: Arc<SamplingParams>,
    /// Tokens whose K/V are in the cache.
    pub num_computed_tokens: usize,
    pub status: RequestStatus,
    /// Hard cap on generated tokens, resolved from `max_tokens` and `max_model_len`.
    pub max_output_tokens: usize,
    pub eos_token_ids: Arc<[u32]>,
    pub num_preemptions: usize,
    /// Structured output: the grammar its tokens must follow.
    pub constraint: Option<Constraint>,
    /// Prefill only (embeddings, scores): once its prompt is computed, the request finishes
    /// with its pooled hidden state instead of sampling.
    pub pooling: bool,
    /// Per prompt token, its segment (pair inputs of cross-encoders); `None`: all 0.
    pub token_type_ids: Option<Vec<u32>>,
    /// Speculation with a draft model: tokens whose K/V the draft model holds (the draft
    /// model's own pages of this request's blocks), and its proposal for the next step.
    pub draft_pos: usize,
    pub proposed: Vec<u32>,
}

impl Request {
    pub fn new(
        id: RequestId,
        prompt_token_ids: Vec<u32>,
        params: Arc<SamplingParams>,
        max_output_tokens: usize,
        eos_token_ids: Arc<[u32]>,
    ) -> Self {
        Self {
            id,
            prompt_token_ids,
            output_token_ids: Vec::new(),
            params,
            num_computed_tokens: 0,
            status: RequestStatus::Waiting,
            max_output_tokens,
            eos_token_ids,
            num_preemptions: 0,
            constraint: None,
            pooling: false,
            token_type_ids: None,
            draft_pos: 0,
            proposed: Vec::new(),
        }
    }

    pub fn num_prompt_tokens(&self) -> usize {
        self.prompt_token_ids.len()
    }

    pub fn num_tokens(&self) -> usize {
        self.prompt_token_ids.len() + self.output_token_ids.len()
    }

    pub fn token_at(&self, i: usize) -> u32 {
        let p = self.prompt_token_ids.len();
        if i < p {
            self.prompt_token_ids[i]
        } else {
            self.output_token_ids[i - p]
        }
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }

    /// Stop check after `token` was appended; stop strings are checked by the output processor.
    pub fn check_stop(&self, max_model_len: usize) -> Option<FinishReason> {
        let n_out = self.output_token_ids.len();
        let last = *self.output_token_ids.last()?;
        if n_out > self.params.min_tokens() {
            if !self.params.ignore_eos && self.eos_token_ids.contains(&last) {
                return Some(FinishReason::Stop);
            }
            if self.params.stop_token_ids.contains(&last) {
                return Some(FinishReason::Stop);
            }
        }
        if n_out >= self.max_output_tokens || self.num_tokens() >= max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }
}
