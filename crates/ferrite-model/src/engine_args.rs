//! Engine settings, named after vLLM's flags: plain data, and what follows from the flags
//! alone. What they imply once a model is opened: `start.rs` (the model resolved, its task),
//! `budget.rs` (the memory plan).

use crate::config::ModelConfig;
use crate::kv_dtype::KvCacheDtype;
use crate::pooling::Pooling;
pub use crate::settings::{DeviceKind, LoadFormat, RunnerKind, WeightFormat};
use anyhow::{bail, Result};
use ferrite_core::prefix_hash::HashAlgo;
use ferrite_core::scheduler::StepTarget;
use ferrite_core::spec_decode::{Proposer, Speculation};
use std::path::PathBuf;

/// Engine settings, named after vLLM's flags.
#[derive(Clone, Debug)]
pub struct EngineArgs {
    /// A file, a folder, or a Hugging Face id (`org/name`, `org/name:Q4_K_M`) in the cache.
    pub model: PathBuf,
    /// Branch, tag or commit of a Hugging Face id (`--revision`).
    pub revision: Option<String>,
    /// The Hugging Face cache folder ids are read from (`--download-dir`; default: the
    /// environment's).
    pub download_dir: Option<PathBuf>,
    pub max_model_len: Option<usize>,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub block_size: usize,
    pub gpu_memory_utilization: f64,
    pub kv_cache_memory: Option<u64>,
    pub seed: Option<u64>,
    /// Compute threads; `None`: the cores this process may use.
    pub threads: Option<usize>,
    pub weight_format: WeightFormat,
    /// `None` turns prefix caching off.
    pub prefix_caching: Option<HashAlgo>,
    pub device: DeviceKind,
    pub load_format: LoadFormat,
    /// CUDA: launch every step's kernels one by one, never from a captured graph.
    pub enforce_eager: bool,
    /// CUDA: a row rounds alike in a step of any size (`--batch-invariant`).
    pub batch_invariant: bool,
    /// `--speculative-config`, checked; `None`: off.
    pub speculation: Option<Speculation>,
    /// What the model serves (`--runner`, vLLM's).
    pub runner: RunnerKind,
    /// The longest a step with running decodes should take, in ms (`--max-step-ms`): their
    /// inter-token latency. `None`: [`DEFAULT_STEP_TARGET`]; 0: no target.
    pub max_step_ms: Option<f64>,
    /// How the KV pages store K/V (`--kv-cache-dtype`).
    pub kv_cache_dtype: KvCacheDtype,
    /// Ranks each layer is split across (`--tensor-parallel-size`).
    pub tensor_parallel_size: usize,
    /// Stages the layers are split into (`--pipeline-parallel-size`).
    pub pipeline_parallel_size: usize,
}

/// Without `--max-step-ms`: a step with decodes takes at most twice what its decodes
/// alone would, and at least 20 ms (prefill chunks beside them are cut to fit).
pub const DEFAULT_STEP_TARGET: StepTarget = StepTarget::Relative {
    factor: 2.0,
    floor_secs: 0.020,
};

impl EngineArgs {
    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            revision: None,
            download_dir: None,
            max_model_len: None,
            max_num_seqs: 256,
            max_num_batched_tokens: 512,
            block_size: 16,
            gpu_memory_utilization: DeviceKind::Cpu.default_memory_utilization(),
            kv_cache_memory: None,
            seed: None,
            threads: None,
            weight_format: WeightFormat::Auto,
            prefix_caching: Some(HashAlgo::Sha256),
            device: DeviceKind::Cpu,
            load_format: LoadFormat::Auto,
            enforce_eager: false,
            batch_invariant: false,
            speculation: None,
            runner: RunnerKind::Auto,
            max_step_ms: None,
            kv_cache_dtype: KvCacheDtype::Auto,
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
        }
    }

    /// Ranks the model is split across: one process each.
    pub fn world_size(&self) -> usize {
        self.tensor_parallel_size * self.pipeline_parallel_size
    }

    /// The step-time target (`None`: off).
    pub fn step_target(&self) -> Result<Option<StepTarget>> {
        match self.max_step_ms {
            None => Ok(Some(DEFAULT_STEP_TARGET)),
            Some(0.0) => Ok(None),
            Some(ms) if ms > 0.0 && ms.is_finite() => Ok(Some(StepTarget::Fixed(ms / 1e3))),
            Some(ms) => bail!("--max-step-ms must be a positive number of ms (0: off), got {ms}"),
        }
    }

    /// `--max-model-len`, or the model's trained context (an embedding model's
    /// `max_seq_length` when it names one); past that context only a warning.
    pub(crate) fn max_model_len(
        &self,
        config: &ModelConfig,
        pooling: Option<&Pooling>,
    ) -> Result<usize> {
        let trained = pooling
            .and_then(|p| p.max_seq_length)
            .map_or(config.context_length, |m| m.min(config.context_length));
        let max_model_len = self.max_model_len.unwrap_or(trained);
        if max_model_len == 0 {
            bail!("--max-model-len must be positive");
        }
        if max_model_len > config.context_length {
            tracing::warn!(
                "--max-model-len {max_model_len} exceeds the model's trained context of {}",
                config.context_length
            );
        }
        Ok(max_model_len)
    }

    /// The draft model `--speculative-config` names, if it names one.
    pub fn draft_model_path(&self) -> Option<&std::path::Path> {
        match &self.speculation {
            Some(Speculation {
                proposer: Proposer::DraftModel { model },
                ..
            }) => Some(model),
            _ => None,
        }
    }
}
