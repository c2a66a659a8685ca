//! Property tests of the scheduler and block pool on a tiny pool with random arrivals.
//!
//! A mock model keeps a simulated KV cache of token ids, written and read through the block
//! tables and slots the scheduler hands out; its next token is a hash of the history it reads
//! back. A block shared by two requests, a wrong table or a lost token changes the output, so
//! comparing with an unconstrained reference run checks the whole KV bookkeeping, preemption
//! included.

use ferrite_core::kv_cache_manager::NULL_BLOCK;
use ferrite_core::kv_layout::{first_needed_block, GroupWindow};
use ferrite_core::request::{FinishReason, Request};
use ferrite_core::sampling::SamplingParams;
use ferrite_core::scheduler::{Scheduler, SchedulerConfig};
use ferrite_core::spec_decode::{Proposer, Speculation};
mod common;

use common::MockModel;
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

const VOCAB: u32 = 50;
const EOS: u32 = 0;

#[derive(Clone, Debug)]
struct Arrival {
    step: usize,
    prompt: Vec<u32>,
    max_tokens: usize,
    min_tokens: usize,
}

fn arrivals() -> impl Strategy<Value = Vec<Arrival>> {
    prop::collection::vec(
        (
            0usize..40,
            prop::collection::vec(1u32..VOCAB, 1..40),
            1usize..20,
            0usize..3,
        )
            .prop_map(|(step, prompt, max_tokens, min_tokens)| Arrival {
                step,
                prompt,
                max_tokens,
                min_tokens: min_tokens.min(max_tokens),
            }),
        1..14,
    )
}

fn request(id: u64, a: &Arrival) -> Request {
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(a.max_tokens as i64),
        min_tokens: a.min_tokens as i64,
        ..Default::default()
    };
    Request::new(
        id,
        a.prompt.clone(),
        Arc::new(params),
        a.max_tokens,
        Arc::from([EOS]),
    )
}

/// Runs the workload; checks per-step invariants; returns each request's output tokens.
fn run(cfg: SchedulerConfig, work: &[Arrival]) -> (HashMap<u64, Vec<u32>>, u64) {
    let mut sched = Scheduler::new(cfg.clone());
    let mut model = MockModel::new(cfg.num_blocks, cfg.block_size, VOCAB, &cfg.kv_groups);
    let mut outputs: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut finished = HashSet::new();
    let mut step = 0;
    loop {
        for (id, a) in work.iter().enumerate() {
            if a.step == step {
                let max = sched
                    .check_admissible(a.prompt.len(), &request(0, a).params)
                    .expect("workload is sized to fit");
                assert_eq!(max, a.max_tokens);
                sched.add_request(request(id as u64, a));
            }
        }
        let out = sched.schedule();
        // Budget and seats.
        assert!(out.num_batched_tokens <= cfg.max_num_batched_tokens);
        assert_eq!(
            out.num_batched_tokens,
            out.requests
                .iter()
                .map(|r| r.token_ids.len())
                .sum::<usize>()
        );
        assert!(out.requests.len() <= cfg.max_num_seqs);
        assert!(sched.num_running() <= cfg.max_num_seqs);
        // No block owned twice; tables cover what the step writes; a window group holds
        // no block its window can no longer read.
        let mut owned = HashSet::new();
        for &id in sched.running_ids() {
            for &b in sched.block_tables(id).iter().flatten() {
                if b != NULL_BLOCK {
                    assert!(owned.insert(b), "block {b} owned twice");
                    assert!((b as usize) < cfg.num_blocks);
                }
            }
        }
        for r in &out.requests {
            for (t, w) in r.block_tables.iter().zip(&cfg.kv_groups) {
                assert!(t.len() * cfg.block_size >= r.seq_len());
                let first = w.map_or(0, |w| first_needed_block(w, r.start_pos, cfg.block_size));
                assert!(
                    t[..first].iter().all(|&b| b == NULL_BLOCK),
                    "{t:?} window {w:?}"
                );
                assert!(t[first..].iter().all(|&b| b != NULL_BLOCK));
            }
            assert!(!r.token_ids.is_empty());
        }
        let sampled = model.execute(&out);
        let proposals = model.propose(&out, &sampled);
        let updates = sched.update(&out, &sampled);
        sched.set_proposals(proposals);
        for u in updates {
            if !u.new_tokens.is_empty() {
                outputs.entry(u.req_id).or_default().extend(&u.new_tokens);
            }
            if let Some(reason) = u.finished {
                assert_ne!(reason, FinishReason::Abort);
                assert!(finished.insert(u.req_id));
            }
        }
        step += 1;
        if finished.len() == work.len() {
            break;
        }
        assert!(step < 5_000, "no progress: deadlock or starvation");
    }
    assert!(!sched.has_work());
    assert_eq!(sched.num_blocks_in_use(), 0, "blocks leaked");
    assert_eq!(sched.num_free_blocks(), cfg.num_blocks);
    DRAFTS.with(|d| d.set(d.get() + sched.spec_stats().num_drafts));
    (outputs, sched.num_preemptions())
}

