//! Start-up: load weights and tokenizer, profile the activation peak, size the KV pool,
//! and hand back a runner and the scheduler's configuration (the CPU's here; the GPU's in
//! `backend::cuda::loader`).

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::checkpoint::{open_tokenizer, open_weights, read_config};
use crate::config::ModelConfig;
pub use crate::engine_args::*;
use crate::memory::{self, MemoryPlan};
use crate::models::{self, Decoder};
use crate::parallel;
use crate::pooling::Pooling;
use crate::step::PackedStep;
use crate::weights::footprint::{cpu_weight_bytes, cpu_weight_label};
use crate::{runner::ModelRunner, step::StepModel};
use anyhow::{bail, Result};
use ferrite_core::scheduler::{StepTarget, StepTime};
use ferrite_core::step_cost::StepCost;
use std::path::Path;

/// Loads everything. `progress(done, total)` follows weight loading.
pub fn load(args: &EngineArgs, mut progress: impl FnMut(usize, usize)) -> Result<LoadedEngine> {
    if args.block_size == 0 || args.max_num_seqs == 0 || args.max_num_batched_tokens == 0 {
        bail!("--block-size, --max-num-seqs and --max-num-batched-tokens must be positive");
    }
    check_device(args.device)?;
    match args.device {
        DeviceKind::Cpu => {
            if args.batch_invariant {
                tracing::info!("--batch-invariant: the CPU kernels are batch-invariant already (a token's result never depends on what shares its step)");
            }
            load_cpu(args, &mut progress)
        }
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda(ordinal) => {
            crate::backend::cuda::loader::load(&args.resolved()?, ordinal, progress)
        }
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda(_) => unreachable!("refused by check_device"),
    }
}

/// Refuses a device this build cannot run, before anything is opened or downloaded.
pub fn check_device(device: DeviceKind) -> Result<()> {
    if matches!(device, DeviceKind::Cuda(_)) && !cfg!(feature = "cuda") {
        bail!(
            "--device cuda: this ferrite was built without CUDA support (build with `cargo build --release --features cuda`)"
        );
    }
    Ok(())
}

/// A family and its multi-token-prediction head on the CPU backend (f32 or int8 weights per
/// `format`), KV cache not yet allocated.
pub fn load_cpu_decoder_with_mtp(
    model: &Path,
    format: WeightFormat,
) -> Result<Decoder<CpuBackend>> {
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
) -> Result<Decoder<CpuBackend>> {
    let (src, mut weights) = open_weights(model, load_format)?;
    let config = models::config(&src)?;
    let max_positions = max_positions.unwrap_or(config.context_length);
    let backend = CpuBackend::new(format, threads);
    models::load(backend, &src, &mut weights, max_positions, progress)
}

/// Whether `--speculative-config` drafts with the model's own MTP head.
pub(crate) fn drafts_with_mtp(args: &EngineArgs) -> bool {
    args.speculation
        .as_ref()
        .is_some_and(|s| s.proposer == ferrite_core::spec_decode::Proposer::Mtp)
}

