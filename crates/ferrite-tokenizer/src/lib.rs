//! ferrite-tokenizer: the tokenizer (from GGUF metadata or a `tokenizer.json`) with the
//! special-token ids the engine needs, and chat templates. Kept apart from the model code
//! so the HTTP server builds without candle.

pub mod chat_template;
pub mod tokenizer;

use anyhow::Result;
use std::path::Path;

/// The metadata of a GGUF file, as the tokenizer reads it (`tokenizer.ggml.*`,
/// `general.architecture`).
pub trait Metadata {
    /// The file, to find a `tokenizer.json` beside it.
    fn path(&self) -> &Path;
    fn string(&self, key: &str) -> Result<String>;
    fn opt_string(&self, key: &str) -> Option<String>;
    fn opt_u64(&self, key: &str) -> Option<u64>;
    fn opt_bool(&self, key: &str) -> Option<bool>;
    fn string_array(&self, key: &str) -> Result<Vec<String>>;
    fn f32_array(&self, key: &str) -> Option<Vec<f32>>;
    fn u64_array(&self, key: &str) -> Option<Vec<u64>>;
}
