//! Checkpoints the loader cannot honour are refused at start, by `plan`'s config read and by
//! the loader, with a message naming the format: the tiny Llama 3.1 checkpoint rewritten as
//! each quantized format (a declared `quantization_config`, MLX's `quantization`, FP8 or packed
//! integer tensors without a config) and GGUF tensor types candle cannot read.

mod common;

use candle_core::{DType, Device, Tensor};
use common::repo_root;
use ferrite_model::checkpoint::config_source;
use ferrite_model::loader::{load_cpu_decoder, LoadFormat, WeightFormat};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn tiny() -> PathBuf {
    repo_root().join("tests/oracle/tiny/llama31")
}

/// The tiny checkpoint in a folder of its own, its config edited by `config` and its
/// tensors by `tensors`.
fn variant(
    name: &str,
    config: &dyn Fn(&mut Value),
    tensors: &dyn Fn(&mut HashMap<String, Tensor>),
) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrite-refused-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny().join("config.json")).unwrap())
            .unwrap();
    config(&mut c);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let mut ts =
        candle_core::safetensors::load(tiny().join("model.safetensors"), &Device::Cpu).unwrap();
    tensors(&mut ts);
    candle_core::safetensors::save(&ts, dir.join("model.safetensors")).unwrap();
    dir
}

fn quant_config(q: Value) -> impl Fn(&mut Value) {
    move |c: &mut Value| c["quantization_config"] = q.clone()
}

/// The error of the CPU loader, and of `plan`'s config read where the config tells.
fn refusals(path: &Path, config_tells: bool) -> Vec<String> {
    let load = load_cpu_decoder(
        path,
        LoadFormat::Auto,
        WeightFormat::F32,
        None,
        Some(64),
        &mut |_, _| {},
    );
    let mut out = vec![match load {
        Ok(_) => "loaded".to_string(),
        Err(e) => format!("{e:#}"),
    }];
    if config_tells {
        out.push(match config_source(path) {
            Ok(_) => "config read".to_string(),
            Err(e) => format!("{e:#}"),
        });
    }
    out
}

fn assert_refused(path: &Path, config_tells: bool, wants: &[&str]) {
    for e in refusals(path, config_tells) {
        println!("{e}");
        for want in wants {
            assert!(e.contains(want), "`{want}` not in: {e}");
        }
    }
}

#[test]
fn the_tiny_checkpoint_itself_loads() {
    let dir = variant("plain", &|_| {}, &|_| {});
    for r in refusals(&dir, true) {
        assert!(r == "loaded" || r == "config read", "{r}");
    }
}

#[test]
fn declared_quantization_formats_are_refused() {
    let fp8 = json!({"quant_method": "fp8", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]});
    let awq = json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"});
    let gptq = json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false});
    let ct = json!({"quant_method": "compressed-tensors", "format": "pack-quantized"});
    for (name, q, want) in [
        ("fp8", fp8, "fp8"),
        ("awq", awq, "awq"),
        ("gptq", gptq, "gptq"),
        ("compressed", ct, "compressed-tensors"),
    ] {
        let dir = variant(name, &quant_config(q), &|_| {});
        assert_refused(&dir, true, &["quantization_config", want, "not load"]);
    }
    let mlx = variant(
        "mlx",
        &|c| c["quantization"] = json!({"group_size": 64, "bits": 4}),
        &|_| {},
    );
    assert_refused(&mlx, true, &["MLX 4-bit", "cannot load"]);
}

#[test]
fn quantized_tensors_without_a_config_are_refused() {
    let q = "model.layers.0.self_attn.q_proj.weight";
    let fp8 = variant("fp8_tensors", &|_| {}, &|ts| {
        let w = ts[q].to_dtype(DType::F8E4M3).unwrap();
        ts.insert(q.into(), w);
    });
    assert_refused(&fp8, false, &[q, "F8_E4M3", "cannot load"]);
    // AWQ/GPTQ/MLX store 4-bit codes packed eight to a u32.
    let packed = variant("packed_tensors", &|_| {}, &|ts| {
        let w = ts[q].to_dtype(DType::U32).unwrap();
        ts.insert(q.into(), w);
    });
    assert_refused(&packed, false, &[q, "U32", "cannot load"]);
}

#[test]
fn gguf_tensor_types_candle_cannot_read_are_named() {
    let src = std::fs::read(repo_root().join("tests/oracle/tiny/qwen3.gguf")).unwrap();
    let name = b"blk.0.attn_q.weight";
    let at = src.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let dims = u32::from_le_bytes(src[at..at + 4].try_into().unwrap()) as usize;
    let ty = at + 4 + 8 * dims;
    for (t, want) in [
        (39u32, "MXFP4 (type 39)"),
        (23, "IQ4_XS"),
        (999, "type 999"),
    ] {
        let mut b = src.clone();
        b[ty..ty + 4].copy_from_slice(&t.to_le_bytes());
        let path = std::env::temp_dir().join(format!("ferrite-refused-{t}.gguf"));
        std::fs::write(&path, b).unwrap();
        assert_refused(&path, false, &[want, "cannot load", "Q4_K"]);
    }
}
