//! Start-up on a GPU: the family onto the device, one profiling step at the full token
//! budget, the KV pool sized from the device's memory and reserved once, decode graphs.

use super::graph::{GraphShape, MAX_GRAPH_BATCH, MAX_WINDOW_ROWS};
use super::{cuda, open_device, CudaBackend};
use crate::backend::Backend;
use crate::checkpoint::{open_tokenizer, open_weights, read_config};
use crate::config::ModelConfig;
use crate::engine_args::{EngineArgs, LoadedEngine, ModelBytes};
use crate::models::{self, Decoder};
use crate::parallel::{self, Group};
use crate::settings::WeightFormat;
use crate::step::PackedStep;
use crate::weights::WeightSource;
use crate::{runner::ModelRunner, step::StepModel};
use anyhow::{bail, Result};
use candle_core::cuda::cudarc::driver::CudaContext;
use ferrite_core::step_cost::StepCost;

/// A split model's GPU for this rank: one of its own, `ordinal + local rank`, when the host
/// has that many; else every rank of the host shares `ordinal` (host-staged collectives).
fn rank_device(g: Option<&Group>, ordinal: usize) -> (usize, bool) {
    let Some(g) = g else {
        return (ordinal, true);
    };
    let gpus = CudaContext::device_count().unwrap_or(0).max(0) as usize;
    match ordinal + g.local_ranks <= gpus {
        true => (ordinal + g.local_rank, true),
        false => {
            tracing::warn!(
                "{} ranks on this host and {gpus} GPU(s) from cuda:{ordinal} on: the ranks share cuda:{ordinal}, their activations staged through host memory",
                g.local_ranks
            );
            (ordinal, false)
        }
    }
}

/// This process's share of the model on a GPU (the whole model unless it is a rank of a
/// split one): the backend, weights bf16 or kept quantized, KV cache not yet allocated;
/// with the GPU's total memory and how many ranks share it.
pub fn load_rank(
    args: &EngineArgs,
    ordinal: usize,
    max_model_len: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Decoder<CudaBackend>, bool, u64)> {
    let group = parallel::join(args.tensor_parallel_size, args.pipeline_parallel_size)?;
    let (ordinal, own_gpu) = rank_device(group.as_ref(), ordinal);
    let device = open_device(ordinal)?;
    let ctx = cuda(&device)?.cuda_stream().context().clone();
    let gpu_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    let (_, total) = ctx.mem_get_info()?;
    let sharing = match (&group, own_gpu) {
        (Some(g), false) => g.local_ranks as u64,
        _ => 1,
    };
    let (src, mut weights) = open_weights(&args.model, args.load_format)?;
    // `native` keeps a GGUF's blocks (candle's quantized matmuls), `f32` dequantizes to bf16
    // (cuBLAS and ferrite's small-row matmuls: faster, see h200.md), `auto` takes bf16 when
    // that needs at most half the GPU's memory (always, with `--batch-invariant`).
    let quantized = match (&weights, args.weight_format) {
        (WeightSource::Gguf { file, .. }, WeightFormat::Auto) => {
            !args.batch_invariant && 2 * file.param_count() as u64 > total as u64 / 2
        }
        (WeightSource::Gguf { .. }, format) => format == WeightFormat::Native,
        _ => false,
    };
    if quantized && args.batch_invariant {
        bail!("--batch-invariant runs bf16 weights: leave out --weight-format native");
    }
    let name = format!("cuda:{ordinal} ({gpu_name})");
    let backend = CudaBackend::new(device, quantized, name)?;
    backend.kernels().set_batch_invariant(args.batch_invariant);
    let mtp = crate::loader::drafts_with_mtp(args);
    let mut model = match group {
        Some(g) => {
            if args.speculation.is_some() {
                bail!("--speculative-config with --tensor-parallel-size or --pipeline-parallel-size: not built yet");
            }
            let backend = backend.in_group(g, own_gpu)?;
            models::load(backend, &src, &mut weights, max_model_len, progress)?
        }
        None if mtp => models::load_with_mtp(backend, &src, &mut weights, max_model_len, progress)?,
        None => models::load(backend, &src, &mut weights, max_model_len, progress)?,
    };
    model.set_kv_dtype(args.kv_cache_dtype);
    Ok((model, quantized, total as u64 / sharing))
}

