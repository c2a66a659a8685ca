//! Start-up, written once for every backend: open the device, load the family (or this
//! rank's share of it), run one step at the full token budget to measure its memory and fit
//! the step-cost model, size the KV pool from the budget, allocate it once and hand back a
//! runner. What a device does its own way is a [`Startup`]; `loader` picks one per
//! `--device`.

use crate::backend::Backend;
use crate::budget::ModelBytes;
use crate::checkpoint::{self, open_tokenizer, open_weights, read_config};
use crate::config::ModelConfig;
use crate::draft::{check_pair, DraftModel};
use crate::engine_args::EngineArgs;
use crate::memory::MemoryPlan;
use crate::models::{self, Model};
use crate::parallel::{self, Group};
use crate::pooling::Pooling;
use crate::runner::ModelRunner;
use crate::settings::RunnerKind;
use crate::step::PackedStep;
use crate::tokenizer::ModelTokenizer;
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use ferrite_core::scheduler::{SchedulerConfig, StepTarget, StepTime};
use ferrite_core::spec_decode::Proposer;
use ferrite_core::step_cost::StepCost;

/// What start-up does per device. A backend implements this beside [`Backend`].
pub trait Startup: Sized {
    type Backend: Backend + 'static;

    /// Opens the device for this process (`group`: its rank of a split model).
    fn open(args: &EngineArgs, group: Option<&Group>) -> Result<Self>;

    /// Refuses what this device does not run, before any weight is read.
    fn check(_args: &EngineArgs, _pooling: Option<&Pooling>) -> Result<()> {
        Ok(())
    }

    /// The memory the budget is a share of: this rank's part of the device's.
    fn memory_bytes(&self) -> u64;

    /// The backend of the model (this rank's share in `group`), holding `weights`.
    fn backend(
        &mut self,
        args: &EngineArgs,
        weights: &WeightSource,
        group: Option<Group>,
    ) -> Result<Self::Backend>;

    /// The backend of a draft model beside `main`.
    fn draft_backend(&self, args: &EngineArgs, main: &Self::Backend) -> Result<Self::Backend>;

    /// Runs `step` on `model` and returns the memory it took beyond what was held before.
    fn measure_step(model: &mut Model<Self::Backend>, step: &PackedStep) -> Result<u64>;

    /// Memory held beside the steps for the engine's life (decode graphs), for the plan.
    fn reserved_bytes(&self, _args: &EngineArgs, _config: &ModelConfig) -> u64 {
        0
    }

    /// The most bytes one layer's K/V pages may take (a GPU's largest storage binding).
    fn layer_pages_limit(&self) -> Option<u64> {
        None
    }

    /// KV blocks (and, for recurrent state, slots) kept past the scheduler's, for rows
    /// that pad a step out to a fixed shape.
    fn padding(&self) -> usize {
        0
    }

    /// The last of start-up, the pool allocated (capturing decode graphs).
    fn ready(
        &mut self,
        _model: &mut Model<Self::Backend>,
        _args: &EngineArgs,
        _plan: &MemoryPlan,
        _max_model_len: usize,
    ) -> Result<()> {
        Ok(())
    }
}

