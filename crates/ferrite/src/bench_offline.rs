//! `ferrite bench offline`: prefill and decode throughput straight through the engine, the
//! counterpart of `llama-bench -p 512 -n 128 [-d DEPTHS]`.

use crate::args::EngineFlags;
use crate::start::start;
use anyhow::{bail, Result};
use clap::Args;
use ferrite_core::engine::EngineHandle;
use ferrite_core::sampling::SamplingParams;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct OfflineArgs {
    #[command(flatten)]
    pub engine: EngineFlags,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens generated per request in the decode measurement.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Decode batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batch: Vec<usize>,
    /// Context already in the KV cache before each measurement, comma-separated (llama-bench's
    /// `-d`): a request of that many tokens is served first and the measured one extends it, so
    /// the prefix cache holds the depth and only the new tokens are computed, attending over it.
    /// Decodes at a depth share one such context.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub depth: Vec<usize>,
    /// Repetitions of each measurement (the best is reported, as llama-bench's mean is over quiet runs).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
}

/// Deterministic filler prompt of `n` in-vocabulary tokens.
fn prompt(n: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| (1000 + (i * 7919 + salt * 104_729) % (vocab - 1000)) as u32)
        .collect()
}

/// Submits every prompt at once and reads all streams to the end: each request's time to its
/// first token, the total time and the tokens generated, all from submission.
pub(crate) fn run_batch(
    engine: &EngineHandle,
    prompts: Vec<Vec<u32>>,
    max_tokens: usize,
) -> Result<(Vec<f64>, f64, usize)> {
    let t0 = Instant::now();
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(max_tokens as i64),
        ignore_eos: true,
        ..Default::default()
    };
    let streams = prompts
        .into_iter()
        .map(|p| engine.add_request(p, params.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    // One reader per stream, so each first token is timed when it arrives.
    let results: Vec<Result<(f64, usize)>> = std::thread::scope(|scope| {
        let readers: Vec<_> = streams
            .into_iter()
            .map(|mut s| {
                scope.spawn(move || -> Result<(f64, usize)> {
                    let (mut first, mut n) = (None, 0);
                    while let Some(o) = s.blocking_next() {
                        let o = o?;
                        first.get_or_insert(t0.elapsed().as_secs_f64());
                        n += o.token_ids.len();
                        if o.finish_reason.is_some() {
                            break;
                        }
                    }
                    Ok((first.unwrap_or(0.0), n))
                })
            })
            .collect();
        readers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let (mut firsts, mut total) = (Vec::with_capacity(results.len()), 0);
    for r in results {
        let (first, n) = r?;
        firsts.push(first);
        total += n;
    }
    Ok((firsts, t0.elapsed().as_secs_f64(), total))
}

/// `prompts` each extended by a shared context of `depth` tokens, after a request that leaves
/// that context in the prefix cache.
fn at_depth(
    engine: &EngineHandle,
    depth: usize,
    salt: usize,
    vocab: usize,
    prompts: Vec<Vec<u32>>,
) -> Result<Vec<Vec<u32>>> {
    if depth == 0 {
        return Ok(prompts);
    }
    let context = prompt(depth, salt, vocab);
    run_batch(engine, vec![context.clone()], 1)?;
    Ok(prompts
        .into_iter()
        .map(|p| [context.as_slice(), &p].concat())
        .collect())
}

/// llama-bench's label for a test at a depth.
fn label(test: String, depth: usize) -> String {
    match depth {
        0 => test,
        d => format!("{test} @ d{d}"),
    }
}

pub fn run(args: OfflineArgs) -> Result<()> {
    if args.engine.max_num_batched_tokens < args.prompt_tokens {
        bail!("--max-num-batched-tokens must be at least --prompt-tokens for a one-step prefill");
    }
    if args.depth.iter().any(|&d| d > 0) && args.engine.no_enable_prefix_caching {
        bail!(
            "--depth needs the prefix cache to hold the context: drop --no-enable-prefix-caching"
        );
    }
    let started = start(&args.engine)?;
    let engine = &started.engine;
    let vocab = started.tokenizer.tokenizer.get_vocab_size(true);
    // Warm-up: first touches of buffers and thread start-up.
    run_batch(engine, vec![prompt(32, 0, vocab)], 4)?;
    println!("| test | ferrite tokens/s |");
    println!("| --- | ---: |");
    // Every measurement draws fresh salts, so no prompt is a prefix-cache hit beyond its depth.
    let mut salt = 1;
    let mut fresh = || {
        salt += 1;
        salt
    };
    for &depth in &args.depth {
        let mut best_pp = 0f64;
        for _ in 0..args.repeats {
            let new = vec![prompt(args.prompt_tokens, fresh(), vocab)];
            let prompts = at_depth(engine, depth, fresh(), vocab, new)?;
            let (ttft, _, _) = run_batch(engine, prompts, 1)?;
            best_pp = best_pp.max(args.prompt_tokens as f64 / ttft[0]);
        }
        let test = label(format!("pp{}", args.prompt_tokens), depth);
        println!("| {test} | {best_pp:.1} |");
        for &b in &args.batch {
            let mut best = 0f64;
            for _ in 0..args.repeats {
                let new = (0..b).map(|_| prompt(16, fresh(), vocab)).collect();
                let prompts = at_depth(engine, depth, fresh(), vocab, new)?;
                let (firsts, end, total) = run_batch(engine, prompts, args.gen_tokens)?;
                let first = firsts.iter().copied().fold(0f64, f64::max);
                // Decode only: tokens after every request's first, over the time after the last first.
                let decoded = total - b;
                best = best.max(decoded as f64 / (end - first));
            }
            let test = label(format!("tg{} @ batch {b}", args.gen_tokens), depth);
            println!("| {test} | {best:.1} |");
        }
    }
    engine.shutdown();
    Ok(())
}
