//! The CUDA device behind a candle `Device`, opened the way ferrite runs it.

use anyhow::{anyhow, bail, Result};
use candle_core::{CudaDevice, Device};

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

/// The CUDA side of `d`.
pub fn cuda(d: &Device) -> Result<&CudaDevice> {
    match d {
        Device::Cuda(c) => Ok(c),
        _ => bail!("not a CUDA device"),
    }
}
