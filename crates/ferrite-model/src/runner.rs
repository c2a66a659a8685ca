//! The model runner: packs a [`SchedulerOutput`] into one flat step, runs the model once,
//! samples the rows that need a token and computes requested prompt logprobs.

use crate::draft::DraftModel;
use crate::pooling::Pooling;
use crate::sampler::{log_sum_exp, logprob_and_rank, top_k_logprobs, Sampler};
use crate::step::{DeviceDraws, Masks, PackedStep, RowDraw, StepModel, NO_SLOT};
use anyhow::Result;
use ferrite_core::constraint::Constraint;
use ferrite_core::engine::{ExecError, Executor};
use ferrite_core::output::{SampledToken, StepOutput, TokenLogprob};
use ferrite_core::scheduler::{SampleSpec, ScheduledRequest, SchedulerOutput};
use rayon::prelude::*;
use std::collections::{HashMap, HashSet};

/// `f`'s value, or the message of its panic: a row's failure stays that row's.
fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        format!("internal error while sampling: {msg}")
    })
}

pub struct ModelRunner {
    pub model: Box<dyn StepModel>,
    sampler: Sampler,
    block_size: usize,
    /// An embedding model's pooling: its steps' outputs are pooled hidden states.
    pooling: Option<Pooling>,
    /// What proposes the next step's drafts after each step, if anything does.
    proposer: Option<StepProposer>,
}

/// A proposer that runs after the target's step.
enum StepProposer {
    DraftModel(DraftModel),
    /// The target's own multi-token-prediction head.
    Mtp,
}

/// A sampled row that needs nothing a device draw lacks: no logprobs, bans, penalties or
/// biases (a grammar the device applies as a mask).
fn drawable(spec: &SampleSpec) -> bool {
    spec.params.logprobs.is_none()
        && spec.banned_token_ids.is_empty()
        && spec.penalty_context.is_none()
        && spec.params.logit_bias.is_empty()
        && spec.params.allowed_token_ids.is_none()
}

/// What a row of the logits matrix is for.
enum RowUse {
    /// Request index and the row's place in its draft window (0: after the last known token).
    Sample(usize, usize),
    /// Request index and the prompt token this row predicts.
    PromptLogprob(usize, u32, usize),
}

/// A pooled request of a step: its index, and how many rows (consecutive, in order) it has.
type PoolRows = (usize, usize);

impl ModelRunner {
    pub fn new(model: Box<dyn StepModel>, block_size: usize, seed: Option<u64>) -> Self {
        Self {
            model,
            sampler: Sampler::new(seed),
            block_size,
            pooling: None,
            proposer: None,
        }
    }

    /// This runner with a draft model proposing the next step's drafts after each step.
    pub fn with_draft(self, draft: Option<DraftModel>) -> Self {
        match draft {
            Some(d) => Self {
                proposer: Some(StepProposer::DraftModel(d)),
                ..self
            },
            None => self,
        }
    }

    /// This runner with the model's MTP head proposing after each step (the model was
    /// loaded with it).
    pub fn with_mtp(self, mtp: bool) -> Self {
        match mtp {
            true => Self {
                proposer: Some(StepProposer::Mtp),
                ..self
            },
            false => self,
        }
    }

    /// Backends, threads and weight formats of the model (and the draft model).
    pub fn describe(&self) -> String {
        match &self.proposer {
            Some(StepProposer::DraftModel(d)) => {
                format!("{}; draft model: {}", self.model.describe(), d.describe())
            }
            Some(StepProposer::Mtp) => {
                format!("{}; drafts from its MTP head", self.model.describe())
            }
            None => self.model.describe(),
        }
    }

    /// This runner for an embedding model that pools as `pooling` (`None`: it generates).
    pub fn with_pooling(self, pooling: Option<Pooling>) -> Self {
        Self { pooling, ..self }
    }

    /// A pooling step's result: each pooled request's rows as one vector.
    fn pool(
        &mut self,
        step: &PackedStep,
        pools: &[PoolRows],
        out: &SchedulerOutput,
    ) -> Result<StepOutput> {
        let Some(pooling) = self.pooling.clone() else {
            anyhow::bail!("a pooling request on a model that generates");
        };
        let states = self.model.forward(step)?;
        let width = states.len() / step.logits_indices.len().max(1);
        let mut result = StepOutput::default();
        let mut row = 0;
        for &(i, n) in pools {
            let rows = &states[row * width..(row + n) * width];
            result
                .pooled
                .insert(out.requests[i].req_id, pooling.pool(rows, width));
            row += n;
        }
        Ok(result)
    }

