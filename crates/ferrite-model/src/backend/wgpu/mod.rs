//! The wgpu backend (cargo feature `wgpu`): WGSL compute kernels on any GPU wgpu reaches —
//! Metal on macOS, Vulkan on Linux and Windows. Weights are GGUF blocks (blocks.rs)
//! dequantized in registers or f16, activations and the residual stream f32, K/V f16 (or
//! f32) in pages, delta-net states f32 by slot. A step records every op into one command
//! buffer, submitted once, with one wait: for its logits.

pub mod attention;
mod binds;
pub mod blocks;
pub mod device;
mod draws;
mod gdn;
pub mod inputs;
pub mod kernels;
mod launches;
pub mod linear;
mod moe;
mod ops;
mod profile;
pub mod start;
mod step;
pub mod tensors;

use crate::settings::GpuApi;
use anyhow::Result;
use device::Gpu;
use kernels::Kernels;
use linear::{Linear, Pick};
use std::sync::Arc;
use tensors::Act;

/// The embedding table as f16 rows: the whole vocabulary, or a rank's rows from `first` on.
pub struct Embedding {
    table: Linear,
    first: usize,
}

/// Rotary tables: cos then sin, `[max_positions, half]` each.
pub struct Rope {
    table: wgpu::Buffer,
    half: usize,
    sin_at: usize,
    neox: bool,
}

pub struct WgpuBackend {
    gpu: Arc<Gpu>,
    kernels: Arc<Kernels>,
    /// The step being recorded.
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    /// Scratch activations, reused across steps.
    normed: Act,
    proj: Act,
    /// Attention's splits of the keys, before they are combined.
    parts: Act,
    /// A delta-net layer's convolution output.
    conv: Act,
    /// A mixture-of-experts layer's activations.
    moe: moe::Scratch,
    /// The step's index arrays, rewritten each step.
    step_words: Option<wgpu::Buffer>,
    /// The last step's logits (or hidden rows) on the device, then on the host.
    out: Act,
    host_logits: Vec<f32>,
    /// Tokens drawn on the device: their parameters, grammar masks, the tokens there and
    /// here.
    draw_words: Option<wgpu::Buffer>,
    mask_words: Option<wgpu::Buffer>,
    tokens: Act,
    drawn: Vec<u32>,
    /// Which matmul kernels serve which row counts.
    pub pick: Pick,
}

impl WgpuBackend {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        let kernels = Arc::new(Kernels::new(&gpu)?);
        gpu.take_error()?;
        Ok(Self::with_kernels(gpu, kernels))
    }

    /// A second backend on the same device and kernels (a draft model).
    pub fn beside(&self) -> Self {
        Self {
            pick: self.pick,
            ..Self::with_kernels(self.gpu.clone(), self.kernels.clone())
        }
    }

    fn with_kernels(gpu: Arc<Gpu>, kernels: Arc<Kernels>) -> Self {
        let pick = match gpu.info.device_type {
            wgpu::DeviceType::Cpu => Pick::Cpu,
            _ if !kernels.matmul_coop.is_empty() => Pick::Coop,
            _ => Pick::Gpu,
        };
        Self {
            kernels,
            pick,
            encoder: None,
            pass: None,
            normed: Act::default(),
            proj: Act::default(),
            parts: Act::default(),
            conv: Act::default(),
            moe: moe::Scratch::default(),
            step_words: None,
            out: Act::default(),
            host_logits: Vec::new(),
            draw_words: None,
            mask_words: None,
            tokens: Act::default(),
            drawn: Vec::new(),
            gpu,
        }
    }

    /// Opens `--device`'s adapter.
    pub fn open(api: GpuApi, index: usize) -> Result<Self> {
        Self::new(Gpu::open(api, index)?)
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The compute pass of the step being recorded (opened by the first op).
    fn pass(&mut self) -> &mut wgpu::ComputePass<'static> {
        let encoder = self.encoder.get_or_insert_with(|| {
            self.gpu
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("step"),
                })
        });
        self.pass.get_or_insert_with(|| {
            encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("step"),
                    timestamp_writes: None,
                })
                .forget_lifetime()
        })
    }
}
