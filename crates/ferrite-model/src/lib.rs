//! ferrite-model: the backend trait and its CPU (and CUDA) implementations, weights and
//! tokenizer from GGUF or safetensors, the model families written once against the backend,
//! the paged KV cache and attention, the memory budget, the sampler and the model runner.

pub mod backend;
pub mod budget;
pub mod calibrate;
pub mod checkpoint;
pub mod config;
pub mod draft;
pub mod engine_args;
pub mod kv_dtype;
pub mod loader;
pub mod memory;
pub mod models;
pub mod mtp_draft;
pub mod parallel;
pub mod pooling;
pub mod rope;
pub mod runner;
pub mod sampler;
pub mod settings;
pub mod start;
pub mod step;
pub mod weights;

pub use ferrite_tokenizer::{chat_template, tokenizer};