    fn draw(&mut self, spec: &SampleSpec) -> RowDraw {
        let p = &spec.params;
        if p.is_greedy() {
            return RowDraw::Greedy;
        }
        RowDraw::Sample {
            temperature: p.temperature,
            top_k: p.top_k().map_or(0, |k| k.min(u32::MAX as usize) as u32),
            top_p: p.top_p,
            min_p: p.min_p,
            key: self.sampler.row_key(spec),
        }
    }

    fn pack(&self, out: &SchedulerOutput) -> (PackedStep, Vec<RowUse>, Vec<PoolRows>) {
        let bs = self.block_size;
        let mut step = PackedStep::default();
        let mut uses = Vec::new();
        let mut pools = Vec::new();
        for (i, r) in out.requests.iter().enumerate() {
            let first_row = step.num_tokens();
            step.push(&r.token_ids, r.start_pos, &r.block_tables, bs);
            if let Some(st) = &r.state {
                step.state.slots.push(st.slot);
                step.state.restores.push(st.restore.unwrap_or(NO_SLOT));
                let save = st.save.map_or([0, NO_SLOT], |(n, s)| [n as u32, s]);
                step.state.saves.push(save);
                let known = r.token_ids.len() - r.spec.draft.len();
                let drafts = st.drafts.map_or([0, NO_SLOT], |s| [known as u32, s]);
                step.state.drafts.push(drafts);
            }
            if let Some(pl) = &r.prompt_logprobs {
                for (j, &target) in pl.targets.iter().enumerate() {
                    step.logits_indices
                        .push((first_row + pl.first_row + j) as u32);
                    uses.push(RowUse::PromptLogprob(i, target, pl.num_alternatives));
                }
            }
            let types = &r.pooling.token_type_ids;
            if !types.is_empty() || !step.pooling.token_types.is_empty() {
                // Segments for every token once one request has them (0 for the others).
                step.pooling.token_types.resize(first_row, 0);
                match types.is_empty() {
                    true => step.pooling.token_types.resize(step.num_tokens(), 0),
                    false => step.pooling.token_types.extend(types),
                }
            }
            if r.pooling.pool {
                // Prompts of a pooling model are computed whole: the chunk is the prompt.
                let rows = self
                    .pooling
                    .as_ref()
                    .map_or(0..0, |p| p.rows(r.token_ids.len()));
                pools.push((i, rows.len()));
                step.logits_indices
                    .extend(rows.map(|j| (first_row + j) as u32));
                step.pooling.on = true;
            }
            // Prompt-logprob rows end before the last prompt token, so these rows are new:
            // the last known token's and each draft token's.
            if r.sample.is_some() {
                let end = step.num_tokens();
                let drafts = r.spec.draft.len();
                for j in 0..=drafts {
                    step.logits_indices.push((end - 1 - drafts + j) as u32);
                    uses.push(RowUse::Sample(i, j));
                }
            }
        }
        step.finish();
        (step, uses, pools)
    }
}

impl Executor for ModelRunner {
    fn execute(&mut self, out: &SchedulerOutput) -> Result<StepOutput, ExecError> {
        let (mut step, uses, pools) = self.pack(out);
        step.hidden.keep = matches!(self.proposer, Some(StepProposer::Mtp))
            && out.requests.iter().any(|r| r.spec.mtp_run.is_some());
        let mut result = self.run_step(out, &step, uses, &pools)?;
        result.drafts = match &mut self.proposer {
            Some(StepProposer::DraftModel(d)) => d.propose(out, &result.sampled)?,
            Some(StepProposer::Mtp) => crate::mtp_draft::propose(
                self.model.as_mut(),
                out,
                &step,
                &result.sampled,
                self.block_size,
            )?,
            None => HashMap::new(),
        };
        Ok(result)
    }
}

impl ModelRunner {
    /// The target's step: the packed forward pass, its drafts verified and its rows sampled.
    /// Rows the device can draw come back as tokens (argmax or drawn there); the rest are
    /// sampled on the host from their logits.
    fn run_step(
        &mut self,
        out: &SchedulerOutput,
        step: &PackedStep,
        uses: Vec<RowUse>,
        pools: &[PoolRows],
    ) -> Result<StepOutput, ExecError> {
        if step.pooling.on {
            return Ok(self.pool(step, pools, out)?);
        }
        if let Some(specs) = device_specs(out, &uses) {
            let constrained = specs.iter().any(|s| s.constraint.is_some());
            if specs.iter().all(|s| s.params.is_greedy()) && !constrained {
                let tokens = self.model.forward_argmax(step)?;
                return Ok(accept_drawn(out, &specs, uses, tokens, HashMap::new()));
            }
            if self.model.draws_on_device() {
                let (tokens, failed) = self.forward_draw(step, &specs)?;
                return Ok(accept_drawn(out, &specs, uses, tokens, failed));
            }
        }
        self.sample_on_host(out, step, uses)
    }

