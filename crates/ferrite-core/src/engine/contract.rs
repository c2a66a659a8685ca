//! What the engine's loop, its thread and its clients share: the executor it drives, the
//! errors a request can end with, the commands clients send and the published counters.

use crate::output::{RequestOutput, StepOutput};
use crate::request::{Request, RequestId};
use crate::scheduler::{AdmissionError, SchedulerOutput};
use tokio::sync::mpsc as tokio_mpsc;

pub type ExecError = Box<dyn std::error::Error + Send + Sync>;

/// Runs a scheduled step on the model. Implemented by the model runner.
pub trait Executor: Send {
    fn execute(&mut self, step: &SchedulerOutput) -> Result<StepOutput, ExecError>;
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    InvalidParams(String),
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    #[error("the engine is not running")]
    Dead,
    #[error("the model step failed: {0}")]
    Step(String),
}

impl EngineError {
    /// True for errors caused by the request itself (HTTP 400), false for server faults.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            EngineError::InvalidParams(_) | EngineError::Admission(_)
        )
    }
}

pub(crate) type OutputSink = tokio_mpsc::UnboundedSender<Result<RequestOutput, EngineError>>;

pub(crate) enum Command {
    Add(Request, OutputSink),
    Abort(RequestId),
    ResetPrefixCache,
    Shutdown,
}

/// vLLM's buckets of `vllm:iteration_tokens_total`.
pub const ITERATION_TOKEN_BUCKETS: [u64; 13] = [
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
];

/// Counters the engine publishes after every step.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub kv_usage: f64,
    pub num_preemptions: u64,
    pub num_steps: u64,
    pub prompt_tokens_total: u64,
    /// Prompt tokens run through the model (prefix-cache hits excluded).
    pub prompt_tokens_computed: u64,
    pub generation_tokens_total: u64,
    /// Requests aborted before they finished: their client went away (or asked).
    pub aborted_total: u64,
    /// When the model step now running began (`None` between steps): a step that never ends
    /// is a wedged engine.
    pub step_started: Option<std::time::Instant>,
    /// Tokens per model step, counted in [`ITERATION_TOKEN_BUCKETS`] (cumulative, as
    /// Prometheus buckets), with their sum and the number of steps.
    pub iteration_tokens: [u64; ITERATION_TOKEN_BUCKETS.len()],
    pub iteration_tokens_sum: u64,
    pub iteration_tokens_count: u64,
    /// Prompt tokens looked up in the prefix cache, and found there.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Drafted and accepted tokens of speculative decoding.
    pub spec: crate::spec_decode::SpecStats,
    pub alive: bool,
}
