//! Start-up by `--device`: the backend's [`Startup`](crate::start::Startup) run by
//! `crate::start`; the CPU backend's loaders for tests and benchmarks; and `ferrite plan`'s
//! plan from a checkpoint's header.

use crate::backend::cpu::start::CpuStart;
use crate::backend::cpu::CpuBackend;
#[cfg(feature = "cuda")]
use crate::backend::cuda::start::CudaStart;
use crate::budget::ModelBytes;
use crate::checkpoint::open_weights;
use crate::config::ModelConfig;
pub use crate::engine_args::*;
use crate::memory::{self, MemoryPlan};
use crate::models::{self, Model};
pub use crate::start::LoadedEngine;
use crate::start::{self, Startup};
use crate::weights::footprint::{
    cpu_weight_bytes, cpu_weight_label, gpu_weight_bytes, matrix_dtypes, PlanTarget,
};
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use std::path::Path;

/// Loads everything on `--device`. `progress(done, total)` follows weight loading.
pub fn load(args: &EngineArgs, progress: impl FnMut(usize, usize)) -> Result<LoadedEngine> {
    if args.block_size == 0 || args.max_num_seqs == 0 || args.max_num_batched_tokens == 0 {
        bail!("--block-size, --max-num-seqs and --max-num-batched-tokens must be positive");
    }
    struct Load<'a, P>(&'a EngineArgs, P);
    impl<P: FnMut(usize, usize)> OnDevice for Load<'_, P> {
        type Out = LoadedEngine;
        fn run<S: Startup>(mut self) -> Result<LoadedEngine> {
            start::load::<S>(self.0, &mut self.1)
        }
    }
    on_device(args.device, Load(args, progress))
}

/// A following rank of a split model: loads its share and does what the leading rank
/// commands until it stops.
pub fn follow(args: &EngineArgs) -> Result<()> {
    struct Follow<'a>(&'a EngineArgs);
    impl OnDevice for Follow<'_> {
        type Out = ();
        fn run<S: Startup>(self) -> Result<()> {
            start::follow::<S>(self.0)
        }
    }
    on_device(args.device, Follow(args))
}

/// Work generic over the device's start-up, run by [`on_device`].
trait OnDevice {
    type Out;
    fn run<S: Startup>(self) -> Result<Self::Out>;
}

/// Runs `job` with `device`'s start-up: the one place a backend is registered.
fn on_device<J: OnDevice>(device: DeviceKind, job: J) -> Result<J::Out> {
    check_device(device)?;
    match device {
        DeviceKind::Cpu => job.run::<CpuStart>(),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda(_) => job.run::<CudaStart>(),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda(_) => unreachable!("refused by check_device"),
        #[cfg(feature = "wgpu")]
        DeviceKind::Wgpu(..) => job.run::<crate::backend::wgpu::start::WgpuStart>(),
        #[cfg(not(feature = "wgpu"))]
        DeviceKind::Wgpu(..) => unreachable!("refused by check_device"),
    }
}

/// Refuses a device this build cannot run, before anything is opened or downloaded.
pub fn check_device(device: DeviceKind) -> Result<()> {
    if matches!(device, DeviceKind::Cuda(_)) && !cfg!(feature = "cuda") {
        bail!(
            "--device cuda: this ferrite was built without CUDA support (build with `cargo build --release --features cuda`)"
        );
    }
    if let DeviceKind::Wgpu(api, _) = device {
        if !cfg!(feature = "wgpu") {
            bail!(
                "--device {}: this ferrite was built without the wgpu backend (build with `cargo build --release --features wgpu`)",
                api.name()
            );
        }
    }
    Ok(())
}

/// A family and its multi-token-prediction head on the CPU backend (f32 or int8 weights per
/// `format`), KV cache not yet allocated.
pub fn load_cpu_decoder_with_mtp(model: &Path, format: WeightFormat) -> Result<Model<CpuBackend>> {
    let (src, mut weights) = open_weights(model, LoadFormat::Auto)?;
    let max_positions = models::config(&src)?.context_length;
    let backend = CpuBackend::new(format, None);
    models::load_with_mtp(backend, &src, &mut weights, max_positions, &mut |_, _| {})
}

/// A family on the CPU backend, KV cache not yet allocated.
pub fn load_cpu_decoder(
    model: &Path,
    load_format: LoadFormat,
    format: WeightFormat,
    threads: Option<usize>,
    max_positions: Option<usize>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Model<CpuBackend>> {
    let (src, mut weights) = open_weights(model, load_format)?;
    let config = models::config(&src)?;
    let max_positions = max_positions.unwrap_or(config.context_length);
    let backend = CpuBackend::new(format, threads);
    models::load(backend, &src, &mut weights, max_positions, progress)
}

/// What `ferrite plan` states: the memory plan, the model's config and how the backend
/// keeps its matrices.
pub struct HeaderPlan {
    pub plan: MemoryPlan,
    pub config: ModelConfig,
    pub weight_format: String,
}

/// What [`load`] (or a GPU's start-up) would plan, from the checkpoint's header and config
/// alone (no weights read): weights as the backend keeps them, activations estimated
/// (start-up measures its step), for the target's memory.
pub fn plan_from_header(args: &EngineArgs, target: &PlanTarget) -> Result<HeaderPlan> {
    if args.world_size() > 1 {
        bail!("planning a model split across ranks is not built yet: start it, its log states each rank's plan");
    }
    let (args, pooling) = &start::resolved_for_task(args)?;
    let (src, weights) = open_weights(&args.model, args.load_format)?;
    let config = models::config(&src)?;
    let max_model_len = args.max_model_len(&config, pooling.as_ref())?;
    let tokens = args.max_num_batched_tokens.min(max_model_len);
    let weight_bytes = |w: &WeightSource| match target.store {
        Some(store) => gpu_weight_bytes(w, &|d, r, c| store.bytes(d, r, c)) as u64,
        None => cpu_weight_bytes(w, args.weight_format) as u64,
    };
    let bytes = ModelBytes {
        weights: weight_bytes(&weights),
        activations: memory::activation_estimate(&config, tokens),
        state_per_slot: models::state_bytes(&models::state_layers(&src)?) as u64,
        draft: args
            .draft_model_path()
            .map(|path| {
                let (src, weights) = open_weights(path, args.load_format)?;
                let c = models::config(&src)?;
                let slots = ferrite_core::kv_layout::KvLayout::new(&c.layer_windows).slots;
                Ok::<_, anyhow::Error>(crate::memory::DraftShare {
                    weight_bytes: weight_bytes(&weights),
                    bytes_per_block: args.kv_block_bytes(&c, slots),
                })
            })
            .transpose()?,
        kv_slots: None,
        layer_pages_limit: target.layer_pages_limit,
    };
    let (plan, _) = args.plan(&config, max_model_len, target.bytes, bytes)?;
    let weight_format = match target.store {
        Some(store) => store.label(&matrix_dtypes(&weights)),
        None => cpu_weight_label(&weights, args.weight_format),
    };
    Ok(HeaderPlan {
        plan,
        config,
        weight_format,
    })
}
