//! The step-cost model's start-up fit: steps of the sizes serving runs (a decode, short and
//! long prefill chunks) timed on the loaded model, its KV pool fresh (the blocks written here
//! hold nothing yet).

use crate::step::PackedStep;
use crate::step::StepModel;
use anyhow::Result;
use ferrite_core::step_cost::{StepCost, StepShape};
use std::time::Instant;

/// Times steps of each size up to `max_tokens` (the faster of two runs, after an untimed
/// decode that wakes the threads and the caches) and fits the cost model to them.
pub fn step_cost(
    model: &mut dyn StepModel,
    block_size: usize,
    kv_groups: usize,
    max_tokens: usize,
) -> Result<StepCost> {
    let mut sizes: Vec<usize> = [1, 16, 128, max_tokens]
        .into_iter()
        .filter(|&n| n <= max_tokens)
        .collect();
    sizes.dedup();
    let vocab = model.vocab_size();
    let mut samples = Vec::with_capacity(sizes.len());
    model.forward(&PackedStep::profile(1, block_size, vocab, kv_groups))?;
    for n in sizes {
        let step = PackedStep::profile(n, block_size, vocab, kv_groups);
        let mut best = f64::INFINITY;
        for _ in 0..2 {
            let t0 = Instant::now();
            model.forward(&step)?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        let mut shape = StepShape::default();
        shape.add_chunk(0, n);
        samples.push((shape, best));
    }
    Ok(StepCost::fit(&samples))
}
