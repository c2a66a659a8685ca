//! Multi-token-prediction heads (Qwen3-Next with an MoE head layer, Qwen3.5 with a dense one)
//! against transformers' modules assembled as vLLM runs the head (`tests/oracle/make_mtp.py`):
//! teacher-forced on the f32 path, the target's logits and the head's within 1e-3, whether the
//! sequence runs as one prefill or in chunks (the head attends over its own cached K/V).

mod common;

use common::*;
use ferrite_core::output::SampledToken;
use ferrite_core::scheduler::{PoolStep, ScheduledRequest, SchedulerOutput, SpecStep, StateStep};
use ferrite_core::spec_decode::MtpRun;
use ferrite_model::loader::{load_cpu_decoder_with_mtp, WeightFormat};
use ferrite_model::mtp_draft::propose;
use ferrite_model::step::StepModel;
use ferrite_model::step::{PackedStep, NO_SLOT};
use std::collections::HashMap;

fn check(family: &str) {
    let name = format!("{family}_mtp");
    let (tokens, want_target) = tiny_oracle(&name, "logits_f16_kv");
    let (_, want) = tiny_oracle(&name, "mtp_logits_f16_kv");
    let dir = repo_root().join(format!("tests/oracle/tiny/{name}"));
    let mut model = load_cpu_decoder_with_mtp(&dir, WeightFormat::F32).unwrap();
    let n = tokens.len();
    for ends in [vec![n], vec![20, 21, n]] {
        let (target, head) = teacher_forced(&mut model, &tokens, &ends);
        let (dt, dh) = (max_diff(&target, &want_target), max_diff(&head, &want));
        println!(
            "{name} in chunks ending at {ends:?}: max |dlogit| target {dt:.2e}, MTP head {dh:.2e}"
        );
        assert!(dt <= 1e-3, "{name}: target logits off by {dt}");
        assert!(dh <= 1e-3, "{name}: MTP logits off by {dh}");
    }
    // Loaded plainly, the same checkpoint has no head and no K/V for one; without its weights
    // it cannot be loaded with one.
    let mut plain = load_path(&dir, WeightFormat::F32);
    assert_eq!(plain.layout.slots + 1, model.layout.slots);
    let err = teacher_forced_error(&mut plain, &tokens);
    assert!(err.contains("no multi-token-prediction head"), "{err}");
    let none = load_cpu_decoder_with_mtp(&dir.with_file_name(family), WeightFormat::F32);
    let err = none.err().expect("a head without weights").to_string();
    assert!(err.contains("declares no multi-token-prediction"), "{err}");
}

fn teacher_forced_error(model: &mut CpuModel, tokens: &[u32]) -> String {
    let mut s = PackedStep::default();
    model.allocate_cache(4, 16).unwrap();
    model.allocate_state(1).unwrap();
    s.push(
        &tokens[..4],
        0,
        &vec![vec![0]; model.layout.groups.len()],
        16,
    );
    s.state.slots.push(0);
    s.logits_indices = vec![3];
    s.finish();
    model.forward(&s).unwrap();
    model.forward_mtp(&s, false).unwrap_err().to_string()
}

#[test]
fn qwen3_next_mtp_head_with_experts() {
    check("qwen3_next");
}

#[test]
fn qwen3_5_mtp_head() {
    check("qwen3_5");
}

/// One request of a hand-built step.
fn scheduled(tokens: &[u32], start: usize, tables: &[Vec<u32>]) -> ScheduledRequest {
    ScheduledRequest {
        req_id: 7,
        token_ids: tokens.to_vec(),
        start_pos: start,
        block_tables: tables.to_vec(),
        sample: None,
        state: Some(StateStep {
            slot: 0,
            restore: None,
            save: None,
            drafts: None,
        }),
        pooling: PoolStep::default(),
        spec: SpecStep::default(),
        prompt_logprobs: None,
    }
}

/// The target's step of `r` as the runner packs it (every row's logits).
fn target_step(r: &ScheduledRequest, bs: usize) -> PackedStep {
    let mut s = PackedStep::default();
    s.push(&r.token_ids, r.start_pos, &r.block_tables, bs);
    s.state.slots.push(0);
    let st = r.state.expect("a hybrid's request holds a state slot");
    s.state.restores.push(st.restore.unwrap_or(NO_SLOT));
    s.state.saves.push([0, NO_SLOT]);
    let known = (r.token_ids.len() - r.spec.draft.len()) as u32;
    s.state
        .drafts
        .push(st.drafts.map_or([0, NO_SLOT], |d| [known, d]));
    s.logits_indices = (0..r.token_ids.len() as u32).collect();
    s.finish();
    s
}

fn argmax(row: &[f32]) -> u32 {
    let best = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1));
    best.unwrap().0 as u32
}

