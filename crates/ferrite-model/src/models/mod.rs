//! Model families, each written once against [`crate::backend::Backend`], and the registry from a
//! checkpoint's architecture to its family. [`Model`] is a loaded family with its KV
//! cache on one backend: what the runner drives each step.

pub mod bert;
pub mod gemma;
pub mod layers;
pub mod llama;
pub mod moe;
pub mod qwen_hybrid;

mod family;
mod model;
mod registry;

pub use family::{state_bytes, Buffers, Family, Scratch};
pub use model::Model;
pub use registry::{config, is_encoder, load, load_with_mtp, state_layers};
