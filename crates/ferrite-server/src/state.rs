//! What every handler shares.

use crate::conversations::ResponseStore;
use crate::metrics::Metrics;
use crate::reasoning::ReasoningParser;
use crate::tools::ToolParser;
use ferrite_core::engine::EngineHandle;
use ferrite_tokenizer::chat_template::ChatTemplate;
use ferrite_tokenizer::tokenizer::ModelTokenizer;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<ModelTokenizer>,
    pub template: Option<ChatTemplate>,
    pub model_name: String,
    pub model_root: String,
    pub api_key: Option<String>,
    pub metrics: Metrics,
    pub tool_parser: Option<ToolParser>,
    pub reasoning_parser: Option<ReasoningParser>,
    pub enable_auto_tool_choice: bool,
    /// Sampling defaults (`--override-generation-config`); `max_tokens` caps every request.
    pub sampling_defaults: ferrite_core::sampling::SamplingParams,
    /// Structured-output compiler for this vocabulary, or why there is none.
    pub grammars: Result<ferrite_grammar::SharedGrammars, String>,
    /// Set on shutdown: /health answers 503 and new requests are refused.
    pub draining: AtomicBool,
    /// Past this many waiting engine requests, new calls get 503 with `Retry-After`.
    pub max_queued_requests: usize,
    /// A model step running longer than this makes `/health` answer 503 (a wedged engine).
    pub step_timeout: std::time::Duration,
    /// `--enable-log-requests`: a log line per request as it starts and as it finishes.
    pub log_requests: bool,
    pub created: u64,
    /// Conversations of `/v1/responses`, for `previous_response_id`.
    pub responses: ResponseStore,
    /// Set when the model serves embeddings (and no text generation).
    pub embedder: Option<Embedder>,
}

pub type SharedState = Arc<AppState>;

/// What the server knows of the embedding model it serves.
#[derive(Clone, Debug)]
pub struct Embedder {
    /// Vectors are unit length (so are those cut to `dimensions`).
    pub normalize: bool,
    /// A cross-encoder: it scores pairs (`/v1/score`, `/v1/rerank`) and embeds nothing.
    pub cross_encoder: bool,
}