    /// Runs the step drawing every row on the device, grammar masks filled while it runs.
    /// Returns the tokens and the rows whose grammar failed (drawn unmasked, then dropped).
    fn forward_draw(
        &mut self,
        step: &PackedStep,
        specs: &[&SampleSpec],
    ) -> Result<(Vec<u32>, HashMap<usize, String>)> {
        let draws: Vec<RowDraw> = specs.iter().map(|s| self.draw(s)).collect();
        let failed = std::sync::Mutex::new(HashMap::new());
        let mask = |row: usize, dst: &mut [u32], s: &SampleSpec| {
            let Some(c) = &s.constraint else {
                return;
            };
            match catch(|| c.allowed()) {
                Ok(m) => {
                    let n = m.len().min(dst.len());
                    dst[..n].copy_from_slice(&m[..n]);
                    dst[n..].fill(0);
                }
                Err(e) => {
                    dst.fill(u32::MAX);
                    failed.lock().unwrap().insert(row, e);
                }
            }
        };
        let masked: Vec<bool> = specs.iter().map(|s| s.constraint.is_some()).collect();
        // A few rows are masked here: waking the pool's threads costs about a mask.
        let few = masked.iter().filter(|&&m| m).count() < 4;
        let fill = |out: &mut [u32], words: usize| {
            if few {
                let rows = out.chunks_mut(words).zip(specs).enumerate();
                rows.for_each(|(row, (dst, s))| mask(row, dst, s));
            } else {
                let rows = out.par_chunks_mut(words).zip(specs).enumerate();
                rows.for_each(|(row, (dst, s))| mask(row, dst, s));
            }
        };
        let d = DeviceDraws {
            rows: &draws,
            masks: masked.contains(&true).then_some(Masks {
                rows: &masked,
                fill: &fill,
            }),
        };
        let tokens = self.model.forward_draw(step, d)?;
        Ok((tokens, failed.into_inner().unwrap()))
    }

    /// The host path: every row's logits (grammar masks computed on another thread while
    /// the step runs: each depends only on the tokens committed before it), then each row
    /// sampled, its draft verified, or its prompt logprob taken.
    fn sample_on_host(
        &mut self,
        out: &SchedulerOutput,
        step: &PackedStep,
        uses: Vec<RowUse>,
    ) -> Result<StepOutput, ExecError> {
        let vocab = self.model.vocab_size();
        let constrained: Vec<(usize, Constraint)> = uses
            .iter()
            .enumerate()
            .filter_map(|(row, u)| match u {
                RowUse::Sample(i, _) => out.requests[*i]
                    .sample
                    .as_ref()
                    .and_then(|s| s.constraint.clone())
                    .map(|c| (row, c)),
                RowUse::PromptLogprob(..) => None,
            })
            .collect();
        let model = &mut self.model;
        let (logits, masks) = std::thread::scope(|scope| {
            let masks = (!constrained.is_empty()).then(|| {
                scope.spawn(|| {
                    // A grammar that fails fails its row only (an empty mask marks it).
                    constrained
                        .iter()
                        .map(|(row, c)| (*row, catch(|| c.allowed())))
                        .collect::<HashMap<usize, Result<Vec<u32>, String>>>()
                })
            });
            let logits = model.forward(step);
            let masks = masks
                .map(|h| h.join().expect("mask thread"))
                .unwrap_or_default();
            (logits, masks)
        });
        let logits = logits?;
        let mut result = StepOutput::default();
        // Requests whose draft window ended at a rejected draft.
        let mut ended = HashSet::new();
        for (n, (row, u)) in logits.chunks_mut(vocab).zip(uses).enumerate() {
            match u {
                RowUse::Sample(i, j) if !out.requests[i].spec.draft.is_empty() => {
                    // Rows after a rejected draft are not looked at.
                    if ended.contains(&i) {
                        continue;
                    }
                    let r = &out.requests[i];
                    if !verify_row(&mut self.sampler, r, row, j, &mut result) {
                        ended.insert(i);
                    }
                }
                RowUse::Sample(i, _) => {
                    let r = &out.requests[i];
                    let spec = r.sample.as_ref().expect("sampled row has a spec");
                    let drawn = match masks.get(&n) {
                        Some(Err(e)) => Err(e.clone()),
                        Some(Ok(mask)) => catch(|| self.sampler.sample(row, spec, Some(mask))),
                        None => catch(|| self.sampler.sample(row, spec, None)),
                    };
                    let drawn = drawn.and_then(|sampled| {
                        if let Some(c) = &spec.constraint {
                            catch(|| c.commit(sampled.token_id))?;
                        }
                        Ok(sampled)
                    });
                    match drawn {
                        Ok(sampled) => {
                            result.sampled.insert(r.req_id, vec![sampled]);
                        }
                        Err(e) => {
                            result.failed.insert(r.req_id, e);
                        }
                    }
                }
                RowUse::PromptLogprob(i, target, k) => {
                    let lse = log_sum_exp(row);
                    let (logprob, rank) = logprob_and_rank(row, target, lse);
                    result
                        .prompt_logprobs
                        .entry(out.requests[i].req_id)
                        .or_default()
                        .push(TokenLogprob {
                            token_id: target,
                            logprob,
                            rank,
                            top: top_k_logprobs(row, k, lse),
                        });
                }
            }
        }
        Ok(result)
    }
}