thread_local! {
    /// Drafts the scheduler made in this thread's runs (a test of speculation checks some were).
    static DRAFTS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn tiny_pool_keeps_invariants_and_greedy_outputs(
        work in arrivals(),
        block_size in 1usize..6,
        extra_blocks in 0usize..6,
        budget in 1usize..48,
        seats in 1usize..6,
    ) {
        let longest = work.iter().map(|a| a.prompt.len() + a.max_tokens).max().unwrap();
        let max_model_len = 64;
        // The pool can hold the longest request and little more: pressure forces preemption.
        let num_blocks = longest.div_ceil(block_size) + extra_blocks;
        let cfg = SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: seats,
            max_model_len,
            block_size,
            num_blocks,
            prefix_caching: None,
            kv_groups: vec![None],
            state_slots: 0,
            state_checkpoints: 0,
            draft_state_sets: 0,
            whole_prompts: false,
            step_time: None,
            speculation: None,
        };
        let (got, _) = run(cfg.clone(), &work);
        // Reference: a pool so large nothing is ever preempted.
        let roomy = SchedulerConfig { num_blocks: 4096, max_num_batched_tokens: 4096, max_num_seqs: 64, ..cfg };
        let (want, preemptions) = run(roomy, &work);
        prop_assert_eq!(preemptions, 0);
        prop_assert_eq!(got, want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Drafts verified in the step (accepted while they are the mock's next token) change no
    /// output, on a tiny pool that preempts and with window groups: a rejected draft's K/V
    /// slots are written over, never read.
    #[test]
    fn speculation_changes_no_output(
        work in arrivals(),
        groups in windows(),
        block_size in 1usize..6,
        extra_blocks in 0usize..6,
        budget in 1usize..48,
        k in 1usize..5,
        min_n in 1usize..3,
        pause_above in 1usize..6,
    ) {
        let longest = work.iter().map(|a| a.prompt.len() + a.max_tokens).max().unwrap();
        let need = ferrite_core::kv_layout::max_blocks(&groups, longest, block_size, budget);
        let off = SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: 4,
            max_model_len: 64,
            block_size,
            num_blocks: need + extra_blocks,
            prefix_caching: None,
            kv_groups: groups,
            state_slots: 0,
            state_checkpoints: 0,
            draft_state_sets: 0,
            whole_prompts: false,
            step_time: None,
            speculation: None,
        };
        let on = SchedulerConfig {
            speculation: Some(Speculation { k, proposer: Proposer::Ngram { min_n, max_n: 3 }, disable_by_batch_size: pause_above }),
            ..off.clone()
        };
        let (want, _) = run(off, &work);
        let (got, _) = run(on, &work);
        prop_assert_eq!(got, want);
    }

    /// A draft model (the mock's) proposing after each step: its catch-up always starts
    /// where its pages hold the target's history, its proposals' slots are the request's
    /// (lookahead blocks), and outputs are those of a run without speculation.
    #[test]
    fn draft_model_speculation_changes_no_output(
        work in arrivals(),
        windowed in prop::bool::ANY,
        block_size in 1usize..6,
        extra_blocks in 0usize..6,
        budget in 1usize..48,
        k in 1usize..5,
        pause_above in 1usize..6,
    ) {
        let groups: Vec<GroupWindow> = match windowed {
            true => vec![None, Some(5)],
            false => vec![None],
        };
        let longest = work.iter().map(|a| a.prompt.len() + a.max_tokens).max().unwrap();
        let need = ferrite_core::kv_layout::max_blocks(&groups, longest, block_size, budget);
        let off = SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: 4,
            max_model_len: 64,
            block_size,
            num_blocks: need + extra_blocks,
            prefix_caching: None,
            kv_groups: groups,
            state_slots: 0,
            state_checkpoints: 0,
            draft_state_sets: 0,
            whole_prompts: false,
            step_time: None,
            speculation: None,
        };
        let on = SchedulerConfig {
            speculation: Some(Speculation { k, proposer: Proposer::DraftModel { model: "mock".into() }, disable_by_batch_size: pause_above }),
            ..off.clone()
        };
        let (want, _) = run(off, &work);
        let (got, _) = run(on, &work);
        prop_assert_eq!(got, want);
    }
}

