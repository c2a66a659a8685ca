//! ferrite-model: weights and tokenizer from GGUF, the packed Llama-family forward pass,
//! the paged KV cache and attention, the memory budget, the sampler and the model runner.

pub mod attention;
pub mod chat_template;
pub mod config;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod disjoint;
pub mod gguf;
pub mod kv_cache;
pub mod linear;
pub mod llama;
pub mod loader;
pub mod memory;
pub mod ops;
pub mod quant;
pub mod runner;
pub mod sampler;
pub mod step;
pub mod tokenizer;
