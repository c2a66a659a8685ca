//! Start-up on a GPU through wgpu: the adapter `--device` names, its memory, a step's
//! activations as the backend counts them.

use super::device::Gpu;
use super::linear::Pick;
use super::WgpuBackend;
use crate::engine_args::EngineArgs;
use crate::models::Model;
use crate::parallel::Group;
use crate::pooling::Pooling;
use crate::settings::{DeviceKind, WeightFormat};
use crate::start::Startup;
use crate::step::{PackedStep, StepModel};
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use std::sync::Arc;

pub struct WgpuStart {
    gpu: Arc<Gpu>,
}

impl Startup for WgpuStart {
    type Backend = WgpuBackend;

    fn open(args: &EngineArgs, group: Option<&Group>) -> Result<Self> {
        let DeviceKind::Wgpu(api, index) = args.device else {
            bail!("the wgpu start-up needs --device metal, vulkan or wgpu");
        };
        if group.is_some() {
            bail!(
                "--device {}: a model split across ranks runs on CUDA or the CPU",
                api.name()
            );
        }
        let gpu = Gpu::open(api, index)?;
        tracing::info!("{}:{index}: {}", api.name(), gpu.describe());
        Ok(Self { gpu })
    }

    fn check(args: &EngineArgs, _pooling: Option<&Pooling>) -> Result<()> {
        if args.weight_format != WeightFormat::Auto {
            bail!(
                "--weight-format {:?}: the wgpu backend keeps weights as f16 (leave the flag out)",
                args.weight_format
            );
        }
        Ok(())
    }

    fn memory_bytes(&self) -> u64 {
        self.gpu.memory_bytes
    }

    /// K and V of a layer share one buffer, bound whole.
    fn layer_pages_limit(&self) -> Option<u64> {
        Some(self.gpu.limits.max_storage_buffer_binding_size)
    }

    fn backend(
        &mut self,
        args: &EngineArgs,
        _weights: &WeightSource,
        _group: Option<Group>,
    ) -> Result<WgpuBackend> {
        let mut b = WgpuBackend::new(self.gpu.clone())?;
        if args.batch_invariant {
            b.pick = Pick::Tiled;
        }
        Ok(b)
    }

    fn draft_backend(&self, _args: &EngineArgs, main: &WgpuBackend) -> Result<WgpuBackend> {
        Ok(main.beside())
    }

    /// What the step's activations grew to, counted as they are allocated.
    fn measure_step(model: &mut Model<WgpuBackend>, step: &PackedStep) -> Result<u64> {
        let before = model.backend.gpu().activation_bytes();
        model.forward(step)?;
        Ok(model
            .backend
            .gpu()
            .activation_bytes()
            .saturating_sub(before))
    }
}
