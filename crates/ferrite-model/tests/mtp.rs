//! Multi-token-prediction heads (Qwen3-Next with an MoE head layer, Qwen3.5 with a dense one)
//! against transformers' modules assembled as vLLM runs the head (`tests/oracle/make_mtp.py`):
//! teacher-forced on the f32 path, the target's logits and the head's within 1e-3, whether the
//! sequence runs as one prefill or in chunks (the head attends over its own cached K/V).

mod common;

use common::*;
use ferrite_model::loader::{load_cpu_decoder_with_mtp, WeightFormat};
use ferrite_model::runner::StepModel;
use ferrite_model::step::PackedStep;

/// The target's and the head's logits at every position, the sequence run in chunks ending at
/// `ends`: after
/// each target step, the head over the same rows with each token moved one ahead (the last
/// row's next token is the sequence's first, as the oracle has it).
fn teacher_forced(
    model: &mut CpuDecoder,
    tokens: &[u32],
    ends: &[usize],
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let (bs, n) = (16, tokens.len());
    let blocks = n.div_ceil(bs);
    let groups = model.layout.groups.len();
    model.allocate_cache(blocks * groups, bs).unwrap();
    model.allocate_state(1).unwrap();
    let tables = fresh_tables(groups, blocks);
    let v = model.config.vocab_size;
    let step = |ids: &[u32], start: usize| {
        let mut s = PackedStep::default();
        s.push(ids, start, &tables, bs);
        s.state_slots.push(0);
        s.logits_indices = (0..ids.len() as u32).collect();
        s.finish();
        s
    };
    let rows = |l: &[f32]| l.chunks(v).map(|r| r.to_vec()).collect::<Vec<_>>();
    let (mut target, mut head) = (Vec::new(), Vec::new());
    let starts = std::iter::once(0).chain(ends.iter().copied());
    for r in starts.zip(ends).map(|(a, &b)| a..b) {
        target.extend(rows(
            model.forward(&step(&tokens[r.clone()], r.start)).unwrap(),
        ));
        let next: Vec<u32> = r.clone().map(|i| tokens[(i + 1) % n]).collect();
        head.extend(rows(model.forward_mtp(&step(&next, r.start)).unwrap()));
    }
    (target, head)
}

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

fn teacher_forced_error(model: &mut CpuDecoder, tokens: &[u32]) -> String {
    let mut s = PackedStep::default();
    model.allocate_cache(4, 16).unwrap();
    model.allocate_state(1).unwrap();
    s.push(
        &tokens[..4],
        0,
        &vec![vec![0]; model.layout.groups.len()],
        16,
    );
    s.state_slots.push(0);
    s.logits_indices = vec![3];
    s.finish();
    model.forward(&s).unwrap();
    model.forward_mtp(&s).unwrap_err().to_string()
}

#[test]
fn qwen3_next_mtp_head_with_experts() {
    check("qwen3_next");
}

#[test]
fn qwen3_5_mtp_head() {
    check("qwen3_5");
}
