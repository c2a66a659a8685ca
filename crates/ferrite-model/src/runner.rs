//! The model runner: packs a [`SchedulerOutput`] into one flat step, runs the model once,
//! samples the rows that need a token and computes requested prompt logprobs.

use crate::kv_cache::KvCache;
use crate::llama::LlamaModel;
use crate::sampler::{log_sum_exp, logprob_and_rank, top_k_logprobs, Sampler};
use crate::step::PackedStep;
use ferrite_core::engine::{ExecError, Executor};
use ferrite_core::output::{StepOutput, TokenLogprob};
use ferrite_core::scheduler::SchedulerOutput;

pub struct ModelRunner {
    pub model: LlamaModel,
    pub cache: KvCache,
    sampler: Sampler,
    /// The threads that run steps: the forward pass starts on one of them, so its parallel
    /// ops split work by stealing instead of handing every op to the pool from outside
    /// (a wake-up per op); the HTTP side and tokenization never run here.
    compute: rayon::ThreadPool,
}

/// What a row of the logits matrix is for.
enum RowUse {
    Sample(usize),
    /// Request index and the prompt token this row predicts.
    PromptLogprob(usize, u32, usize),
}

impl ModelRunner {
    /// `threads`: compute threads (default: the cores this process may use).
    pub fn new(
        model: LlamaModel,
        cache: KvCache,
        seed: Option<u64>,
        threads: Option<usize>,
    ) -> Self {
        let threads =
            threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let compute = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ferrite-compute-{i}"))
            .build()
            .expect("compute thread pool");
        Self {
            model,
            cache,
            sampler: Sampler::new(seed),
            compute,
        }
    }

    /// Threads that run the model.
    pub fn threads(&self) -> usize {
        self.compute.current_num_threads()
    }

    fn pack(&self, out: &SchedulerOutput) -> (PackedStep, Vec<RowUse>) {
        let bs = self.cache.shape.block_size;
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
        let vocab = self.model.config.vocab_size;
        let (model, cache) = (&mut self.model, &mut self.cache);
        let logits = self.compute.install(|| model.forward(&step, cache))?;
        let mut result = StepOutput::default();
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