/// A following rank of a model split across GPUs: loads its share and does what the
/// leading rank commands until it stops.
pub fn follow(args: &EngineArgs, ordinal: usize, max_model_len: usize) -> Result<()> {
    load_rank(args, ordinal, max_model_len, &mut |_, _| {})?
        .0
        .follow()
}

pub fn load(
    args: &EngineArgs,
    ordinal: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<LoadedEngine> {
    if args.pooling()?.is_some() {
        bail!("embedding models run on the CPU backend only; use --device cpu");
    }
    let max_model_len = args.max_model_len(&read_config(&args.model)?, None)?;
    let (mut model, quantized, total) = load_rank(args, ordinal, max_model_len, &mut progress)?;
    let split = model.backend.group().is_some();
    if model.backend.group().is_some_and(|g| !g.leads()) {
        bail!("a following rank of a split model loads with `loader::follow`");
    }
    let device = model.backend.device().clone();
    let name = model.backend.name().to_string();
    let mtp = crate::loader::drafts_with_mtp(args);
    let tokenizer = open_tokenizer(&args.model)?;
    let config = model.config.clone();
    // The pool is sized from this rank's share: its KV heads, its GPU's memory.
    let rank_config = ModelConfig {
        num_kv_heads: model.kv_heads()?,
        ..config.clone()
    };
    let tokens = args.max_num_batched_tokens.min(max_model_len);
    let (mut activation_bytes, cost) = profile_step(&mut model, tokens, args.block_size)?;
    // candle's quantized matmuls keep a workspace they may move between calls, which a
    // captured graph would go on pointing at: quantized weights run eagerly. A split model's
    // ranks run eagerly too: every rank would have to capture the same graphs in step.
    let graphs = !args.enforce_eager && !quantized && !split;
    if graphs {
        activation_bytes += graph_bytes(&config, args.max_num_seqs.min(MAX_GRAPH_BATCH));
        if let Some(s) = &args.speculation {
            activation_bytes += verify_graph_bytes(&config, s.k);
        }
    }
    // A draft model shares the target's blocks (its own pages of each) and the budget; its
    // steps run eagerly, on the same stream.
    let draft = match args.draft_model_path() {
        Some(path) => {
            let (src, mut weights) = open_weights(path, args.load_format)?;
            let backend = CudaBackend::new(device, quantized, format!("{name}, eager"))?;
            backend.kernels().set_batch_invariant(args.batch_invariant);
            let mut d = models::load(backend, &src, &mut weights, max_model_len, &mut progress)?;
            crate::draft::check_pair(&model, &tokenizer, &d, &open_tokenizer(path)?)?;
            d.set_kv_dtype(args.kv_cache_dtype);
            let (bytes, _) = profile_step(&mut d, tokens, args.block_size)?;
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
    let (plan, scheduler) = args.plan(&rank_config, max_model_len, total, bytes)?;
    // One slot more than the scheduler hands out, for decode graphs' padding rows.
    let stateful = plan.state_slots > 0;
    let scratch = plan.state_slots + plan.state_checkpoints + plan.state_draft_slots;
    model.allocate_state(scratch + stateful as usize)?;
    // One block more than the scheduler hands out: decode graphs pad into it.
    model.allocate_cache(plan.num_blocks + 1, args.block_size)?;
    let mut scheduler = scheduler;
    scheduler.step_time = crate::loader::step_time(args, Some(cost))?;
    if graphs {
        model.backend.enable_decode_graphs(GraphShape {
            max_batch: args.max_num_seqs,
            scratch_block: plan.num_blocks as u32,
            state_scratch: stateful.then_some(scratch as u32),
            block_size: args.block_size,
            max_seq_len: max_model_len,
            heads: (config.num_heads, config.num_kv_heads, config.head_dim),
            kv_groups: model.layout.groups.len(),
        })?;
    }
    let draft = match draft {
        Some((mut d, _)) => {
            d.allocate_cache(plan.num_blocks, args.block_size)?;
            Some(crate::draft::DraftModel::beside(&model, d, args.block_size))
        }
        None => None,
    };
    Ok(LoadedEngine {
        runner: ModelRunner::new(Box::new(model), args.block_size, args.seed)
            .with_draft(draft)
            .with_mtp(mtp),
        tokenizer,
        scheduler,
        plan,
        config,
        pooling: None,
    })
}

/// Every intermediate tensor of one token's pass through a layer (and the step's inputs).
fn bytes_per_token(c: &ModelConfig) -> usize {
    let q_w = c.num_heads * c.head_dim;
    4 * 2 * c.hidden_size
        + 2 * (3 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
        + 2 * 2 * q_w
        + 2 * 3 * c.intermediate_size
        + 4 * 8
}

/// What the decode graphs keep allocated: each bucket's intermediates, f32 logits and
/// attention partials, captured once and held for the life of the engine.
fn graph_bytes(c: &ModelConfig, max_batch: usize) -> u64 {
    let mut b = 1;
    let mut total = 0;
    while b <= max_batch.next_power_of_two() {
        total += b * (bytes_per_token(c) + 8 * c.vocab_size) + (4 << 20);
        b *= 2;
    }
    total as u64
}

/// What the verify graphs keep allocated: windows of 2 to 1 + k rows per request, each in
/// buckets of requests up to [`MAX_WINDOW_ROWS`] rows.
fn verify_graph_bytes(c: &ModelConfig, k: usize) -> u64 {
    let mut total = 0;
    for w in 2..=1 + k {
        let mut b = 1;
        while b * w <= MAX_WINDOW_ROWS {
            total += b * w * (bytes_per_token(c) + 8 * c.vocab_size) + (4 << 20);
            b *= 2;
        }
    }
    total as u64
}

/// Runs one step of `tokens` prompt tokens against a scratch cache (compiling nothing: the
/// kernels ship as machine code, but cuBLAS picks its algorithms here) and returns the
/// activation memory to reserve: the larger of what the step took from the device and a
/// count of every intermediate tensor it allocates.
/// The memory one step at the full token budget takes, and the step-cost model fitted to
/// timed steps on the same small pool.
fn profile_step(
    model: &mut Decoder<CudaBackend>,
    tokens: usize,
    block_size: usize,
) -> Result<(u64, StepCost)> {
    let c = model.config.clone();
    model.allocate_cache(tokens.div_ceil(block_size), block_size)?;
    model.allocate_state(1)?;
    let stream = cuda(model.backend.device())?.cuda_stream();
    let ctx = stream.context().clone();
    let (free_before, _) = ctx.mem_get_info()?;
    // Every group writes the same blocks: the values are garbage, the memory is real.
    let groups = model.layout.groups.len();
    let step = PackedStep::profile(tokens, block_size, c.vocab_size, groups);
    model.forward(&step)?;
    stream.synchronize()?;
    let (free_after, _) = ctx.mem_get_info()?;
    const CUBLAS_WORKSPACE: usize = 64 << 20;
    let counted = (tokens * bytes_per_token(&c) + c.vocab_size * 8 + CUBLAS_WORKSPACE) as u64;
    let cost = crate::calibrate::step_cost(model, block_size, groups, tokens)?;
    model.allocate_cache(0, block_size)?;
    Ok((
        counted.max(free_before.saturating_sub(free_after) as u64),
        cost,
    ))
}