/// Loads everything on the device `S` opens. `progress(done, total)` follows weight loading.
pub fn load<S: Startup>(
    args: &EngineArgs,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<LoadedEngine> {
    let (args, pooling) = &resolved_for_task(args)?;
    S::check(args, pooling.as_ref())?;
    let split = args.world_size() > 1;
    if split && pooling.is_some() {
        bail!("embedding models are not split across ranks yet");
    }
    let max_model_len = args.max_model_len(&read_config(&args.model)?, pooling.as_ref())?;
    let tokenizer = open_tokenizer(&args.model)?;
    let (mut device, mut model) = open_rank::<S>(args, max_model_len, progress)?;
    if model.backend.group().is_some_and(|g| !g.leads()) {
        bail!("a following rank of a split model loads with `loader::follow`");
    }
    let config = model.config.clone();
    // The pool is sized from this rank's share: its KV heads, its part of the memory.
    let rank_config = ModelConfig {
        num_kv_heads: model.kv_heads()?,
        ..config.clone()
    };
    let tokens = args.max_num_batched_tokens;
    let calibrate = pooling.is_none() && args.step_target()?.is_some();
    let (activations, cost) = profile::<S>(&mut model, tokens, args.block_size, calibrate)?;
    let activations = activations + device.reserved_bytes(args, &config);
    // A draft model shares the target's blocks (its own pages of each) and the budget.
    let draft = match args.draft_model_path() {
        Some(path) => {
            let (src, mut weights) = open_weights(path, args.load_format)?;
            let backend = device.draft_backend(args, &model.backend)?;
            let mut d = models::load(backend, &src, &mut weights, max_model_len, progress)?;
            check_pair(&model, &tokenizer, &d, &open_tokenizer(path)?)?;
            d.set_kv_dtype(args.kv_cache_dtype);
            let (bytes, _) = profile::<S>(&mut d, tokens, args.block_size, false)?;
            Some((d, bytes))
        }
        None => None,
    };
    let bytes = ModelBytes {
        weights: model.weight_bytes() as u64,
        activations: activations + draft.as_ref().map_or(0, |d| d.1),
        state_per_slot: model.state_bytes_per_slot() as u64,
        draft: draft.as_ref().map(|(d, _)| args.draft_share(d)),
        kv_slots: split.then(|| model.kv_slots()),
        layer_pages_limit: device.layer_pages_limit(),
    };
    let (plan, mut scheduler) =
        args.plan(&rank_config, max_model_len, device.memory_bytes(), bytes)?;
    scheduler.whole_prompts = pooling.is_some();
    scheduler.step_time = step_time(args, cost)?;
    let pad = device.padding();
    let slots = plan.state_slots + plan.state_checkpoints + plan.state_draft_slots;
    model.allocate_state(slots + if plan.state_slots > 0 { pad } else { 0 })?;
    model.allocate_cache(plan.num_blocks + pad, args.block_size)?;
    device.ready(&mut model, args, &plan, max_model_len)?;
    let draft = match draft {
        Some((mut d, _)) => {
            d.allocate_cache(plan.num_blocks, args.block_size)?;
            Some(DraftModel::beside(&model, d, args.block_size))
        }
        None => None,
    };
    let runner = ModelRunner::new(Box::new(model), args.block_size, args.seed)
        .with_draft(draft)
        .with_mtp(drafts_with_mtp(args))
        .with_pooling(pooling.clone());
    Ok(LoadedEngine {
        runner,
        tokenizer,
        scheduler,
        plan,
        config,
        pooling: pooling.clone(),
    })
}

/// This process's share of the model on the device `S` opens (the whole model unless it is
/// a rank of a split one), KV cache not yet allocated.
pub fn load_rank<S: Startup>(
    args: &EngineArgs,
    max_model_len: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Model<S::Backend>> {
    Ok(open_rank::<S>(args, max_model_len, progress)?.1)
}

/// A following rank of a split model: loads its share and does what the leading rank
/// commands until it stops.
pub fn follow<S: Startup>(args: &EngineArgs) -> Result<()> {
    let (args, pooling) = &resolved_for_task(args)?;
    if pooling.is_some() {
        bail!("embedding models are not split across ranks yet");
    }
    let max_model_len = args.max_model_len(&read_config(&args.model)?, None)?;
    load_rank::<S>(args, max_model_len, &mut |_, _| {})?.follow()
}

fn open_rank<S: Startup>(
    args: &EngineArgs,
    max_model_len: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(S, Model<S::Backend>)> {
    let group = parallel::join(args.tensor_parallel_size, args.pipeline_parallel_size)?;
    if group.is_some() && args.speculation.is_some() {
        bail!("--speculative-config with --tensor-parallel-size or --pipeline-parallel-size: not built yet");
    }
    let mut device = S::open(args, group.as_ref())?;
    let (src, mut weights) = open_weights(&args.model, args.load_format)?;
    let mtp = group.is_none() && drafts_with_mtp(args);
    let backend = device.backend(args, &weights, group)?;
    let mut model = match mtp {
        true => models::load_with_mtp(backend, &src, &mut weights, max_model_len, progress)?,
        false => models::load(backend, &src, &mut weights, max_model_len, progress)?,
    };
    model.set_kv_dtype(args.kv_cache_dtype);
    Ok((device, model))
}

/// Peak extra memory of one step of `tokens` prompt tokens (at most the model's context),
/// measured by running it on a small scratch pool; and the step-cost model fitted to timed
/// steps on the same pool (`calibrate`).
fn profile<S: Startup>(
    model: &mut Model<S::Backend>,
    tokens: usize,
    block_size: usize,
    calibrate: bool,
) -> Result<(u64, Option<StepCost>)> {
    let tokens = tokens.min(model.max_positions());
    model.allocate_cache(tokens.div_ceil(block_size), block_size)?;
    model.allocate_state(1)?;
    // Every group writes the same blocks: the values are garbage, the memory is real.
    let groups = model.layout.groups.len();
    let step = PackedStep::profile(tokens, block_size, model.config.vocab_size, groups);
    let bytes = S::measure_step(model, &step)?;
    let cost = calibrate
        .then(|| crate::calibrate::step_cost(model, block_size, groups, tokens))
        .transpose()?;
    model.allocate_cache(0, block_size)?;
    Ok((bytes, cost))
}

/// Whether `--speculative-config` drafts with the model's own MTP head.
fn drafts_with_mtp(args: &EngineArgs) -> bool {
    args.speculation
        .as_ref()
        .is_some_and(|s| s.proposer == Proposer::Mtp)
}

/// The step-time target with the cost model fitted at start-up (`None`: no target, or a
/// model that never decodes).
fn step_time(args: &EngineArgs, cost: Option<StepCost>) -> Result<Option<StepTime>> {
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
pub(crate) fn resolved_for_task(args: &EngineArgs) -> Result<(EngineArgs, Option<Pooling>)> {
    let args = args.resolved()?;
    let pooling = args.pooling()?;
    Ok(match pooling {
        Some(_) => (args.for_pooling(), pooling),
        None => (args, None),
    })
}

/// What start-up hands back: the runner, and what the engine and the server need beside it.
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
}
