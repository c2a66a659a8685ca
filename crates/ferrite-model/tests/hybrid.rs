//! A hybrid model (the tiny random-weight Qwen3.5 of `tests/oracle/tiny`: gated delta-net
//! layers beside full attention) through the whole engine: each running request holds a
//! recurrent-state slot; preemption by recompute, fewer slots than requests and prefix-cache
//! hits (which restore a checkpointed state) change no greedy token.

mod common;

use common::*;
use ferrite_core::sampling::SamplingParams;
use ferrite_model::loader::EngineArgs;

/// Six prompts of 20-45 tokens of the tiny vocabulary.
fn prompts() -> Vec<Vec<u32>> {
    let (tokens, _) = tiny_oracle("qwen3_5", "logits");
    (0..6)
        .map(|i| {
            tokens
                .iter()
                .cycle()
                .skip(5 * i)
                .take(20 + 5 * i)
                .copied()
                .collect()
        })
        .collect()
}

fn args(kv_blocks: usize, max_num_seqs: usize) -> EngineArgs {
    let mut args = EngineArgs::new(repo_root().join("tests/oracle/tiny/qwen3_5"));
    args.max_model_len = Some(128);
    args.max_num_batched_tokens = 32;
    args.max_num_seqs = max_num_seqs;
    // One attention layer of 2 KV heads x 32, f16 K and V: 4 KiB per 16-token block.
    args.kv_cache_memory = Some((kv_blocks * 16 * 2 * 2 * 32 * 2) as u64);
    args
}

/// Greedy tokens of every prompt at once, and the preemptions it took.
fn run(kv_blocks: usize, max_num_seqs: usize) -> (Vec<Vec<u32>>, u64) {
    let (engine, _) = engine_with(args(kv_blocks, max_num_seqs));
    let streams: Vec<_> = prompts()
        .into_iter()
        .map(|p| {
            let params = SamplingParams {
                temperature: 0.0,
                max_tokens: Some(40),
                ignore_eos: true,
                ..Default::default()
            };
            engine.add_request(p, params).unwrap()
        })
        .collect();
    let out = streams
        .into_iter()
        .map(|s| tokens_of(&collect(s).unwrap()))
        .collect();
    (out, engine.stats().num_preemptions)
}

#[test]
fn preemption_and_scarce_state_slots_change_no_greedy_token() {
    let (roomy, none) = run(600, 16);
    assert_eq!(none, 0);
    assert!(roomy.iter().all(|t| t.len() == 40));
    // Eight blocks hold one full-length request and a little more: requests are preempted
    // and recomputed from their first token, their state starting over.
    let (tight, preemptions) = run(9, 16);
    assert!(preemptions > 0, "the tight pool should preempt");
    assert_eq!(tight, roomy);
    // Two state slots for six requests: the rest wait for one.
    let (two, _) = run(600, 2);
    assert_eq!(two, roomy);
}

/// Requests one after another on shared prefixes of 37-70 tokens (the agent's system
/// prompt, then turns): with prefix caching each starts from the checkpointed state of the
/// deepest cached block, and every greedy token equals a run without caching.
#[test]
fn prefix_cache_hits_restore_the_state_and_change_no_greedy_token() {
    let (tokens, _) = tiny_oracle("qwen3_5", "logits");
    let stem: Vec<u32> = tokens.iter().cycle().take(37).copied().collect();
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|i| stem.iter().chain(&tokens[..7 * i + 3]).copied().collect())
        .collect();
    let run = |caching: bool| {
        let mut a = args(600, 16);
        if !caching {
            a.prefix_caching = None;
        }
        let (engine, _) = engine_with(a);
        let out: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let params = SamplingParams {
                    temperature: 0.0,
                    max_tokens: Some(12),
                    ignore_eos: true,
                    ..Default::default()
                };
                tokens_of(&collect(engine.add_request(p.clone(), params).unwrap()).unwrap())
            })
            .collect();
        (out, engine.stats().prefix_cache_hits)
    };
    let (cached, hits) = run(true);
    let (cold, none) = run(false);
    assert_eq!(none, 0);
    // Each later request shares at least the stem's two full blocks with the first.
    assert!(hits >= 4 * 32, "{hits} prompt tokens hit");
    assert_eq!(cached, cold);
}
