//! Every decoder family against Hugging Face transformers: tiny random-weight checkpoints
//! written by `tests/oracle/make_tiny.py` (safetensors and, where llama.cpp has a layout for
//! the family, a GGUF of the same weights), teacher-forced over a sequence longer than every
//! sliding window, on the f32 path. The cache holds K and V in f16, so the oracle for the
//! 1e-3 bound is transformers with K and V rounded to f16 where they enter the cache; against
//! transformers in f32 throughout the difference is that rounding (2.5-7.1e-3 here).

mod common;

use common::*;
use ferrite_model::loader::WeightFormat;

/// The token ids, and the oracle's logits: `logits` (f32) or `logits_f16_kv`.
fn oracle(family: &str, key: &str) -> (Vec<u32>, Vec<Vec<f32>>) {
    let p = repo_root().join(format!("tests/oracle/tiny/{family}/oracle.json"));
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let logits = j[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    (ids(&j["token_ids"]), logits)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Logits within `1e-3` of transformers (f16 K/V) from the safetensors folder, and from the
/// GGUF of the same weights where there is one.
fn check(family: &str, has_gguf: bool) {
    let (tokens, want) = oracle(family, "logits_f16_kv");
    let (_, want_f32) = oracle(family, "logits");
    let dir = repo_root().join(format!("tests/oracle/tiny/{family}"));
    let mut sources = vec![("safetensors", dir.clone())];
    if has_gguf {
        sources.push(("GGUF", dir.with_extension("gguf")));
    }
    for (kind, path) in sources {
        let mut model = load_path(&path, WeightFormat::F32);
        let got = all_logits(&mut model, &tokens);
        let (d, d32) = (max_diff(&got, &want), max_diff(&got, &want_f32));
        println!("{family} {kind}: max |dlogit| {d:.2e} (f16 K/V oracle), {d32:.2e} (f32 oracle)");
        assert!(d <= 1e-3, "{family} {kind}: logits off by {d}");
        assert!(
            d32 <= 0.01,
            "{family} {kind}: logits off the f32 oracle by {d32}"
        );
    }
}

#[test]
fn llama_3_1_with_rope_scaling() {
    check("llama31", true);
}

#[test]
fn mistral_with_a_window_shorter_than_the_prompt() {
    check("mistral", false);
}

#[test]
fn qwen2_with_qkv_bias() {
    check("qwen2", true);
}

#[test]
fn qwen3_with_qk_norm_and_yarn() {
    check("qwen3", true);
}

#[test]
fn gemma2_with_soft_caps() {
    check("gemma2", true);
}

#[test]
fn gemma3_with_local_and_global_layers() {
    check("gemma3", true);
}
