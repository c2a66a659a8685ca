//! A hybrid model (the tiny random-weight Qwen3.5 of `tests/oracle/tiny`: gated delta-net
//! layers beside full attention) through the whole engine: each running request holds a
//! recurrent-state slot; preemption by recompute, fewer slots than requests, prefix-cache
//! hits (which restore a checkpointed state) and speculation (whose rejected drafts restore
//! the state saved after the accepted tokens) change no greedy token.

mod common;

use common::*;
use ferrite_core::engine::EngineStats;
use ferrite_core::sampling::SamplingParams;
use ferrite_core::spec_decode::{Proposer, Speculation};
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
    args_of("qwen3_5", kv_blocks, max_num_seqs)
}

fn args_of(model: &str, kv_blocks: usize, max_num_seqs: usize) -> EngineArgs {
    let mut args = EngineArgs::new(repo_root().join("tests/oracle/tiny").join(model));
    args.max_model_len = Some(128);
    args.max_num_batched_tokens = 32;
    args.max_num_seqs = max_num_seqs;
    // One attention layer of 2 KV heads x 32, f16 K and V: 4 KiB per 16-token block.
    args.kv_cache_memory = Some((kv_blocks * 16 * 2 * 2 * 32 * 2) as u64);
    args
}

/// Greedy tokens of every prompt at once, and the preemptions it took.
fn run(kv_blocks: usize, max_num_seqs: usize) -> (Vec<Vec<u32>>, u64) {
    let (out, stats) = run_with(args(kv_blocks, max_num_seqs), &prompts(), true);
    (out, stats.num_preemptions)
}

/// Greedy tokens of `prompts` (all at once, or one after another), and the engine's stats
/// once idle.
fn run_with(args: EngineArgs, prompts: &[Vec<u32>], at_once: bool) -> (Vec<Vec<u32>>, EngineStats) {
    let (engine, _) = engine_with(args);
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(40),
        ignore_eos: true,
        ..Default::default()
    };
    let submit = |p: &Vec<u32>| engine.add_request(p.clone(), params.clone()).unwrap();
    let out = match at_once {
        true => {
            let streams: Vec<_> = prompts.iter().map(submit).collect();
            let outs = streams.into_iter().map(|s| tokens_of(&collect(s).unwrap()));
            outs.collect()
        }
        false => prompts
            .iter()
            .map(|p| tokens_of(&collect(submit(p)).unwrap()))
            .collect(),
    };
    (out, idle_stats(&engine))
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

/// Speculation on hybrids (both heads: Qwen3.5's dense, Qwen3-Next's with experts): a verify
/// step writes the state after each draft into the request's draft slots, and the step after
/// a rejection starts from the one after the accepted tokens. Greedy output is the same with
/// n-gram drafts and with the MTP head's (k = 1 and 3), one request at a time and 16 at
/// once, and with a pool small enough to preempt. (Random weights: the drafts fail nearly
/// always, so every step after a verify restores; `mtp.rs` checks accepted drafts' states.)
#[test]
fn speculation_changes_no_greedy_token_on_a_hybrid() {
    let spec = |k, proposer| {
        Some(Speculation {
            k,
            proposer,
            disable_by_batch_size: 64,
        })
    };
    let ngram = Proposer::Ngram { min_n: 1, max_n: 3 };
    let specs = [
        spec(3, ngram),
        spec(1, Proposer::Mtp),
        spec(3, Proposer::Mtp),
    ];
    let many: Vec<Vec<u32>> = prompts().into_iter().cycle().take(16).collect();
    for model in ["qwen3_5_mtp", "qwen3_next_mtp"] {
        let with = |spec: &Option<Speculation>, kv_blocks| {
            // The head's attention layer is one more layer of every block.
            let head = spec.as_ref().is_some_and(|s| s.proposer == Proposer::Mtp);
            let mut a = args_of(model, kv_blocks * (1 + head as usize), 16);
            a.speculation = spec.clone();
            a
        };
        let (one, _) = run_with(with(&None, 600), &prompts(), false);
        let (all, _) = run_with(with(&None, 600), &many, true);
        for spec in &specs {
            let (got, s1) = run_with(with(spec, 600), &prompts(), false);
            assert_eq!(got, one, "{model}, concurrency 1, {spec:?}");
            let (got, s16) = run_with(with(spec, 600), &many, true);
            assert_eq!(got, all, "{model}, concurrency 16, {spec:?}");
            let (got, tight) = run_with(with(spec, 9), &prompts(), true);
            assert_eq!(got, all[..6], "{model}, preempted, {spec:?}");
            println!(
                "{model} {spec:?}: C=1 {:?}; C=16 {:?}; {} preemptions",
                s1.spec, s16.spec, tight.num_preemptions
            );
            assert!(tight.num_preemptions > 0);
            for s in [&s1.spec, &s16.spec] {
                assert!(s.num_drafts > 20, "{s:?}");
                assert!(s.num_accepted_tokens < s.num_draft_tokens, "{s:?}");
            }
        }
    }
}

/// A rejected draft on the hybrid (CPU, f32): the step after it starts from the state saved
/// after the accepted tokens, and its logits equal a cold prefill's.
#[test]
fn a_rejected_draft_restores_the_state_after_the_accepted_tokens() {
    let dir = repo_root().join("tests/oracle/tiny/qwen3_5");
    let mut m = load_path(&dir, ferrite_model::loader::WeightFormat::F32);
    let (tokens, _) = tiny_oracle("qwen3_5", "logits");
    let cold = all_logits(&mut m, &tokens);
    let (got, want) = draft_rollback(&mut m, &tokens, &cold);
    let d = max_diff(&got, &want);
    println!("qwen3_5 after a rejected draft: max |dlogit| {d:.2e} against a cold prefill");
    assert!(d < 1e-4, "{d}");
}
