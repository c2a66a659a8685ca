//! Teacher-forced agreement with Hugging Face transformers (f32, same GGUF) on the real test
//! models, SmolLM2-135M and Gemma 3 270M: the fixtures were written by
//! `tests/oracle/make_fixture.py`; this test only reads them.

mod common;

use common::*;
use ferrite_model::loader::WeightFormat;
use ferrite_model::sampler::{argmax, log_sum_exp};

/// (top-1 agreement, mean |logprob difference| of the oracle's top token), over all positions.
fn agreement(model: &str, format: WeightFormat) -> (f64, f64, usize) {
    let mut model_ = load_path(&fetch_model(model), format);
    let model = &mut model_;
    let fx = fixture_of(if model.config.architecture == "gemma3" {
        "gemma3"
    } else {
        "smollm2"
    });
    let (mut agree, mut diff, mut n) = (0usize, 0f64, 0usize);
    for rec in fx["teacher_forced"].as_array().unwrap() {
        let tokens = ids(&rec["token_ids"]);
        let top1 = ids(&rec["top1"]);
        let top1_lp: Vec<f64> = rec["top1_logprob"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        for (i, row) in all_logits(model, &tokens).iter().enumerate() {
            let lse = log_sum_exp(row);
            agree += (argmax(row) == top1[i]) as usize;
            diff += ((row[top1[i] as usize] - lse) as f64 - top1_lp[i]).abs();
            n += 1;
        }
    }
    (agree as f64 / n as f64, diff / n as f64, n)
}

fn check(model: &str, format: WeightFormat, min_top1: f64, max_dlogprob: f64) {
    let (top1, lp, n) = agreement(model, format);
    println!(
        "{model} {format:?}: top-1 agreement {:.2}% over {n} positions, mean |dlogprob| {lp:.4}",
        top1 * 100.0
    );
    assert!(n >= 300, "fixture too small: {n}");
    assert!(top1 >= min_top1, "top-1 agreement {top1:.4} < {min_top1}");
    assert!(
        lp <= max_dlogprob,
        "mean logprob difference {lp:.4} > {max_dlogprob}"
    );
}

#[test]
fn default_fast_path_agrees_with_transformers() {
    // What a user gets without flags is the int8 path. Its activations (per block of 32)
    // flip near-ties: 96.4-97.8% depending on the kernel set's rounding, against 100% with
    // f32 weights and activations (llama.cpp on the same file: 96.4%).
    assert_eq!(WeightFormat::Auto.resolve_cpu(), WeightFormat::Native);
    check("smollm2", WeightFormat::Auto, 0.95, 0.05);
}

#[test]
fn f32_weights_agree_with_transformers() {
    check("smollm2", WeightFormat::F32, 0.99, 0.05);
}

#[test]
fn gemma3_f32_path_agrees_with_transformers() {
    check("gemma3", WeightFormat::F32, 0.98, 0.05);
}

#[test]
fn gemma3_default_fast_path_agrees_with_transformers() {
    // Measured: 98.2%, 0.030 with AVX-512 VNNI.
    check("gemma3", WeightFormat::Auto, 0.97, 0.04);
}
