//! Property tests of prefix caching: random request streams with shared prefixes.
//!
//! The mock model (tests/common) stores token ids in a simulated KV cache addressed through
//! block tables. After every step, every running request's computed positions must read back its own
//! tokens (so no block referenced by a running request was evicted or rewritten); outputs
//! must equal a run without caching; hit accounting must equal a brute-force count.

use ferrite_core::kv_cache_manager::NULL_BLOCK;
use ferrite_core::kv_layout::GroupWindow;
use ferrite_core::prefix_hash::HashAlgo;
use ferrite_core::request::Request;
use ferrite_core::sampling::SamplingParams;
use ferrite_core::scheduler::{Scheduler, SchedulerConfig};
use ferrite_core::spec_decode::{Proposer, Speculation};
mod common;

use common::MockModel;
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

const VOCAB: u32 = 40;

#[derive(Clone, Debug)]
struct Job {
    step: usize,
    prompt: Vec<u32>,
    max_tokens: usize,
    salt: Option<String>,
}

/// Prompts built from a few shared stems plus random tails, so prefixes repeat.
fn jobs() -> impl Strategy<Value = Vec<Job>> {
    let stems = prop::collection::vec(prop::collection::vec(1u32..VOCAB, 0..30), 3);
    stems.prop_flat_map(|stems| {
        prop::collection::vec(
            (
                0usize..30,
                0usize..3,
                prop::collection::vec(1u32..VOCAB, 1..12),
                1usize..10,
                prop::bool::weighted(0.1),
            ),
            1..14,
        )
        .prop_map(move |v| {
            v.into_iter()
                .map(|(step, stem, tail, max_tokens, salted)| Job {
                    step,
                    prompt: stems[stem].iter().chain(&tail).copied().collect(),
                    max_tokens,
                    salt: salted.then(|| "tenant-b".to_string()),
                })
                .collect()
        })
    })
}

fn request(id: u64, j: &Job) -> Request {
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(j.max_tokens as i64),
        ignore_eos: true,
        cache_salt: j.salt.clone(),
        ..Default::default()
    };
    Request::new(
        id,
        j.prompt.clone(),
        Arc::new(params),
        j.max_tokens,
        Arc::from([0u32]),
    )
}

struct RunResult {
    outputs: HashMap<u64, Vec<u32>>,
    hit_tokens: u64,
}

/// `one_at_a_time`: each job is added only when the previous one finished.
fn run(cfg: SchedulerConfig, jobs: &[Job], one_at_a_time: bool) -> RunResult {
    let mut sched = Scheduler::new(cfg.clone());
    let mut mock = MockModel::new(cfg.num_blocks, cfg.block_size, VOCAB, &cfg.kv_groups);
    mock.states = vec![0; cfg.state_slots + cfg.state_checkpoints];
    let mut outputs: HashMap<u64, Vec<u32>> = HashMap::new();
    let (mut added, mut finished, mut step) = (0usize, 0usize, 0usize);
    while finished < jobs.len() {
        while added < jobs.len()
            && (if one_at_a_time {
                !sched.has_work()
            } else {
                jobs[added].step <= step
            })
        {
            sched.add_request(request(added as u64, &jobs[added]));
            added += 1;
        }
        let out = sched.schedule();
        assert!(out.num_batched_tokens <= cfg.max_num_batched_tokens);
        let sampled = mock.execute(&out);
        let proposals = mock.propose(&out, &sampled);
        let updates = sched.update(&out, &sampled);
        sched.set_proposals(proposals);
        for u in updates {
            if !u.new_tokens.is_empty() {
                outputs.entry(u.req_id).or_default().extend(&u.new_tokens);
            }
            finished += u.finished.is_some() as usize;
        }
        // Every running request's computed K/V is intact: shared blocks were never rewritten
        // and nothing it references was evicted.
        for &id in sched.running_ids() {
            let req = sched.request(id).unwrap();
            for (g, table) in sched.block_tables(id).iter().enumerate() {
                let next = req.num_computed_tokens;
                for pos in mock.reads(g, next).filter(|&p| p < next) {
                    assert_eq!(
                        mock.slots[mock.slot(table, pos)],
                        Some(req.token_at(pos)),
                        "request {id} group {g} pos {pos}"
                    );
                }
                for &b in table.iter().filter(|&&b| b != NULL_BLOCK) {
                    assert!(sched.kv().pool().ref_cnt(b) >= 1);
                }
            }
        }
        step += 1;
        assert!(step < 10_000, "no progress");
    }
    assert_eq!(sched.num_blocks_in_use(), 0, "blocks leaked");
    assert_eq!(sched.num_state_slots_in_use(), 0, "state slots leaked");
    assert!(sched.num_state_checkpoints() <= cfg.state_checkpoints);
    assert_eq!(
        sched.num_free_blocks(),
        cfg.num_blocks,
        "every block back in the free queue"
    );
    RunResult {
        outputs,
        hit_tokens: sched.prefix_cache_stats().1,
    }
}