#[test]
fn speculation_drafts_under_the_property_tests_workloads() {
    // The mock's tokens repeat often enough in 50 ids that n-gram lookups find matches.
    let work: Vec<Arrival> = (0..6)
        .map(|i| Arrival {
            step: i,
            prompt: (1..12).map(|t| (t * (i as u32 + 2)) % 7 + 1).collect(),
            max_tokens: 19,
            min_tokens: 0,
        })
        .collect();
    let cfg = SchedulerConfig {
        max_num_batched_tokens: 32,
        max_num_seqs: 4,
        max_model_len: 64,
        block_size: 4,
        num_blocks: 64,
        prefix_caching: None,
        kv_groups: vec![None],
        state_slots: 0,
        state_checkpoints: 0,
        draft_state_sets: 0,
        whole_prompts: false,
        step_time: None,
        speculation: None,
    };
    let (want, _) = run(cfg.clone(), &work);
    for proposer in [
        Proposer::Ngram { min_n: 1, max_n: 3 },
        Proposer::DraftModel {
            model: "mock".into(),
        },
    ] {
        let spec = Speculation {
            k: 3,
            proposer,
            disable_by_batch_size: 8,
        };
        DRAFTS.with(|d| d.set(0));
        let (got, _) = run(
            SchedulerConfig {
                speculation: Some(spec.clone()),
                ..cfg.clone()
            },
            &work,
        );
        let drafts = DRAFTS.with(|d| d.get());
        assert!(drafts > 10, "{spec:?}: {drafts} drafts");
        assert_eq!(got, want, "{spec:?}");
    }
}

