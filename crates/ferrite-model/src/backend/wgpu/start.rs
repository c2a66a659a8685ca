//! Start-up on a GPU through wgpu: the adapter `--device` names, its memory, a step's
//! activations as the backend counts them; and what `ferrite plan` needs of it.

use super::blocks::Format;
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
use crate::weights::footprint::{MatrixStore, PlanTarget};
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use candle_core::quantized::GgmlDType;
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

/// How the wgpu backend keeps matrices: GGUF blocks the kernels read kept as they are (with
/// a scale word of their own), everything else as f16.
pub struct WgpuMatrices;

impl MatrixStore for WgpuMatrices {
    fn bytes(&self, dtype: GgmlDType, rows: usize, cols: usize) -> usize {
        4 * rows * Format::of(dtype).row_words(cols)
    }

    fn label(&self, dtypes: &[GgmlDType]) -> String {
        let mut kept: Vec<String> = Vec::new();
        let mut f16 = false;
        for &d in dtypes {
            match Format::of(d) {
                Format::F16 => f16 = true,
                _ => {
                    // GGUF's spelling of the block type (candle's `Q4K` is `Q4_K`).
                    let name = format!("{d:?}").replace('K', "_K");
                    if !kept.contains(&name) {
                        kept.push(name);
                    }
                }
            }
        }
        match (kept.is_empty(), f16) {
            (true, _) => "f16".into(),
            (false, false) => format!("{} blocks kept", kept.join(", ")),
            (false, true) => format!("{} blocks kept, the rest f16", kept.join(", ")),
        }
    }
}

/// What `ferrite plan` needs of the adapter `--device` names, and its description.
pub fn plan_target(args: &EngineArgs) -> Result<(PlanTarget<'static>, String)> {
    let start = WgpuStart::open(args, None)?;
    let target = PlanTarget {
        bytes: start.memory_bytes(),
        layer_pages_limit: start.layer_pages_limit(),
        store: Some(&WgpuMatrices),
    };
    Ok((target, start.gpu.describe()))
}
