//! [`Model`]: a loaded family with its KV cache on one backend, what the runner drives each
//! step (it serves encoders too: their step pools instead of sampling).

use super::family::{drop_activations, state_bytes, Buffers, Family};
use crate::backend::{Backend, MoeBytes, Step};
use crate::config::ModelConfig;
use crate::kv_dtype::KvCacheDtype;
use crate::parallel::group::Command;
use crate::step::PackedStep;
use crate::step::{DeviceDraws, RowDraw, StepModel};
use anyhow::{bail, Context, Result};
use ferrite_core::kv_layout::KvLayout;
use std::borrow::Cow;

/// A family with its weights and KV cache on one backend.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub backend: B,
    family: Box<dyn Family<B>>,
    pub layout: KvLayout,
    /// One per slot of the layout: layer `l` lives in `cache[layout.layer_slot[l]]`.
    cache: Vec<B::LayerCache>,
    /// How the pages store K/V (`--kv-cache-dtype`), for every later [`Self::allocate_cache`].
    kv_dtype: KvCacheDtype,
    /// One per linear-attention layer, `state_slots` requests each.
    states: Vec<B::StateCache>,
    buffers: Buffers<B>,
    /// The last step left its residual stream in `buffers.x` for an MTP head.
    hidden_kept: bool,
    max_positions: usize,
    /// A model split across ranks: the last step's logits gathered whole (on the leader).
    logits: Vec<f32>,
}

impl<B: Backend> Model<B> {
    /// A loaded family, its KV cache not yet allocated.
    pub(super) fn new(
        config: ModelConfig,
        backend: B,
        family: Box<dyn Family<B>>,
        layout: KvLayout,
        max_positions: usize,
    ) -> Self {
        Self {
            config,
            backend,
            family,
            layout,
            cache: Vec::new(),
            kv_dtype: KvCacheDtype::Auto,
            states: Vec::new(),
            buffers: Buffers::default(),
            hidden_kept: false,
            max_positions,
            logits: Vec::new(),
        }
    }

    /// Allocates the KV pool once: `num_blocks` pages of `block_size` tokens, each holding
    /// one layer of every KV group.
    pub fn allocate_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<()> {
        self.lead(&Command::AllocateCache {
            blocks: num_blocks,
            block_size,
        })?;
        let c = &self.config;
        let kv_heads = self.kv_heads()?;
        let local = self.local_slots();
        self.cache.clear();
        for local in local {
            // A pipeline stage keeps the pages of its own layers only.
            let num_blocks = if local { num_blocks } else { 0 };
            let l = self.backend.layer_cache(
                num_blocks,
                block_size,
                kv_heads,
                c.head_dim,
                self.kv_dtype,
            )?;
            self.cache.push(l);
        }
        Ok(())
    }

    /// Stores K/V as `dtype` in every cache allocated from now on.
    pub fn set_kv_dtype(&mut self, dtype: KvCacheDtype) {
        self.kv_dtype = dtype;
    }