fn windows() -> impl Strategy<Value = Vec<GroupWindow>> {
    // One full group and one or two window groups, or windows only (Mistral).
    (1usize..12, 0usize..3, prop::bool::ANY).prop_map(|(w, extra, full)| {
        let mut g: Vec<GroupWindow> = vec![Some(w); 1 + extra];
        if full {
            g.insert(0, None);
        }
        g
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Window groups on a tiny pool: blocks out of every window go back to the pool (and
    /// get reused), yet outputs equal a run on a pool so large nothing is ever reused.
    #[test]
    fn window_groups_free_old_blocks_and_change_no_output(
        work in arrivals(),
        groups in windows(),
        block_size in 1usize..6,
        extra_blocks in 0usize..6,
        budget in 1usize..48,
    ) {
        let longest = work.iter().map(|a| a.prompt.len() + a.max_tokens).max().unwrap();
        let max_model_len = 64;
        let need = ferrite_core::kv_layout::max_blocks(&groups, longest, block_size, budget);
        let cfg = SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: 4,
            max_model_len,
            block_size,
            num_blocks: need + extra_blocks,
            prefix_caching: None,
            kv_groups: groups,
            state_slots: 0,
            state_checkpoints: 0,
            draft_state_sets: 0,
            whole_prompts: false,
            step_time: None,
            speculation: None,
        };
        let (got, _) = run(cfg.clone(), &work);
        let roomy = SchedulerConfig { num_blocks: 8192, max_num_batched_tokens: 4096, max_num_seqs: 64, ..cfg };
        let (want, preemptions) = run(roomy, &work);
        prop_assert_eq!(preemptions, 0);
        prop_assert_eq!(got, want);
    }
}

#[test]
fn preemption_happens_under_pressure_and_changes_nothing() {
    let work: Vec<Arrival> = (0..6)
        .map(|i| Arrival {
            step: 0,
            prompt: (1..20).map(|t| (t * (i + 3)) % (VOCAB - 1) + 1).collect(),
            max_tokens: 15,
            min_tokens: 15,
        })
        .collect();
    let cfg = SchedulerConfig {
        max_num_batched_tokens: 64,
        max_num_seqs: 6,
        max_model_len: 64,
        block_size: 4,
        num_blocks: 16,
        prefix_caching: None,
        kv_groups: vec![None],
        state_slots: 0,
        state_checkpoints: 0,
        draft_state_sets: 0,
        whole_prompts: false,
        step_time: None,
        speculation: None,
    };
    let (got, preemptions) = run(cfg.clone(), &work);
    assert!(preemptions > 0, "the workload should force preemption");
    let (want, _) = run(
        SchedulerConfig {
            num_blocks: 1024,
            ..cfg
        },
        &work,
    );
    assert_eq!(got, want);
}

#[test]
fn requests_that_can_never_fit_are_refused() {
    let sched = Scheduler::new(SchedulerConfig {
        max_num_batched_tokens: 16,
        max_num_seqs: 4,
        max_model_len: 32,
        block_size: 4,
        num_blocks: 6,
        prefix_caching: None,
        kv_groups: vec![None],
        state_slots: 0,
        state_checkpoints: 0,
        draft_state_sets: 0,
        whole_prompts: false,
        step_time: None,
        speculation: None,
    });
    let p = |m: i64| SamplingParams {
        max_tokens: Some(m),
        ..Default::default()
    };
    let e = sched.check_admissible(32, &p(5)).unwrap_err().to_string();
    assert!(
        e.contains("maximum context length is 32") && e.contains("prompt has 32 tokens"),
        "{e}"
    );
    // A cap past the context left is cut to it.
    let roomy = Scheduler::new(SchedulerConfig {
        num_blocks: 16,
        ..sched.config().clone()
    });
    assert_eq!(roomy.check_admissible(30, &p(5)), Ok(2));
    let e = sched.check_admissible(20, &p(5)).unwrap_err().to_string();
    assert!(e.contains("7 KV blocks") && e.contains("pool has 6"), "{e}");
    assert!(sched
        .check_admissible(0, &p(5))
        .unwrap_err()
        .to_string()
        .contains("empty"));
    assert_eq!(sched.check_admissible(10, &p(5)), Ok(5));
    // Without max_tokens the request may run to max_model_len.
    assert!(sched
        .check_admissible(10, &SamplingParams::default())
        .is_err());
}

/// Runs the workload with `state_slots` recurrent-state slots and aborts `aborts` (request,
/// step) along the way; checks that no slot is held twice and none leaks; returns the
/// outputs of the requests that finished on their own.
fn run_with_states(
    cfg: SchedulerConfig,
    work: &[Arrival],
    aborts: &[(usize, usize)],
) -> HashMap<u64, Vec<u32>> {
    let mut sched = Scheduler::new(cfg.clone());
    let mut model = MockModel::new(cfg.num_blocks, cfg.block_size, VOCAB, &cfg.kv_groups);
    let k = cfg.speculation.as_ref().map_or(0, |s| s.k);
    let draft_slots = cfg.state_slots..cfg.state_slots + cfg.draft_state_sets * k;
    model.states = vec![0; draft_slots.end];
    let mut outputs: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut done = HashSet::new();
    let aborted: HashSet<u64> = aborts
        .iter()
        .filter(|(r, _)| *r < work.len())
        .map(|(r, _)| *r as u64)
        .collect();
    let mut step = 0;
    while done.len() < work.len() {
        for (id, a) in work.iter().enumerate() {
            if a.step == step {
                sched.add_request(request(id as u64, a));
            }
        }
        for &(r, at) in aborts {
            if at == step && r < work.len() && !done.contains(&(r as u64)) && work[r].step <= step {
                sched.finish(r as u64, FinishReason::Abort);
                done.insert(r as u64);
            }
        }
        let out = sched.schedule();
        let mut held = HashSet::new();
        for r in &out.requests {
            let state = r.state.expect("every scheduled request holds a state slot");
            let s = state.slot;
            assert!((s as usize) < cfg.state_slots);
            assert!(held.insert(s), "state slot {s} held twice");
            if let Some(first) = state.drafts {
                for d in first..first + r.spec.draft.len() as u32 {
                    assert!(draft_slots.contains(&(d as usize)), "draft slot {d}");
                    assert!(held.insert(d), "draft state slot {d} held twice");
                }
            }
        }
        assert!(sched.num_running() <= cfg.state_slots);
        let sampled = model.execute(&out);
        for u in sched.update(&out, &sampled) {
            if !u.new_tokens.is_empty() {
                outputs.entry(u.req_id).or_default().extend(&u.new_tokens);
            }
            if u.finished.is_some() {
                assert!(done.insert(u.req_id));
            }
        }
        step += 1;
        assert!(step < 5_000, "no progress: deadlock or starvation");
    }
    assert!(!sched.has_work());
    assert_eq!(sched.num_state_slots_in_use(), 0, "state slots leaked");
    assert_eq!(
        sched.num_draft_state_sets_in_use(),
        0,
        "draft state slots leaked"
    );
    assert_eq!(sched.num_blocks_in_use(), 0, "blocks leaked");
    outputs.retain(|id, _| !aborted.contains(id));
    outputs
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Recurrent-state slots under pressure (fewer slots than seats, a tight KV pool that
    /// preempts) and aborts, with and without n-gram speculation (fewer sets of draft slots
    /// than requests): every slot is held by one request at a time, all come back, and
    /// requests that finish produce what they produce with room for everyone and no
    /// speculation (a slot shared, not started over after preemption, or a rejected draft's
    /// state not taken back would change their tokens).
    #[test]
    fn state_slots_are_held_once_freed_always_and_change_no_output(
        work in arrivals(),
        block_size in 1usize..6,
        extra_blocks in 0usize..6,
        budget in 1usize..48,
        slots in 1usize..4,
        aborts in prop::collection::vec((0usize..14, 0usize..60), 0..4),
        spec in prop::option::of((1usize..4, 1usize..4)),
    ) {
        let longest = work.iter().map(|a| a.prompt.len() + a.max_tokens).max().unwrap();
        let cfg = SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: 6,
            max_model_len: 64,
            block_size,
            num_blocks: longest.div_ceil(block_size) + extra_blocks,
            prefix_caching: None,
            kv_groups: vec![None],
            state_slots: slots,
            state_checkpoints: 0,
            draft_state_sets: spec.map_or(0, |s| s.1),
            whole_prompts: false,
            step_time: None,
            speculation: spec.map(|(k, _)| Speculation {
                k,
                proposer: Proposer::Ngram { min_n: 1, max_n: 3 },
                disable_by_batch_size: 6,
            }),
        };
        let got = run_with_states(cfg.clone(), &work, &aborts);
        let roomy = SchedulerConfig {
            num_blocks: 4096,
            max_num_batched_tokens: 4096,
            max_num_seqs: 64,
            state_slots: 64,
            state_checkpoints: 0,
            draft_state_sets: 0,
            whole_prompts: false,
            step_time: None,
            speculation: None,
            ..cfg
        };
        let want = run_with_states(roomy, &work, &[]);
        for (id, tokens) in &got {
            prop_assert_eq!(Some(tokens), want.get(id));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Pooling requests (embeddings) on a model whose prompts are never chunked: each is
    /// scheduled once, with its whole prompt and nothing to sample, finishes in that step's
    /// update, and gives its blocks back; generation requests sharing the engine are
    /// unaffected by them.
    #[test]
    fn pooling_requests_run_whole_once_and_free_their_blocks(
        prompts in prop::collection::vec((0usize..20, prop::collection::vec(1u32..VOCAB, 1..24)), 1..16),
        block_size in 1usize..6,
        budget in 24usize..64,
        seats in 1usize..6,
        extra_blocks in 0usize..8,
    ) {
        let cfg = SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: seats,
            max_model_len: 24,
            block_size,
            num_blocks: 24usize.div_ceil(block_size) + extra_blocks,
            prefix_caching: None,
            kv_groups: vec![None],
            state_slots: 0,
            state_checkpoints: 0,
            draft_state_sets: 0,
            whole_prompts: true,
            step_time: None,
            speculation: None,
        };
        let mut sched = Scheduler::new(cfg.clone());
        let mut runs: HashMap<u64, usize> = HashMap::new();
        let mut done = HashSet::new();
        for step in 0..2_000 {
            for (id, (at, prompt)) in prompts.iter().enumerate() {
                if *at == step {
                    prop_assert!(sched.check_pooling_admissible(prompt.len()).is_ok());
                    let mut r = Request::new(id as u64, prompt.clone(), Arc::new(SamplingParams::default()), 0, Arc::from([EOS]));
                    r.pooling = true;
                    sched.add_request(r);
                }
            }
            let out = sched.schedule();
            for r in &out.requests {
                let (_, prompt) = &prompts[r.req_id as usize];
                prop_assert_eq!(r.start_pos, 0);
                prop_assert_eq!(&r.token_ids, prompt, "the whole prompt in one step");
                prop_assert!(r.pooling.pool && r.sample.is_none());
                *runs.entry(r.req_id).or_default() += 1;
            }
            for u in sched.update(&out, &HashMap::new()) {
                prop_assert!(u.new_tokens.is_empty());
                prop_assert_eq!(u.finished, Some(FinishReason::Stop));
                prop_assert!(done.insert(u.req_id));
            }
            if done.len() == prompts.len() {
                break;
            }
        }
        prop_assert_eq!(done.len(), prompts.len(), "every request finished");
        prop_assert!(runs.values().all(|&n| n == 1));
        prop_assert_eq!(sched.num_blocks_in_use(), 0, "blocks leaked");
        prop_assert!(sched.check_pooling_admissible(25).is_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(150))]

    /// With a step-time target, prefill chunks beside decodes are cut to what the cost model
    /// leaves (never below MIN_PREFILL_CHUNK): the invariants and every greedy output stay
    /// those of the run without a target.
    #[test]
    fn a_step_time_target_changes_no_output(
        work in arrivals(),
        block_size in 1usize..6,
        budget in 1usize..48,
        seats in 1usize..6,
        target_ms in 1.0f64..30.0,
    ) {
        use ferrite_core::scheduler::{StepTarget, StepTime};
        use ferrite_core::step_cost::{StepCost, StepShape};
        let longest = work.iter().map(|a| a.prompt.len() + a.max_tokens).max().unwrap();
        let off = SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: seats,
            max_model_len: 64,
            block_size,
            num_blocks: (longest.div_ceil(block_size) + 1) * seats.min(work.len()),
            prefix_caching: None,
            kv_groups: vec![None],
            state_slots: 0,
            state_checkpoints: 0,
            draft_state_sets: 0,
            whole_prompts: false,
            step_time: None,
            speculation: None,
        };
        // 1 ms a step and 1 ms a token.
        let shape = |n: usize| {
            let mut s = StepShape::default();
            s.add_chunk(0, n);
            s
        };
        let cost = StepCost::fit(&[shape(1), shape(50), shape(101)].map(|s| (s, 0.001 + 0.001 * s.tokens as f64)));
        let on = SchedulerConfig {
            step_time: Some(StepTime { cost, target: StepTarget::Fixed(target_ms / 1e3) }),
            ..off.clone()
        };
        let (want, _) = run(off, &work);
        let (got, _) = run(on, &work);
        prop_assert_eq!(got, want);
    }
}

/// A prompt arriving while another request decodes gets the chunk the target leaves beside
/// the decode; alone, the whole budget; with decodes using up the target, the floor.
#[test]
fn prefill_beside_decodes_is_cut_to_the_step_time_target() {
    use ferrite_core::scheduler::{StepTarget, StepTime, MIN_PREFILL_CHUNK};
    use ferrite_core::step_cost::{StepCost, StepShape};
    let shape = |n: usize| {
        let mut s = StepShape::default();
        s.add_chunk(0, n);
        s
    };
    // 1 ms a step and 1 ms a token: a 40 ms target leaves 38 prefill tokens beside a decode.
    let linear = |fixed: f64| {
        [shape(1), shape(50), shape(101)].map(|s| (s, fixed + 0.001 * s.tokens as f64))
    };
    let cost = StepCost::fit(&linear(0.001));
    let cfg = SchedulerConfig {
        max_num_batched_tokens: 512,
        max_num_seqs: 8,
        max_model_len: 1024,
        block_size: 16,
        num_blocks: 256,
        prefix_caching: None,
        kv_groups: vec![None],
        state_slots: 0,
        state_checkpoints: 0,
        draft_state_sets: 0,
        whole_prompts: false,
        step_time: Some(StepTime {
            cost,
            target: StepTarget::Fixed(0.040),
        }),
        speculation: None,
    };
    let mut sched = Scheduler::new(cfg);
    let arrival = |len: usize| Arrival {
        step: 0,
        prompt: vec![7; len],
        max_tokens: 50,
        min_tokens: 0,
    };
    sched.add_request(request(0, &arrival(300)));
    let out = sched.schedule();
    assert_eq!(
        out.requests[0].token_ids.len(),
        300,
        "alone: the whole prompt"
    );
    sched.update(&out, &HashMap::from([(0, vec![3])]));
    sched.add_request(request(1, &arrival(400)));
    let out = sched.schedule();
    let lens: Vec<usize> = out.requests.iter().map(|r| r.token_ids.len()).collect();
    assert!(lens[0] == 1 && (36..=39).contains(&lens[1]), "{lens:?}");
    // Eight decodes of long contexts eat the target: the prompt still moves by the floor.
    let mut sched = Scheduler::new(SchedulerConfig {
        step_time: Some(StepTime {
            cost: StepCost::fit(&linear(0.029)),
            target: StepTarget::Fixed(0.020),
        }),
        ..sched.config().clone()
    });
    sched.add_request(request(0, &arrival(300)));
    let out = sched.schedule();
    sched.update(&out, &HashMap::from([(0, vec![3])]));
    sched.add_request(request(1, &arrival(400)));
    let out = sched.schedule();
    assert_eq!(out.requests[1].token_ids.len(), MIN_PREFILL_CHUNK);
}
