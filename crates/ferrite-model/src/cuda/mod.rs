//! The CUDA backend (cargo feature `cuda`): bf16 weights on one GPU, ferrite's own kernels for
//! attention, the KV write, norms and activations, cuBLAS (through candle) for the matmuls.

pub mod kernels;
pub mod loader;
pub mod model;
pub mod weights;
