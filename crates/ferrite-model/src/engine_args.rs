//! Engine settings (named after vLLM's flags) and the memory plan they imply.

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::kv_dtype::KvCacheDtype;
use crate::memory::{self, DraftShare, MemoryPlan, PlanInputs};
use crate::models::Model;
use crate::pooling::Pooling;
use crate::runner::ModelRunner;
pub use crate::settings::{DeviceKind, LoadFormat, RunnerKind, WeightFormat};
use crate::tokenizer::ModelTokenizer;
use crate::{checkpoint, models};
use anyhow::{bail, Result};
use ferrite_core::kv_layout::KvLayout;
use ferrite_core::prefix_hash::HashAlgo;
use ferrite_core::scheduler::{SchedulerConfig, StepTarget};
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
}

impl EngineArgs {
    /// These args with a Hugging Face id resolved to its file or folder in the cache.
    pub fn resolved(&self) -> Result<Self> {
        let model = crate::weights::hub::resolve(
            &self.model,
            self.revision.as_deref(),
            self.download_dir.as_deref(),
        )?;
        if model != self.model {
            tracing::info!("{} is {}", self.model.display(), model.display());
        }
        Ok(Self {
            model,
            ..self.clone()
        })
    }

    /// How the model pools, when it serves embeddings (`None`: it generates). An encoder
    /// cannot generate; a folder's sentence-transformers description says how to pool.
    pub fn pooling(&self) -> Result<Option<Pooling>> {
        let src = checkpoint::config_source(&self.model)?;
        let encoder = models::is_encoder(&src)?;
        if encoder && crate::models::bert::is_cross_encoder(&src)? {
            if self.runner == RunnerKind::Generate {
                bail!(
                    "{} is a cross-encoder: it scores pairs (--runner pooling)",
                    self.model.display()
                );
            }
            return Ok(Some(Pooling::cross_encoder()));
        }
        let dir = checkpoint::hf_config_path(&self.model);
        let described = match dir.parent().filter(|_| !checkpoint::is_gguf(&self.model)) {
            Some(dir) => Pooling::read(dir)?,
            None => None,
        };
        Ok(match self.runner {
            RunnerKind::Generate if encoder => {
                bail!(
                    "{} is an encoder: it serves embeddings (--runner pooling)",
                    self.model.display()
                )
            }
            RunnerKind::Generate => None,
            RunnerKind::Auto if !encoder && described.is_none() => None,
            _ => Some(described.unwrap_or_else(|| Pooling::default_for(encoder))),
        })
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

    /// These args as a pooling model runs: no prefix caching (a prompt's states are all
    /// pooled, and an encoder's depend on the tokens after them) and no speculation.
    pub fn for_pooling(&self) -> Self {
        if self.prefix_caching.is_some() {
            tracing::info!("prefix caching is off for an embedding model");
        }
        Self {
            prefix_caching: None,
            speculation: None,
            ..self.clone()
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

    /// Requests that speculate at once (at most the batch size speculation pauses above):
    /// with recurrent state, each holds `k` more state slots.
    fn draft_state_sets(&self) -> usize {
        self.speculation
            .as_ref()
            .map_or(0, |s| s.disable_by_batch_size.min(self.max_num_seqs))
    }

    /// The KV pool sized from `device_bytes` of memory once weights and activations are
    /// counted, and the scheduler configuration that hands it out.
    pub(crate) fn plan(
        &self,
        config: &ModelConfig,
        max_model_len: usize,
        device_bytes: u64,
        bytes: ModelBytes,
    ) -> Result<(MemoryPlan, SchedulerConfig)> {
        let layout = KvLayout::new(&config.layer_windows);
        let draft = bytes.draft.unwrap_or(DraftShare {
            weight_bytes: 0,
            bytes_per_block: 0,
        });
        // A pipeline stage stores the pages of its own layers.
        let slots = bytes.kv_slots.unwrap_or(layout.slots);
        let bytes_per_block = self.kv_block_bytes(config, slots) + draft.bytes_per_block;
        let state_bytes_per_slot = bytes.state_per_slot;
        let plan = memory::plan(&PlanInputs {
            device_bytes,
            utilization: self.gpu_memory_utilization,
            kv_cache_memory: self.kv_cache_memory,
            weight_bytes: bytes.weights + draft.weight_bytes,
            activation_bytes: bytes.activations,
            bytes_per_block,
            kv_dtype: self.kv_cache_dtype.resolve(self.device.auto_kv_dtype()),
            block_size: self.block_size,
            max_model_len,
            max_num_seqs: self.max_num_seqs,
            kv_groups: layout.groups.clone(),
            layers_per_block: slots,
            chunk: self.max_num_batched_tokens,
            state_bytes_per_slot,
            // A hit restores the recurrent state from a checkpoint: as many as requests.
            state_checkpoints: match self.prefix_caching {
                Some(_) => self.max_num_seqs,
                None => 0,
            },
            state_draft_slots: self.draft_state_sets()
                * self.speculation.as_ref().map_or(0, |s| s.k),
            draft: bytes.draft,
        })?;
        let scheduler = SchedulerConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len,
            block_size: self.block_size,
            num_blocks: plan.num_blocks,
            prefix_caching: self.prefix_caching,
            kv_groups: layout.groups,
            state_slots: plan.state_slots,
            state_checkpoints: plan.state_checkpoints,
            whole_prompts: false,
            step_time: None,
            speculation: self.speculation.clone(),
            draft_state_sets: match plan.state_slots {
                0 => 0,
                _ => self.draft_state_sets(),
            },
        };
        Ok((plan, scheduler))
    }
}

/// What a loaded model takes besides its KV pool, for [`EngineArgs::plan`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ModelBytes {
    pub weights: u64,
    pub activations: u64,
    /// One request's recurrent state (0 without linear-attention layers).
    pub state_per_slot: u64,
    /// A draft model's weights and K/V per block (speculation with a draft model).
    pub draft: Option<DraftShare>,
    /// Layers of a page this rank stores (a pipeline stage's); `None`: all.
    pub kv_slots: Option<usize>,
}

impl EngineArgs {
    /// Bytes of one KV block of a model with this config, `slots` layers a block.
    pub(crate) fn kv_block_bytes(&self, config: &ModelConfig, slots: usize) -> u64 {
        self.kv_cache_dtype
            .resolve(self.device.auto_kv_dtype())
            .block_bytes(self.block_size, config.num_kv_heads, config.head_dim, slots)
            as u64
    }
}

pub struct LoadedEngine {
    pub runner: ModelRunner,
    pub tokenizer: ModelTokenizer,
    pub scheduler: SchedulerConfig,
    pub plan: MemoryPlan,
    pub config: ModelConfig,
    /// An embedding model's pooling (`None`: the model generates).
    pub pooling: Option<Pooling>,
}

impl EngineArgs {
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

    /// The draft model's weights, and its K/V in each of the target's blocks.
    pub fn draft_share<B: Backend>(&self, draft: &Model<B>) -> DraftShare {
        DraftShare {
            weight_bytes: draft.weight_bytes() as u64,
            bytes_per_block: self.kv_block_bytes(&draft.config, draft.layout.slots),
        }
    }
}