/// Each row's sampling spec when every row samples a token the device can draw. A draft
/// drawn from a distribution is verified against that distribution, on the host.
fn device_specs<'a>(out: &'a SchedulerOutput, uses: &[RowUse]) -> Option<Vec<&'a SampleSpec>> {
    let drafts_sampled = out.requests.iter().any(|r| {
        !r.spec.draft.is_empty() && r.sample.as_ref().is_some_and(|s| !s.params.is_greedy())
    });
    if drafts_sampled {
        return None;
    }
    let specs: Vec<&SampleSpec> = uses
        .iter()
        .map(|u| match u {
            RowUse::Sample(i, _) => out.requests[*i].sample.as_ref(),
            RowUse::PromptLogprob(..) => None,
        })
        .collect::<Option<_>>()?;
    specs.iter().all(|s| drawable(s)).then_some(specs)
}

/// The step's result from tokens the device drew: a greedy draft holds while it is the
/// argmax, and the first that is not ends its window with the argmax instead.
fn accept_drawn(
    out: &SchedulerOutput,
    specs: &[&SampleSpec],
    uses: Vec<RowUse>,
    tokens: Vec<u32>,
    failed: HashMap<usize, String>,
) -> StepOutput {
    let mut result = StepOutput::default();
    for (row, (token_id, u)) in tokens.into_iter().zip(uses).enumerate() {
        let RowUse::Sample(i, j) = u else {
            unreachable!("only sampled rows are drawn")
        };
        let r = &out.requests[i];
        if let Some(e) = failed.get(&row) {
            result.failed.insert(r.req_id, e.clone());
            continue;
        }
        let drawn = result.sampled.entry(r.req_id).or_default();
        if drawn.len() < j
            || drawn
                .get(j.wrapping_sub(1))
                .is_some_and(|t| t.token_id != r.spec.draft[j - 1])
        {
            continue;
        }
        if let Some(c) = &specs[row].constraint {
            c.commit(token_id);
        }
        drawn.push(SampledToken {
            token_id,
            logprobs: None,
        });
    }
    result
}

/// Row `j` of `r`'s draft window on the host: its draft verified (or, past the drafts, a
/// token sampled) into `result`. False once the window has ended here (a rejected draft, or
/// a failure).
fn verify_row(
    sampler: &mut Sampler,
    r: &ScheduledRequest,
    row: &mut [f32],
    j: usize,
    result: &mut StepOutput,
) -> bool {
    if result.failed.contains_key(&r.req_id) {
        return false;
    }
    let spec = r.sample.as_ref().expect("sampled row has a spec");
    let spec = SampleSpec {
        output_index: spec.output_index + j,
        ..spec.clone()
    };
    let mut held = true;
    let drawn = match r.spec.draft.get(j) {
        Some(&d) => catch(|| sampler.verify(row, &spec, d)).map(|v| {
            held = v.is_ok();
            v.map_or_else(|t| t, |()| d)
        }),
        None => catch(|| sampler.sample(row, &spec, None).token_id),
    };
    match drawn {
        Ok(token_id) => {
            let sampled = SampledToken {
                token_id,
                logprobs: None,
            };
            result.sampled.entry(r.req_id).or_default().push(sampled);
            held
        }
        Err(e) => {
            result.sampled.remove(&r.req_id);
            result.failed.insert(r.req_id, e);
            false
        }
    }
}
