//! The model runner: packs a [`SchedulerOutput`] into one flat step, runs the model once,
//! samples the rows that need a token and computes requested prompt logprobs.

use crate::sampler::{argmax, log_sum_exp, logprob_and_rank, top_k_logprobs, Sampler};
use crate::step::PackedStep;
use anyhow::Result;
use ferrite_core::engine::{ExecError, Executor};
use ferrite_core::output::{SampledToken, StepOutput, TokenLogprob};
use ferrite_core::scheduler::{SampleSpec, SchedulerOutput};

/// A model with its KV cache on some device: what the runner drives each step.
pub trait StepModel: Send {
    /// Runs the packed step; returns `[logits_indices.len(), vocab]` logits on the host.
    fn forward(&mut self, step: &PackedStep) -> Result<&mut [f32]>;

    /// Runs the step and returns the argmax of each logits row. A device overrides this to
    /// send token ids to the host instead of whole logits rows.
    fn forward_argmax(&mut self, step: &PackedStep) -> Result<Vec<u32>> {
        let vocab = self.vocab_size();
        Ok(self.forward(step)?.chunks(vocab).map(argmax).collect())
    }

    fn vocab_size(&self) -> usize;

    /// Backend, threads and weight format, for the start-up log line.
    fn describe(&self) -> String;
}

pub struct ModelRunner {
    pub model: Box<dyn StepModel>,
    sampler: Sampler,
    block_size: usize,
}

/// A sampled row that needs nothing but the argmax of the raw logits.
fn plain_greedy(spec: &SampleSpec) -> bool {
    spec.params.is_greedy()
        && spec.params.logprobs.is_none()
        && spec.banned_token_ids.is_empty()
        && spec.penalty_context.is_none()
}

/// What a row of the logits matrix is for.
enum RowUse {
    Sample(usize),
    /// Request index and the prompt token this row predicts.
    PromptLogprob(usize, u32, usize),
}

impl ModelRunner {
    pub fn new(model: Box<dyn StepModel>, block_size: usize, seed: Option<u64>) -> Self {
        Self {
            model,
            sampler: Sampler::new(seed),
            block_size,
        }
    }

    fn pack(&self, out: &SchedulerOutput) -> (PackedStep, Vec<RowUse>) {
        let bs = self.block_size;
        let mut step = PackedStep::default();
        let mut uses = Vec::new();
        for (i, r) in out.requests.iter().enumerate() {
            let first_row = step.num_tokens();
            step.push(&r.token_ids, r.start_pos, &r.block_table, bs);
            if let Some(pl) = &r.prompt_logprobs {
                for (j, &target) in pl.targets.iter().enumerate() {
                    step.logits_indices
                        .push((first_row + pl.first_row + j) as u32);
                    uses.push(RowUse::PromptLogprob(i, target, pl.num_alternatives));
                }
            }
            // Prompt-logprob rows end before the last prompt token, so this row is new.
            if r.sample.is_some() {
                step.logits_indices.push(step.num_tokens() as u32 - 1);
                uses.push(RowUse::Sample(i));
            }
        }
        step.finish();
        (step, uses)
    }
}

impl Executor for ModelRunner {
    fn execute(&mut self, out: &SchedulerOutput) -> Result<StepOutput, ExecError> {
        let (step, uses) = self.pack(out);
        let mut result = StepOutput::default();
        let all_plain_greedy = uses.iter().all(|u| match u {
            RowUse::Sample(i) => out.requests[*i].sample.as_ref().is_some_and(plain_greedy),
            RowUse::PromptLogprob(..) => false,
        });
        if all_plain_greedy {
            let tokens = self.model.forward_argmax(&step)?;
            for (token_id, u) in tokens.into_iter().zip(uses) {
                if let RowUse::Sample(i) = u {
                    result.sampled.insert(
                        out.requests[i].req_id,
                        SampledToken {
                            token_id,
                            logprobs: None,
                        },
                    );
                }
            }
            return Ok(result);
        }
        let vocab = self.model.vocab_size();
        let logits = self.model.forward(&step)?;
        for (row, u) in logits.chunks_mut(vocab).zip(uses) {
            match u {
                RowUse::Sample(i) => {
                    let r = &out.requests[i];
                    let spec = r.sample.as_ref().expect("sampled row has a spec");
                    result
                        .sampled
                        .insert(r.req_id, self.sampler.sample(row, spec));
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
