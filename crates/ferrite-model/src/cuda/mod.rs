//! The CUDA backend (cargo feature `cuda`): bf16 weights on one GPU, ferrite's own kernels for
//! attention, the KV write, norms and activations, cuBLAS (cublasGemmEx) for the matmuls.

pub mod graph;
pub mod kernels;
pub mod loader;
pub mod model;
pub mod weights;

use anyhow::{anyhow, Result};
use candle_core::Device;

/// Opens GPU `ordinal` for ferrite: one stream carries every launch and copy, so candle's
/// per-tensor event tracking (an event record per tensor use) only costs host time.
pub fn open_device(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)
        .map_err(|e| anyhow!("--device cuda:{ordinal}: no usable CUDA GPU ({e})"))?;
    if let Device::Cuda(d) = &device {
        // SAFETY: ferrite never uses a second stream, so stream order alone orders every use.
        unsafe { d.disable_event_tracking() };
    }
    Ok(device)
}