/// The MTP proposer after a prefill, after a verify step that rejected a draft, and after the
/// decode that follows it: each first draft is the argmax of transformers' head at the row of
/// the last accepted token, and the decode after the rejection starts from the state saved
/// after the accepted tokens (its target logits are the oracle's; without the restore they are
/// not).
#[test]
fn mtp_proposer_drafts_the_heads_argmax_and_a_rejected_draft_rolls_back() {
    let name = "qwen3_next_mtp";
    let (s, want_target) = tiny_oracle(name, "logits_f16_kv");
    let (_, want_head) = tiny_oracle(name, "mtp_logits_f16_kv");
    let dir = repo_root().join(format!("tests/oracle/tiny/{name}"));
    let mut model = load_cpu_decoder_with_mtp(&dir, WeightFormat::F32).unwrap();
    let (bs, v, groups) = (16, model.config.vocab_size, model.layout.groups.len());
    model.allocate_cache(4 * groups, bs).unwrap();
    // Slot 0 the request's, 1-2 its draft states.
    model.allocate_state(3).unwrap();
    let tables = fresh_tables(groups, 4);
    let n = 20;
    let sampled = |t: &[u32]| {
        let d = t.iter().map(|&token_id| SampledToken {
            token_id,
            logprobs: None,
        });
        HashMap::from([(7, d.collect())])
    };
    let mut run = |r: ScheduledRequest, drawn: &[u32]| {
        let step = target_step(&r, bs);
        let logits: Vec<Vec<f32>> = model
            .forward(&step)
            .unwrap()
            .chunks(v)
            .map(|c| c.to_vec())
            .collect();
        let out = SchedulerOutput {
            requests: vec![r],
            ..Default::default()
        };
        let drafts = propose(&mut model, &out, &step, &sampled(drawn), bs).unwrap();
        (logits, drafts.get(&7).cloned().unwrap_or_default())
    };
    let mtp = |propose| {
        Some(MtpRun {
            next: None,
            propose,
        })
    };
    let close = |got: &[f32], p: usize| max_diff(&[got.to_vec()], &[want_target[p].clone()]);

    // The prompt's last chunk: the head drafts after the sampled token.
    let mut r = scheduled(&s[..n], 0, &tables);
    r.spec.mtp_run = mtp(1);
    let (logits, drafts) = run(r, &[s[n]]);
    assert!(close(&logits[n - 1], n - 1) <= 1e-3);
    assert_eq!(drafts, vec![argmax(&want_head[n - 1])]);

    // A verify step: the first draft holds, the second does not.
    let wrong = (s[n + 2] + 1) % v as u32;
    let mut r = scheduled(&[s[n], s[n + 1], wrong], n, &tables);
    r.spec.draft = vec![s[n + 1], wrong];
    r.state.as_mut().unwrap().drafts = Some(1);
    r.spec.mtp_run = mtp(1);
    let (logits, drafts) = run(r, &[s[n + 1], s[n + 2]]);
    assert!(close(&logits[0], n) <= 1e-3 && close(&logits[1], n + 1) <= 1e-3);
    assert_eq!(drafts, vec![argmax(&want_head[n + 1])]);

    // The next decode restores the state after the accepted tokens (slot 1 + 1 accepted);
    // the head drafts three tokens, the first from the target's hidden state.
    let mut r = scheduled(&[s[n + 2]], n + 2, &tables);
    r.state.as_mut().unwrap().restore = Some(2);
    r.spec.mtp_run = mtp(3);
    let (logits, drafts) = run(r, &[s[n + 3]]);
    let d = close(&logits[0], n + 2);
    println!("after the rollback: max |dlogit| {d:.2e}");
    assert!(d <= 1e-3, "the decode after a rejected draft is off by {d}");
    assert_eq!(drafts.len(), 3);
    assert_eq!(drafts[0], argmax(&want_head[n + 2]));

    // A verify step whose drafts all hold: the live state is right, nothing is restored.
    let mut r = scheduled(&[s[n + 3], s[n + 4], s[n + 5]], n + 3, &tables);
    r.spec.draft = vec![s[n + 4], s[n + 5]];
    r.state.as_mut().unwrap().drafts = Some(1);
    r.spec.mtp_run = mtp(1);
    let (logits, drafts) = run(r, &[s[n + 4], s[n + 5], s[n + 6]]);
    assert!((0..3).all(|i| close(&logits[i], n + 3 + i) <= 1e-3));
    assert_eq!(drafts, vec![argmax(&want_head[n + 5])]);
    let mut r = scheduled(&[s[n + 6]], n + 6, &tables);
    r.spec.mtp_run = mtp(1);
    let (logits, drafts) = run(r.clone(), &[s[n + 7]]);
    assert!(close(&logits[0], n + 6) <= 1e-3);
    assert_eq!(drafts, vec![argmax(&want_head[n + 6])]);

    // The same decode restoring a wrong saved state (after one token less): its logits are
    // off, so the checks above see the state.
    r.state.as_mut().unwrap().restore = Some(2);
    let (logits, _) = run(r, &[s[n + 7]]);
    assert!(
        close(&logits[0], n + 6) > 1e-2,
        "a wrong state left no trace"
    );
}