    /// Reserves the recurrent state of `slots` requests for every linear-attention layer
    /// (nothing for a model without any).
    pub fn allocate_state(&mut self, slots: usize) -> Result<()> {
        self.lead(&Command::AllocateState { slots })?;
        self.states = self
            .family
            .state_layers()
            .iter()
            .map(|spec| self.backend.state_cache(slots, spec))
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// Bytes of one request's recurrent state across the model (f32), 0 for a model
    /// without linear-attention layers.
    pub fn state_bytes_per_slot(&self) -> usize {
        state_bytes(&self.family.state_layers())
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// The KV heads this rank keeps (its tensor-parallel share).
    pub fn kv_heads(&self) -> Result<usize> {
        let kv = self
            .backend
            .tensor_parallel()
            .kv_heads(self.config.num_kv_heads)?;
        Ok(kv.len())
    }

    /// Which slots of the layout hold this pipeline stage's layers (all, unless split).
    fn local_slots(&self) -> Vec<bool> {
        let stage = self.backend.pipeline_stage();
        let mut local = vec![false; self.layout.slots];
        for layer in stage.layers(self.layout.layer_slot.len()) {
            local[self.layout.layer_slot[layer]] = true;
        }
        local
    }

    /// Layers of a KV page this rank stores.
    pub fn kv_slots(&self) -> usize {
        self.local_slots().iter().filter(|&&l| l).count()
    }

    /// On the leading rank of a split model, sends `c` to every rank before doing it.
    fn lead(&self, c: &Command) -> Result<()> {
        match self.backend.group() {
            Some(g) if g.leads() => g.command(c),
            _ => Ok(()),
        }
    }

    /// A following rank's life: does what the leader commands until it says stop.
    pub fn follow(&mut self) -> Result<()> {
        let g = self
            .backend
            .group()
            .cloned()
            .context("a rank outside a group")?;
        loop {
            match g.next_command()? {
                Command::AllocateCache { blocks, block_size } => {
                    self.allocate_cache(blocks, block_size)?
                }
                Command::AllocateState { slots } => self.allocate_state(slots)?,
                Command::Step(step) => self.run_split(&step)?,
                Command::Stop => return Ok(()),
            }
        }
    }

    /// A step of a split model, on every rank. Pipeline stages take its requests in
    /// micro-batches, so a stage works on one while the next stage works on the one
    /// before; the last stage's logits reach the leader once all are done.
    fn run_split(&mut self, step: &PackedStep) -> Result<()> {
        let g = self
            .backend
            .group()
            .cloned()
            .context("a rank outside a group")?;
        self.logits
            .resize(step.logits_indices.len() * self.config.vocab_size, 0.0);
        let parts = match g.pp.stages {
            1 => Vec::new(),
            n => step.micro_batches(n),
        };
        let parts: Vec<&PackedStep> = match parts.is_empty() {
            true => vec![step],
            false => parts.iter().collect(),
        };
        let mut row = 0;
        for part in parts {
            self.run_local(part, None)?;
            if g.pp.is_last() {
                self.gather_logits(part.logits_indices.len(), row)?;
            }
            row += part.logits_indices.len();
        }
        if g.pp.stages > 1 {
            let last = g.world_rank(g.pp.stages - 1, 0);
            if g.leads() {
                g.world.recv(last, &mut self.logits)?;
            } else if g.world.rank() == last {
                g.world.send(0, &self.logits)?;
            }
        }
        Ok(())
    }

    /// On the last stage, after a micro-batch of `rows` logits rows: each tensor-parallel
    /// rank's share of the vocabulary, whole in rows `first..` of `self.logits` on its
    /// tensor-parallel rank 0.
    fn gather_logits(&mut self, rows: usize, first: usize) -> Result<()> {
        // A micro-batch of prefill chunks only: nothing to gather (every rank of the group
        // skips it alike), whatever a backend left as its logits.
        if rows == 0 {
            return Ok(());
        }
        let g = self
            .backend
            .group()
            .cloned()
            .context("a rank outside a group")?;
        let vocab = self.config.vocab_size;
        let per = g.tp.vocab_rows(vocab);
        let local = self.backend.host_logits()?;
        let mut parts = vec![
            0.0;
            if g.tp.rank == 0 {
                rows * per * g.tp.size
            } else {
                0
            }
        ];
        g.tensor.gather(0, local, &mut parts)?;
        if g.tp.rank != 0 {
            return Ok(());
        }
        let out = &mut self.logits[first * vocab..(first + rows) * vocab];
        for (r, out) in out.chunks_mut(vocab).enumerate() {
            for (k, out) in out.chunks_mut(per).enumerate() {
                out.copy_from_slice(&parts[(k * rows + r) * per..][..out.len()]);
            }
        }
        Ok(())
    }

    pub fn weight_bytes(&self) -> usize {
        self.family.weight_bytes(&self.backend)
    }

    pub fn expert_bytes(&self) -> MoeBytes {
        self.family.expert_bytes(&self.backend)
    }

    /// Positions and token ids within what the model serves.
    fn check(&self, step: &PackedStep) -> Result<()> {
        step.check(self.max_positions, self.config.vocab_size)?;
        if self.cache.len() != self.layout.slots {
            bail!("KV cache not allocated");
        }
        let stateful = !self.family.state_layers().is_empty();
        if stateful && self.states.is_empty() {
            bail!("recurrent state not allocated");
        }
        if stateful && step.state.slots.len() != step.num_seqs() {
            bail!(
                "{} state slots for {} requests",
                step.state.slots.len(),
                step.num_seqs()
            );
        }
        if step.kv.len() != self.layout.groups.len() {
            bail!(
                "{} block tables for {} KV groups",
                step.kv.len(),
                self.layout.groups.len()
            );
        }
        Ok(())
    }
}

impl<B: Backend> Model<B> {
    /// The family's forward over `step` on the backend, logits left there (a device may
    /// still be running it).
    pub fn launch(&mut self, step: &PackedStep) -> Result<()> {
        self.run(step, None)
    }

    fn run(&mut self, step: &PackedStep, draws: Option<DeviceDraws>) -> Result<()> {
        self.check(step)?;
        if step.pooling.on && self.backend.group().is_some() {
            bail!("pooling steps on a model split across ranks");
        }
        self.lead(&Command::Step(Box::new(Cow::Borrowed(step))))?;
        let Some(g) = self.backend.group().cloned() else {
            return self.run_local(step, draws);
        };
        // The other ranks are inside this step: a failure here cannot be one request's.
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_split(step)));
        match run {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                tracing::error!("a step of the split model failed; stopping every rank: {e:#}");
                g.world.abort(1)
            }
            Err(_) => {
                tracing::error!("a step of the split model panicked; stopping every rank");
                g.world.abort(1)
            }
        }
    }

    /// [`Self::run`] on this rank alone.
    fn run_local(&mut self, step: &PackedStep, draws: Option<DeviceDraws>) -> Result<()> {
        let (family, cache, ws) = (&self.family, &mut self.cache, &mut self.buffers);
        let states = &mut self.states;
        self.hidden_kept = false;
        let kept = &mut self.hidden_kept;
        let mut forward = |b: &mut B, s: &Step<B>| {
            let r = family.forward(b, s, cache, states, ws);
            drop_activations(ws, s.host.hidden.keep);
            *kept = r.is_ok() && (B::REUSES_ACTIVATIONS || s.host.hidden.keep);
            r
        };
        self.backend.step(step, draws, &mut forward)
    }

    /// The KV pages, one per slot of the layout (benchmarks fill them).
    pub fn caches_mut(&mut self) -> &mut [B::LayerCache] {
        &mut self.cache
    }
}

