//! Model families, each written once against [`crate::backend::Backend`], and the registry from a
//! checkpoint's architecture to its family. [`Decoder`] is a loaded family with its KV
//! cache on one backend: what the runner drives each step.

pub mod bert;
pub mod gemma;
pub mod layers;
pub mod llama;
pub mod moe;
pub mod qwen3_5;

mod decoder;
mod family;
mod registry;

pub use decoder::Decoder;
pub use family::{state_bytes, Buffers, Family, Scratch};
pub use registry::{config, is_encoder, load, load_with_mtp, state_layers};
