//! Every decoder family against Hugging Face transformers: tiny random-weight checkpoints
//! written by `tests/oracle/make_tiny.py` (safetensors and, where llama.cpp has a layout for
//! the family, a GGUF of the same weights), teacher-forced over a sequence longer than every
//! sliding window, on the f32 path. The cache holds K and V in f16, so the oracle for the
//! 1e-3 bound is transformers with K and V rounded to f16 where they enter the cache; against
//! transformers in f32 throughout the difference is that rounding (2.5e-3 to 2e-2 here).

mod common;

use common::*;
use ferrite_model::loader::{load_cpu_decoder, LoadFormat, WeightFormat};
use ferrite_model::step::PackedStep;
use ferrite_model::step::StepModel;

/// Logits within `1e-3` of transformers (f16 K/V) from the safetensors folder, and from the
/// GGUF of the same weights where there is one.
fn check(family: &str, has_gguf: bool) {
    let (tokens, want) = tiny_oracle(family, "logits_f16_kv");
    let (_, want_f32) = tiny_oracle(family, "logits");
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
        // Against f32 throughout: no further than the f16 rounding moves transformers itself.
        let rounding = max_diff(&want, &want_f32);
        assert!(
            d32 <= rounding + 1e-3,
            "{family} {kind}: logits off the f32 oracle by {d32} (the rounding: {rounding})"
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

#[test]
fn qwen3_5_gated_delta_net_and_gated_attention() {
    check("qwen3_5", false);
}

#[test]
fn qwen3_5_moe_hybrid_with_fused_expert_tensors() {
    check("qwen3_5_moe", false);
}

#[test]
fn qwen3_next_fused_projections_experts_and_a_dense_layer() {
    check("qwen3_next", false);
}

#[test]
fn mixtral_experts_per_tensor_and_stacked_in_gguf() {
    check("mixtral", true);
}

#[test]
fn qwen2_moe_with_a_gated_shared_expert() {
    check("qwen2_moe", true);
}

#[test]
fn qwen3_moe_with_a_dense_layer() {
    check("qwen3_moe", false);
}

/// On the int8 path (random Q8_0 experts of the tiny Qwen2-MoE's shapes), a request's logits
/// computed alone are bit-identical to its logits packed with another request whose rows
/// share its experts.
#[test]
fn expert_rows_do_not_depend_on_the_rows_they_share_an_expert_with() {
    let dir = repo_root().join("tests/oracle/tiny/qwen2_moe");
    let mut model = load_cpu_decoder(
        &dir,
        LoadFormat::Dummy,
        WeightFormat::Native,
        None,
        Some(256),
        &mut |_, _| {},
    )
    .unwrap();
    let (tokens, _) = tiny_oracle("qwen2_moe", "logits");
    let (a, b) = (&tokens[..29], &tokens[7..47]);
    let alone = all_logits(&mut model, a);
    let bs = 16;
    model.allocate_cache(8, bs).unwrap();
    let mut step = PackedStep::default();
    step.push(b, 0, &[vec![0, 1, 2]], bs);
    step.push(a, 0, &[vec![3, 4]], bs);
    step.logits_indices = (b.len() as u32..(a.len() + b.len()) as u32).collect();
    step.finish();
    let v = model.config.vocab_size;
    let packed: Vec<Vec<f32>> = model
        .forward(&step)
        .unwrap()
        .chunks(v)
        .map(|r| r.to_vec())
        .collect();
    assert_eq!(packed.len(), alone.len());
    for (i, (p, a)) in packed.iter().zip(&alone).enumerate() {
        assert!(
            p.iter().zip(a).all(|(x, y)| x.to_bits() == y.to_bits()),
            "position {i}: packed logits differ from the request alone"
        );
    }
    assert!(alone.iter().flatten().all(|x| x.is_finite()));
}

/// The hybrid (gated delta-net) fed in chunks of 1 (token-by-token decode), 7 and 64, two
/// requests sharing each step in their own state slots, gives the logits of one whole
/// prefill: chunked prefill leaves the state a whole prefill leaves.
#[test]
fn qwen3_5_chunked_prefill_and_decode_match_a_whole_prefill() {
    let dir = repo_root().join("tests/oracle/tiny/qwen3_5");
    let mut model = load_path(&dir, WeightFormat::F32);
    let (tokens, _) = tiny_oracle("qwen3_5", "logits");
    let whole = all_logits(&mut model, &tokens);
    for chunk in [1, 7, 64] {
        let got = chunked_logits(&mut model, &tokens, chunk);
        let d = max_diff(&got, &whole);
        println!("qwen3_5 in chunks of {chunk}: max |dlogit| {d:.2e} against one whole prefill");
        assert!(d <= 1e-3, "chunks of {chunk}: logits off by {d}");
    }
}

/// A prefix-cache hit on the hybrid: request A's prefill checkpoints its state after 32
/// tokens (in place, into a checkpoint slot); request B, sharing those 32 tokens and their
/// K/V blocks, starts from that checkpoint at position 32. B's logits equal B computed cold.
#[test]
fn qwen3_5_prefix_hit_from_a_checkpoint_matches_a_cold_prefill() {
    let dir = repo_root().join("tests/oracle/tiny/qwen3_5");
    let mut model = load_path(&dir, WeightFormat::F32);
    let (tokens, _) = tiny_oracle("qwen3_5", "logits");
    let b: Vec<u32> = tokens[..32]
        .iter()
        .chain(tokens[..16].iter().rev())
        .copied()
        .collect();
    let cold = all_logits(&mut model, &b);
    let (got, want) = prefix_hit(&mut model, &tokens, &b, &cold);
    let d = max_diff(&got, &want);
    println!("qwen3_5 prefix hit from a checkpoint: max |dlogit| {d:.2e} against a cold prefill");
    assert!(d <= 1e-3, "logits off by {d}");
}

/// A multimodal checkpoint's layout (Qwen3.5 as published: the language model under
/// `model.language_model.`, a nested `text_config`): the tiny Qwen3.5 rewritten so loads and
/// computes what the plain one does.
#[test]
fn qwen3_5_stored_under_language_model_loads_the_same() {
    use candle_core::{Device, Tensor};
    let dir = repo_root().join("tests/oracle/tiny/qwen3_5");
    let out = std::env::temp_dir().join(format!("ferrite-vl-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let renamed: std::collections::HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, v)| match k.strip_prefix("model.") {
            Some(rest) => (format!("model.language_model.{rest}"), v),
            None => (k, v),
        })
        .collect();
    candle_core::safetensors::save(&renamed, out.join("model.safetensors")).unwrap();
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let config = serde_json::json!({
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
    });
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    let (tokens, _) = tiny_oracle("qwen3_5", "logits");
    let want = all_logits(&mut load_path(&dir, WeightFormat::F32), &tokens);
    let got = all_logits(&mut load_path(&out, WeightFormat::F32), &tokens);
    std::fs::remove_dir_all(&out).unwrap();
    assert_eq!(max_diff(&got, &want), 0.0);
}

/// `ferrite plan`'s weight figure, read from headers alone, is what loading measures: every
/// tiny family as safetensors and GGUF, the real SmolLM2 (Q4_1), Gemma 3 (Q4_K_M) and
/// all-MiniLM-L6-v2 (BERT, f32 safetensors), on the int8 path and in f32.
#[test]
fn header_weight_bytes_match_the_loaded_weights() {
    use ferrite_model::checkpoint::open_weights;
    use ferrite_model::weights::footprint::cpu_weight_bytes;
    let tiny = repo_root().join("tests/oracle/tiny");
    let mut paths: Vec<std::path::PathBuf> = std::fs::read_dir(&tiny)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    paths.extend(["smollm2", "gemma3", "minilm"].map(fetch_model));
    for path in &paths {
        for format in [WeightFormat::Auto, WeightFormat::F32] {
            let (_, src) = open_weights(path, LoadFormat::Auto).unwrap();
            let planned = cpu_weight_bytes(&src, format);
            let load =
                |p| load_cpu_decoder(p, LoadFormat::Auto, format, None, None, &mut |_, _| {});
            let loaded = load(path).unwrap().weight_bytes();
            assert_eq!(planned, loaded, "{} {format:?}", path.display());
        }
    }
}
