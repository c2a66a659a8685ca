//! ferrite-model: the backend trait and its CPU (and CUDA) implementations, weights and
//! tokenizer from GGUF or safetensors, the model families written once against the backend,
//! the paged KV cache and attention, the memory budget, the sampler and the model runner.

pub mod backend;
pub mod chat_template;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod loader;
pub mod memory;
pub mod models;
pub mod rope;
pub mod runner;
pub mod sampler;
pub mod step;
pub mod tokenizer;
pub mod weights;
