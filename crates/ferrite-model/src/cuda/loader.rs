//! Start-up on a GPU: weights onto the device, one profiling step at the full token budget,
//! the KV pool sized from the device's memory and reserved once.

use super::graph::MAX_GRAPH_BATCH;
use super::model::CudaModel;
use super::weights::Weights;
use crate::config::ModelConfig;
use crate::loader::WeightFormat;
use crate::loader::{EngineArgs, LoadFormat, LoadedEngine};
use crate::runner::ModelRunner;
use crate::step::PackedStep;
use crate::tokenizer::ModelTokenizer;
use crate::weights::gguf::GgufFile;
use anyhow::Result;
use candle_core::Device;
use std::path::{Path, PathBuf};

fn is_gguf(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "gguf")
}

/// A Hugging Face model given as its folder or its `config.json`: the config's path.
fn hf_config_path(model: &Path) -> PathBuf {
    if model.is_dir() {
        model.join("config.json")
    } else {
        model.to_path_buf()
    }
}

/// Config and tokenizer of `MODEL`: a GGUF (its metadata) or a Hugging Face config.
fn config_and_tokenizer(model: &Path) -> Result<(ModelConfig, ModelTokenizer)> {
    if is_gguf(model) {
        let g = GgufFile::open(model)?;
        return Ok((ModelConfig::from_gguf(&g)?, ModelTokenizer::load(&g)?));
    }
    let path = hf_config_path(model);
    let config = ModelConfig::from_hf_config(&path)?;
    let tokenizer = ModelTokenizer::for_config(&path, config.vocab_size)?;
    Ok((config, tokenizer))
}

pub fn load(
    args: &EngineArgs,
    ordinal: usize,
    progress: impl FnMut(usize, usize),
) -> Result<LoadedEngine> {
    let device = super::open_device(ordinal)?;
    let Device::Cuda(dev) = &device else {
        unreachable!("new_cuda gives a CUDA device")
    };
    let ctx = dev.cuda_stream().context().clone();
    let gpu_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    let (config, tokenizer, weights) = match args.load_format {
        LoadFormat::Dummy => {
            let (config, tokenizer) = config_and_tokenizer(&args.model)?;
            let weights = Weights::dummy(&config, &device, progress)?;
            (config, tokenizer, weights)
        }
        LoadFormat::Auto if !is_gguf(&args.model) => {
            // A Hugging Face checkpoint: config.json, tokenizer.json and *.safetensors.
            let (config, tokenizer) = config_and_tokenizer(&args.model)?;
            let path = hf_config_path(&args.model);
            let dir = path.parent().unwrap_or(Path::new("."));
            let weights = Weights::from_safetensors(dir, &config, &device, progress)?;
            (config, tokenizer, weights)
        }
        LoadFormat::Auto => {
            let mut g = GgufFile::open(&args.model)?;
            let config = ModelConfig::from_gguf(&g)?;
            let tokenizer = ModelTokenizer::load(&g)?;
            // `native` keeps the GGUF blocks (candle's quantized matmuls), `f32` dequantizes to
            // bf16 (cuBLAS and ferrite's small-row matmuls: faster, see h200.md), `auto` takes
            // bf16 when that needs at most half the GPU's memory.
            let quantized = match args.weight_format {
                WeightFormat::Auto => 2 * g.param_count() as u64 > ctx.mem_get_info()?.1 as u64 / 2,
                format => format == WeightFormat::Native,
            };
            let weights = Weights::from_gguf(&mut g, &config, &device, quantized, progress)?;
            (config, tokenizer, weights)
        }
    };
    let mut config = config;
    // The CUDA backend still runs its own Llama forward, not the families of `models/`.
    if config.architecture.starts_with("gemma") {
        anyhow::bail!(
            "{}: {} runs on --device cpu only so far; the CUDA backend serves the Llama family",
            args.model.display(),
            config.architecture
        );
    }
    config.vocab_size = weights.embedding.dim(0)?;
    let max_model_len = args.max_model_len(&config)?;
    let mut model = CudaModel::new(
        config.clone(),
        device.clone(),
        weights,
        max_model_len,
        format!("cuda:{ordinal} ({gpu_name})"),
    )?;
    let tokens = args.max_num_batched_tokens.min(max_model_len);
    let mut activation_bytes = profile_step(&mut model, tokens, args.block_size)?;
    // candle's quantized matmuls keep a workspace they may move between calls, which a
    // captured graph would go on pointing at: quantized weights run eagerly.
    let graphs = !args.enforce_eager && !model.weights().quantized();
    if graphs {
        activation_bytes += graph_bytes(&config, args.max_num_seqs.min(MAX_GRAPH_BATCH));
    }
    let (_, total) = ctx.mem_get_info()?;
    let (plan, scheduler) = args.plan(
        &config,
        max_model_len,
        total as u64,
        model.weight_bytes() as u64,
        activation_bytes,
    )?;
    // One block more than the scheduler hands out: decode graphs pad into it.
    model.allocate_cache(plan.num_blocks + 1, args.block_size)?;
    if graphs {
        model.enable_decode_graphs(args.max_num_seqs, plan.num_blocks as u32)?;
    }
    Ok(LoadedEngine {
        runner: ModelRunner::new(Box::new(model), args.block_size, args.seed),
        tokenizer,
        scheduler,
        plan,
        config,
    })
}

/// Every intermediate tensor of one token's pass through a layer (and the step's inputs).
fn bytes_per_token(c: &ModelConfig) -> usize {
    let q_w = c.num_heads * c.head_dim;
    4 * c.hidden_size
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

/// Runs one step of `tokens` prompt tokens against a scratch cache (compiling nothing: the
/// kernels ship as machine code, but cuBLAS picks its algorithms here) and returns the
/// activation memory to reserve: the larger of what the step took from the device and a
/// count of every intermediate tensor it allocates.
fn profile_step(model: &mut CudaModel, tokens: usize, block_size: usize) -> Result<u64> {
    let c = model.config.clone();
    let blocks = tokens.div_ceil(block_size);
    model.allocate_cache(blocks, block_size)?;
    let Device::Cuda(dev) = model.device() else {
        unreachable!()
    };
    let ctx = dev.cuda_stream().context().clone();
    let (free_before, _) = ctx.mem_get_info()?;
    let step = PackedStep::profile(tokens, block_size, c.vocab_size, 1);
    model.forward_logits(&step)?;
    dev.cuda_stream().synchronize()?;
    let (free_after, _) = ctx.mem_get_info()?;
    const CUBLAS_WORKSPACE: usize = 64 << 20;
    let counted = (tokens * bytes_per_token(&c) + c.vocab_size * 8 + CUBLAS_WORKSPACE) as u64;
    model.allocate_cache(0, block_size)?;
    Ok(counted.max(free_before.saturating_sub(free_after) as u64))
}
