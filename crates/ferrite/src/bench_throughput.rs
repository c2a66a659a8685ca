//! `ferrite bench throughput`: a burst of random-token requests submitted at once, as vLLM's
//! throughput benchmark does — the offline counterpart of a serving run, and the workload a
//! peer without an HTTP server (transformers' `generate_batch`) can run too: `--dump-prompts`
//! writes the exact prompts for it.

use crate::args::EngineFlags;
use crate::bench_offline::run_batch;
use crate::start::start;
use anyhow::{bail, Context, Result};
use clap::Args;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub engine: EngineFlags,
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Mean prompt length in tokens.
    #[arg(long, default_value_t = 4608)]
    pub input_len: usize,
    /// Tokens generated per request (EOS ignored).
    #[arg(long, default_value_t = 70)]
    pub output_len: usize,
    /// Prompt lengths are uniform in input_len * (1 -/+ ratio).
    #[arg(long, default_value_t = 0.25)]
    pub random_range_ratio: f64,
    #[arg(long, default_value_t = 0)]
    pub dataset_seed: u64,
    /// Write the prompts (JSON lists of token ids) here and run nothing.
    #[arg(long)]
    pub dump_prompts: Option<PathBuf>,
}

/// Random in-vocabulary prompts (ids from 1000 up: clear of the special tokens).
fn prompts(a: &ThroughputArgs, vocab: usize) -> Vec<Vec<u32>> {
    let mut rng = StdRng::seed_from_u64(a.dataset_seed);
    let lo = (a.input_len as f64 * (1.0 - a.random_range_ratio)).max(1.0) as usize;
    let hi = (a.input_len as f64 * (1.0 + a.random_range_ratio)) as usize;
    (0..a.num_prompts)
        .map(|_| {
            let n = rng.random_range(lo..=hi.max(lo));
            (0..n)
                .map(|_| rng.random_range(1000..vocab as u32))
                .collect()
        })
        .collect()
}

pub fn run(a: ThroughputArgs) -> Result<()> {
    if a.num_prompts == 0 || a.output_len == 0 {
        bail!("--num-prompts and --output-len must be positive");
    }
    if let Some(path) = &a.dump_prompts {
        let vocab = ferrite_model::checkpoint::read_config(a.engine.model())?.vocab_size;
        let json = serde_json::to_string(&prompts(&a, vocab))?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
        println!("{} prompts written to {}", a.num_prompts, path.display());
        return Ok(());
    }
    let started = start(&a.engine)?;
    let engine = &started.engine;
    let vocab = started.tokenizer.tokenizer.get_vocab_size(true);
    let set = prompts(&a, vocab);
    let input: usize = set.iter().map(Vec::len).sum();
    // Warm-up: kernels, graphs and pools touched once outside the timing.
    run_batch(engine, vec![set[0][..16.min(set[0].len())].to_vec()], 4)?;
    let (firsts, elapsed, output) = run_batch(engine, set, a.output_len)?;
    let mean_ttft = firsts.iter().sum::<f64>() / firsts.len() as f64;
    println!("| engine | requests | input tokens | output tokens | seconds | requests/s | output tok/s | total tok/s | mean TTFT s |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| ferrite | {} | {input} | {output} | {elapsed:.2} | {:.2} | {:.0} | {:.0} | {mean_ttft:.2} |",
        a.num_prompts,
        a.num_prompts as f64 / elapsed,
        output as f64 / elapsed,
        (input + output) as f64 / elapsed
    );
    engine.shutdown();
    Ok(())
}