impl<B: Backend> StepModel for Model<B> {
    fn forward(&mut self, step: &PackedStep) -> Result<&mut [f32]> {
        self.run(step, None)?;
        match self.backend.group() {
            Some(_) => Ok(&mut self.logits),
            None => self.backend.host_logits(),
        }
    }

    fn forward_argmax(&mut self, step: &PackedStep) -> Result<Vec<u32>> {
        if self.draws_on_device() {
            let greedy = vec![RowDraw::Greedy; step.logits_indices.len()];
            let d = DeviceDraws {
                rows: &greedy,
                masks: None,
            };
            return self.forward_draw(step, d);
        }
        let vocab = self.vocab_size();
        let logits = self.forward(step)?;
        Ok(logits.chunks(vocab).map(crate::sampler::argmax).collect())
    }

    fn draws_on_device(&self) -> bool {
        self.backend.draws_on_device()
    }

    fn forward_draw(&mut self, step: &PackedStep, draws: DeviceDraws) -> Result<Vec<u32>> {
        self.run(step, Some(draws))?;
        self.backend.drawn_tokens()
    }

    /// The multi-token-prediction head over `step`: rows of the step [`StepModel::forward`]
    /// just ran (`step.hidden.rows`, or all) with each row's token moved one ahead (the next
    /// prompt token, or the token sampled after it); `chained`: rows of the head's own last
    /// step instead, each one position on. Its logits on the host. It reads the activations
    /// the last step left, so only on a backend that keeps them.
    fn forward_mtp(&mut self, step: &PackedStep, chained: bool) -> Result<&mut [f32]> {
        if !self.family.has_mtp() || self.backend.group().is_some() {
            bail!("this model has no multi-token-prediction head");
        }
        if !self.hidden_kept {
            bail!("the MTP head runs after a step that kept its hidden states (hidden.keep)");
        }
        self.check(step)?;
        let (family, cache, ws) = (&self.family, &mut self.cache, &mut self.buffers);
        self.hidden_kept = false;
        let kept = &mut self.hidden_kept;
        // The head's own residual stream stays for a chained pass.
        let mut forward = |b: &mut B, s: &Step<B>| {
            let r = family.mtp(b, s, cache, ws, chained);
            drop_activations(ws, true);
            *kept = r.is_ok();
            r
        };
        self.backend.step(step, None, &mut forward)?;
        self.backend.host_logits()
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn describe(&self) -> String {
        format!("{} ({})", self.backend.describe(), self.config.architecture)
    }
}

impl<B: Backend> Drop for Model<B> {
    /// The leader of a split model tells the other ranks to stop with it.
    fn drop(&mut self) {
        if let Err(e) = self.lead(&Command::Stop) {
            tracing::warn!("stopping the other ranks: {e:#}");
        }
    }
}