/// This process's share of the model on the CPU backend (the whole model unless it is a
/// rank of a split one), KV cache not yet allocated.
pub fn load_rank(
    args: &EngineArgs,
    max_model_len: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Decoder<CpuBackend>> {
    let group = parallel::join(args.tensor_parallel_size, args.pipeline_parallel_size)?;
    let (src, mut weights) = open_weights(&args.model, args.load_format)?;
    let mut model = match group {
        Some(g) => {
            if args.speculation.is_some() {
                bail!("--speculative-config with --tensor-parallel-size or --pipeline-parallel-size: not built yet");
            }
            // Ranks on one host share its cores.
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let threads = args.threads.unwrap_or((cores / g.local_ranks).max(1));
            let backend = CpuBackend::new(args.weight_format, Some(threads)).in_group(g);
            models::load(backend, &src, &mut weights, max_model_len, progress)?
        }
        None => {
            let backend = CpuBackend::new(args.weight_format, args.threads);
            match drafts_with_mtp(args) {
                true => {
                    models::load_with_mtp(backend, &src, &mut weights, max_model_len, progress)?
                }
                false => models::load(backend, &src, &mut weights, max_model_len, progress)?,
            }
        }
    };
    model.set_kv_dtype(args.kv_cache_dtype);
    Ok(model)
}

/// A following rank of a split model: loads its share and does what the leading rank
/// commands until it stops.
pub fn follow(args: &EngineArgs) -> Result<()> {
    check_device(args.device)?;
    let (args, pooling) = &resolved_for_task(args)?;
    if pooling.is_some() {
        bail!("embedding models are not split across ranks yet");
    }
    let max_model_len = args.max_model_len(&read_config(&args.model)?, None)?;
    match args.device {
        DeviceKind::Cpu => load_rank(args, max_model_len, &mut |_, _| {})?.follow(),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda(ordinal) => {
            crate::backend::cuda::loader::follow(args, ordinal, max_model_len)
        }
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda(_) => unreachable!("refused by check_device"),
    }
}

fn load_cpu(args: &EngineArgs, progress: &mut dyn FnMut(usize, usize)) -> Result<LoadedEngine> {
    let (args, pooling) = &resolved_for_task(args)?;
    let split = args.world_size() > 1;
    if split && pooling.is_some() {
        bail!("embedding models are not split across ranks yet");
    }
    let config = read_config(&args.model)?;
    let max_model_len = args.max_model_len(&config, pooling.as_ref())?;
    let tokenizer = open_tokenizer(&args.model)?;
    let mut model = load_rank(args, max_model_len, progress)?;
    if model.backend.group().is_some_and(|g| !g.leads()) {
        bail!("a following rank of a split model loads with `loader::follow`");
    }
    let config = model.config.clone();
    // The pool is sized from this rank's share: its KV heads, its host's memory shared
    // among the ranks there.
    let rank_config = ModelConfig {
        num_kv_heads: model.kv_heads()?,
        ..config.clone()
    };
    let local_ranks = model.backend.group().map_or(1, |g| g.local_ranks) as u64;
    let calibrate = pooling.is_none() && args.step_target()?.is_some();
    let (activation_bytes, cost) = profile_activations(
        &mut model,
        args.max_num_batched_tokens,
        args.block_size,
        calibrate,
    )?;
    // A draft model shares the target's blocks (its own pages of each) and the budget.
    let mut draft = match args.draft_model_path() {
        Some(path) => {
            let (src, mut weights) = open_weights(path, args.load_format)?;
            let backend = model.backend.sharing_threads(args.weight_format);
            let mut d = models::load(backend, &src, &mut weights, max_model_len, progress)?;
            crate::draft::check_pair(&model, &tokenizer, &d, &open_tokenizer(path)?)?;
            d.set_kv_dtype(args.kv_cache_dtype);
            let (bytes, _) =
                profile_activations(&mut d, args.max_num_batched_tokens, args.block_size, false)?;
            Some((d, bytes))
        }
        None => None,
    };
    let bytes = ModelBytes {
        weights: model.weight_bytes() as u64,
        activations: activation_bytes + draft.as_ref().map_or(0, |d| d.1),
        state_per_slot: model.state_bytes_per_slot() as u64,
        draft: draft.as_ref().map(|(d, _)| args.draft_share(d)),
        kv_slots: split.then(|| model.kv_slots()),
    };
    let (plan, mut scheduler) = args.plan(
        &rank_config,
        max_model_len,
        memory::physical_memory_bytes()? / local_ranks,
        bytes,
    )?;
    scheduler.whole_prompts = pooling.is_some();
    model.allocate_cache(plan.num_blocks, args.block_size)?;
    model.allocate_state(plan.state_slots + plan.state_checkpoints + plan.state_draft_slots)?;
    scheduler.step_time = step_time(args, cost)?;
    let draft = match draft.take() {
        Some((mut d, _)) => {
            d.allocate_cache(plan.num_blocks, args.block_size)?;
            Some(crate::draft::DraftModel::beside(&model, d, args.block_size))
        }
        None => None,
    };
    let runner = ModelRunner::new(Box::new(model), args.block_size, args.seed)
        .with_draft(draft)
        .with_mtp(drafts_with_mtp(args));
    Ok(LoadedEngine {
        runner: runner.with_pooling(pooling.clone()),
        tokenizer,
        scheduler,
        plan,
        config,
        pooling: pooling.clone(),
    })
}

/// The step-time target with the cost model fitted at start-up (`None`: no target, or a
/// model that never decodes).
pub(crate) fn step_time(args: &EngineArgs, cost: Option<StepCost>) -> Result<Option<StepTime>> {
    let (Some(target), Some(cost)) = (args.step_target()?, cost) else {
        return Ok(None);
    };
    let aim = match target {
        StepTarget::Fixed(s) => format!("{:.0} ms (--max-step-ms)", s * 1e3),
        StepTarget::Relative { factor, floor_secs } => format!(
            "{factor}x their decodes alone, at least {:.0} ms (--max-step-ms to fix one)",
            floor_secs * 1e3
        ),
    };
    tracing::info!("steps with decodes aim at {aim}; {}", cost.describe());
    Ok(Some(StepTime { cost, target }))
}

/// `args` with a Hugging Face id resolved, and as an embedding model runs when it is one.
fn resolved_for_task(args: &EngineArgs) -> Result<(EngineArgs, Option<Pooling>)> {
    let args = args.resolved()?;
    let pooling = args.pooling()?;
    Ok(match pooling {
        Some(_) => (args.for_pooling(), pooling),
        None => (args, None),
    })
}

/// Peak extra memory of one step at the full token budget, measured by running it; and
/// the step-cost model fitted to timed steps (`calibrate`), on the same small pool.
fn profile_activations(
    model: &mut Decoder<CpuBackend>,
    tokens: usize,
    block_size: usize,
    calibrate: bool,
) -> Result<(u64, Option<StepCost>)> {
    let c = model.config.clone();
    let tokens = tokens.min(model.max_positions());
    model.allocate_cache(tokens.div_ceil(block_size), block_size)?;
    model.allocate_state(1)?;
    // Every group writes the same blocks: the values are garbage, the memory is real.
    let groups = model.layout.groups.len();
    let step = PackedStep::profile(tokens, block_size, c.vocab_size, groups);
    let before = memory::rss_bytes();
    let measured = memory::reset_peak_rss();
    model.forward(&step)?;
    let peak = memory::peak_rss_bytes();
    let cost = calibrate
        .then(|| crate::calibrate::step_cost(model, block_size, groups, tokens))
        .transpose()?;
    model.allocate_cache(0, block_size)?;
    let bytes = if measured && peak > before {
        peak - before
    } else {
        // Without a resettable peak counter, estimate from the buffers a step allocates.
        memory::activation_estimate(&c, tokens)
    };
    Ok((bytes, cost))
}

/// What [`load`] would plan on the CPU, from the checkpoint's header and config alone (no
/// weights read): weights as the CPU backend keeps them, activations estimated (start-up
/// measures its step), for `device_bytes` of memory.
/// What `ferrite plan` states: the memory plan, the model's config and how the CPU backend
/// keeps its matrices.
pub struct HeaderPlan {
    pub plan: MemoryPlan,
    pub config: ModelConfig,
    pub weight_format: String,
}

pub fn plan_from_header(args: &EngineArgs, device_bytes: u64) -> Result<HeaderPlan> {
    if args.world_size() > 1 {
        bail!("planning a model split across ranks is not built yet: start it, its log states each rank's plan");
    }
    let (args, pooling) = &resolved_for_task(args)?;
    let (src, weights) = open_weights(&args.model, args.load_format)?;
    let config = models::config(&src)?;
    let max_model_len = args.max_model_len(&config, pooling.as_ref())?;
    let tokens = args.max_num_batched_tokens.min(max_model_len);
    let bytes = ModelBytes {
        weights: cpu_weight_bytes(&weights, args.weight_format) as u64,
        activations: memory::activation_estimate(&config, tokens),
        state_per_slot: models::state_bytes(&models::state_layers(&src)?) as u64,
        draft: args
            .draft_model_path()
            .map(|path| {
                let (src, weights) = open_weights(path, args.load_format)?;
                let c = models::config(&src)?;
                let slots = ferrite_core::kv_layout::KvLayout::new(&c.layer_windows).slots;
                Ok::<_, anyhow::Error>(crate::memory::DraftShare {
                    weight_bytes: cpu_weight_bytes(&weights, args.weight_format) as u64,
                    bytes_per_block: args.kv_block_bytes(&c, slots),
                })
            })
            .transpose()?,
        kv_slots: None,
    };
    let (plan, _) = args.plan(&config, max_model_len, device_bytes, bytes)?;
    Ok(HeaderPlan {
        plan,
        config,
        weight_format: cpu_weight_label(&weights, args.weight_format),
    })
}
