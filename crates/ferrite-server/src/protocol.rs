//! OpenAI request and response types. Responses are structs (not `json!`) so fields go out in
//! OpenAI's order; requests accept unknown fields, as OpenAI's SDKs add new ones freely.

use ferrite_core::output::RequestOutput;
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by both endpoints, including vLLM's extras.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<StringOrList>,
    pub max_tokens: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    // vLLM extras
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub min_tokens: Option<i64>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's `bad_words`: words whose tokens are never generated.
    pub bad_words: Option<Value>,
    pub skip_special_tokens: Option<bool>,
    #[serde(default)]
    pub include_stop_str_in_output: bool,
    pub response_format: Option<Value>,
    /// vLLM's structured output (`json`, `regex`, `choice`, `grammar`, `json_object`) and
    /// its legacy fields.
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    /// Isolates cached prefixes between tenants (vLLM's extension).
    pub cache_salt: Option<String>,
}

impl CommonParams {
    /// `stream_options.include_usage`: a last chunk with the totals.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    pub messages: Vec<Value>,
    #[serde(flatten)]
    pub common: CommonParams,
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Refused on chat (400): the prompt is the rendered template, not the client's text.
    pub prompt_logprobs: Option<i64>,
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub continue_final_message: bool,
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: CommonParams,
    #[serde(default)]
    pub echo: bool,
    pub logprobs: Option<i64>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
    pub prompt_logprobs: Option<i64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
    pub completion_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's breakdown of the prompt: the tokens the prefix cache served.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl Usage {
    /// A request's counts, from its last output.
    pub fn of(o: &RequestOutput) -> Self {
        Self {
            prompt_tokens: o.num_prompt_tokens,
            total_tokens: o.num_prompt_tokens + o.num_output_tokens,
            completion_tokens: o.num_output_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: o.num_cached_tokens,
            },
        }
    }

    /// The choices of one request: one prompt (the first choice's), every completion.
    pub fn and(self, other: &Usage) -> Self {
        let completion = self.completion_tokens + other.completion_tokens;
        Self {
            total_tokens: self.prompt_tokens + completion,
            completion_tokens: completion,
            ..self
        }
    }

    /// Another prompt's tokens added (completions with a list of prompts).
    pub fn with_prompt(self, other: &Usage) -> Self {
        let prompt = self.prompt_tokens + other.prompt_tokens;
        Self {
            prompt_tokens: prompt,
            total_tokens: prompt + self.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: self.prompt_tokens_details.cached_tokens
                    + other.prompt_tokens_details.cached_tokens,
            },
            ..self
        }
    }
}

// ---- chat ----

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// vLLM's, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Value>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// `choices` are pre-serialized so chat and completion streams share one SSE path;
/// `usage` is absent, `null` (include_usage) or the totals (last chunk).
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Value>,
}

// ---- completions ----

/// The legacy completions logprobs shape that lm-eval-harness reads.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CompletionLogprobs {
    pub text_offset: Vec<usize>,
    pub token_logprobs: Vec<Option<f32>>,
    pub tokens: Vec<String>,
    pub top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// vLLM's, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Value>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Completion<C: Serialize> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Value>,
}

pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub fn random_id(prefix: &str) -> String {
    use rand::Rng;
    let n: u128 = rand::rng().random();
    format!("{prefix}-{n:032x}")
}