fn cfg(num_blocks: usize, bs: usize, budget: usize, prefix: Option<HashAlgo>) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: 4,
        max_model_len: 64,
        block_size: bs,
        num_blocks,
        prefix_caching: prefix,
        kv_groups: vec![None],
        state_slots: 0,
        state_checkpoints: 0,
        draft_state_sets: 0,
        whole_prompts: false,
        step_time: None,
        speculation: None,
    }
}

/// A full group beside one or two window groups, or windows only; `None`: one full group.
fn groups() -> impl Strategy<Value = Vec<GroupWindow>> {
    (0usize..12, 0usize..3, prop::bool::ANY).prop_map(|(w, extra, full)| {
        if w == 0 {
            return vec![None];
        }
        let mut g: Vec<GroupWindow> = vec![Some(w); 1 + extra];
        if full {
            g.insert(0, None);
        }
        g
    })
}

/// Brute force: with no eviction, a request run after others hits the longest block-aligned
/// prefix it shares with any earlier request's computed tokens (same salt), never its last token.
fn expected_hits(jobs: &[Job], outputs: &HashMap<u64, Vec<u32>>, bs: usize) -> u64 {
    let mut total = 0;
    for (k, j) in jobs.iter().enumerate() {
        let max_blocks = (j.prompt.len() - 1) / bs;
        let best = (0..k)
            .filter(|&i| jobs[i].salt == j.salt)
            .map(|i| {
                // Computed tokens of an earlier request: all but its last sampled token.
                let mut seq = jobs[i].prompt.clone();
                seq.extend(&outputs[&(i as u64)]);
                seq.pop();
                let common = seq
                    .iter()
                    .zip(&j.prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                (common / bs).min(max_blocks)
            })
            .max()
            .unwrap_or(0);
        total += (best * bs) as u64;
    }
    total
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn hits_match_brute_force_lcp_without_eviction(
        jobs in jobs(), bs in 1usize..5, algo in prop::bool::ANY, kv_groups in groups(),
    ) {
        // Without eviction a window group's dropped blocks stay cached, so a hit is the
        // same longest common prefix as with full attention everywhere.
        let algo = if algo { HashAlgo::Sha256 } else { HashAlgo::Builtin };
        let roomy = SchedulerConfig { kv_groups: kv_groups.clone(), ..cfg(8192, bs, 16, Some(algo)) };
        let r = run(roomy, &jobs, true);
        let off = run(SchedulerConfig { kv_groups, ..cfg(8192, bs, 16, None) }, &jobs, true);
        prop_assert_eq!(&r.outputs, &off.outputs);
        prop_assert_eq!(off.hit_tokens, 0);
        prop_assert_eq!(r.hit_tokens, expected_hits(&jobs, &r.outputs, bs));
    }

    #[test]
    fn tiny_pool_under_pressure_keeps_kv_intact_and_outputs_equal(
        jobs in jobs(), bs in 1usize..5, extra in 0usize..6, budget in 1usize..40,
        kv_groups in groups(),
    ) {
        let longest = jobs.iter().map(|j| j.prompt.len() + j.max_tokens).max().unwrap();
        let need = ferrite_core::kv_layout::max_blocks(&kv_groups, longest, bs, budget);
        let tight = SchedulerConfig {
            kv_groups,
            ..cfg(need + extra, bs, budget, Some(HashAlgo::Builtin))
        };
        let with = run(tight.clone(), &jobs, false);
        let without = run(SchedulerConfig { prefix_caching: None, ..tight.clone() }, &jobs, false);
        prop_assert_eq!(&with.outputs, &without.outputs);
        // A draft model beside prefix caching: a hit's draft K/V is caught up on, never
        // taken from the cached blocks (the mock checks its pages before every run).
        let spec = Speculation { k: 3, proposer: Proposer::DraftModel { model: "mock".into() }, disable_by_batch_size: 4 };
        let drafting = run(SchedulerConfig { speculation: Some(spec), ..tight }, &jobs, false);
        prop_assert_eq!(drafting.outputs, without.outputs);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// With recurrent state (a hybrid model): a hit restores the state checkpointed at the
    /// deepest cached block that has one; whatever the checkpoint slots' pressure (1-5 of
    /// them) and the KV pool's, outputs equal a run without prefix caching.
    #[test]
    fn hybrid_hits_restore_checkpointed_state_and_outputs_equal(
        jobs in jobs(), bs in 1usize..5, extra in 0usize..6, budget in 1usize..40,
        checkpoints in 1usize..6, one_at_a_time in prop::bool::ANY,
    ) {
        let longest = jobs.iter().map(|j| j.prompt.len() + j.max_tokens).max().unwrap();
        let hybrid = SchedulerConfig {
            state_slots: 4,
            state_checkpoints: checkpoints,
            draft_state_sets: 0,
            whole_prompts: false,
            step_time: None,
            ..cfg(longest.div_ceil(bs) + extra, bs, budget, Some(HashAlgo::Builtin))
        };
        let with = run(hybrid.clone(), &jobs, one_at_a_time);
        let without = run(
            SchedulerConfig { prefix_caching: None, state_checkpoints: 0, ..hybrid },
            &jobs,
            one_at_a_time,
        );
        prop_assert_eq!(without.hit_tokens, 0);
        prop_assert_eq!(with.outputs, without.outputs);
    }
}

/// One request after another on a shared stem: the second restores the state checkpointed
/// at the first one's last full prompt block and computes only what follows.
#[test]
fn a_hybrid_hit_reaches_the_last_checkpointed_block() {
    let stem: Vec<u32> = (1..14).collect();
    let job = |tail: u32| Job {
        step: 0,
        prompt: stem.iter().copied().chain([tail, tail + 1]).collect(),
        max_tokens: 3,
        salt: None,
    };
    let jobs = [job(20), job(30)];
    // Budget 5: job 0's 15 prompt tokens in chunks of 5, 5, 5: checkpoints after blocks
    // (of 4) 1, 2 and 3; job 1 shares 13 tokens = 3 full blocks, all checkpointed.
    let hybrid = SchedulerConfig {
        state_slots: 2,
        state_checkpoints: 8,
        draft_state_sets: 0,
        whole_prompts: false,
        step_time: None,
        ..cfg(64, 4, 5, Some(HashAlgo::Sha256))
    };
    let r = run(hybrid.clone(), &jobs, true);
    assert_eq!(r.hit_tokens, 12);
    let off = run(
        SchedulerConfig {
            prefix_caching: None,
            ..hybrid
        },
        &jobs,
        true,
    );
    assert_eq!(r.outputs, off.outputs);
}

#[test]
fn a_shared_stem_hits_whole_blocks_and_salt_isolates() {
    let stem: Vec<u32> = (1..10).collect();
    let job = |tail: u32, salt: Option<&str>| Job {
        step: 0,
        prompt: stem.iter().copied().chain([tail, tail + 1]).collect(),
        max_tokens: 3,
        salt: salt.map(String::from),
    };
    let jobs = [job(20, None), job(30, None), job(30, Some("other"))];
    let r = run(cfg(64, 4, 16, Some(HashAlgo::Sha256)), &jobs, true);
    // Job 1 shares 9 tokens (2 full blocks of 4) with job 0; job 2's salt isolates it.
    assert_eq!(r.hit_tokens, 8);
    assert_eq!(expected_hits(&jobs, &r.outputs, 4), 8);
}
