//! What the scheduler is configured with, and why it refuses a request.

use crate::kv_layout::GroupWindow;
use crate::prefix_hash::HashAlgo;
use crate::spec_decode::Speculation;
use crate::step_cost::StepCost;

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Reuse cached full blocks across requests (`None`: off).
    pub prefix_caching: Option<HashAlgo>,
    /// The KV groups' windows (see [`crate::kv_layout::KvLayout`]); `[None]` for a model
    /// whose every layer reads the whole context.
    pub kv_groups: Vec<GroupWindow>,
    /// Recurrent-state slots (see [`crate::state_pool`]): one per running request of a model
    /// with linear-attention layers; 0 for a model that keeps none.
    pub state_slots: usize,
    /// Slots after those for checkpoints of the state at cached prefixes (see
    /// [`crate::state_checkpoints`]); with recurrent state, prefix caching needs some.
    pub state_checkpoints: usize,
    /// Draft tokens for decodes (n-gram prompt lookup, a draft model or an MTP head),
    /// verified in the same step; `None`: off.
    pub speculation: Option<Speculation>,
    /// With recurrent state and speculation: how many requests draft at once. Each holds a
    /// set of `k` slots after the checkpoints, where a verify step writes the state after
    /// each draft token, so a rejected draft's state is taken back by restoring from one.
    pub draft_state_sets: usize,
    /// Every prompt is computed in one step, never in chunks: encoder models attend in both
    /// directions, so a token's state needs the tokens after it.
    pub whole_prompts: bool,
    /// What a step costs (fitted at start-up), and the time a step with running decodes
    /// should take at most: prefill chunks beside decodes are cut to fit it (`None`: chunks
    /// take the whole token budget).
    pub step_time: Option<StepTime>,
}

/// A step-time target and the cost model that keeps steps within it.
#[derive(Clone, Debug)]
pub struct StepTime {
    pub cost: StepCost,
    pub target: StepTarget,
}

/// How long a step with decodes may take.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepTarget {
    /// At most this many seconds.
    Fixed(f64),
    /// At most `factor` times what its decodes alone take, and at least `floor_secs`: the
    /// slow-down prefill may bring to running requests, whatever their number.
    Relative { factor: f64, floor_secs: f64 },
}

/// Prefill tokens a step with decodes still takes (one chunk of them) when the time target
/// leaves none: new requests keep moving while long decodes run.
pub const MIN_PREFILL_CHUNK: usize = 16;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AdmissionError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(
        "this model's maximum context length is {max_model_len} tokens; the prompt has \
         {prompt} tokens, which leaves no room for output"
    )]
    TooLong { max_model_len: usize, prompt: usize },
    #[error(
        "the request needs {needed} KV blocks but the whole pool has {available}; \
         raise --gpu-memory-utilization or --kv-cache-memory"
    )]
    TooManyBlocks { needed: usize, available: usize },
    #[error("this model's maximum input length is {max} tokens; the input has {prompt} tokens")]
    InputTooLong { max: usize, prompt: usize },
}
