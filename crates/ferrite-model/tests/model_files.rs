//! A corpus of broken model files (56), made from the tiny Qwen3 GGUF: every one fails to load with
//! an error naming what is wrong; none panics and none loads weights from the wrong bytes.
//! Metadata that contradicts the tensors (zero or inconsistent heads, layers, sizes; NaN, zero
//! or negative numbers; wrong value types), and bytes that contradict the header (magic,
//! version, counts, truncations, moved offsets, changed types and shapes, renamed tensors).

mod common;

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::Device;
use common::repo_root;
use ferrite_model::loader::{load_cpu_decoder, LoadFormat, WeightFormat};
use ferrite_model::weights::gguf::GgufFile;
use gguf_file::Value;
use std::path::{Path, PathBuf};

fn source() -> PathBuf {
    repo_root().join("tests/oracle/tiny/qwen3.gguf")
}

fn out_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrite-bad-models-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny GGUF written again with its metadata edited (`None`: a key dropped) and `extra` keys.
fn rewritten(
    name: &str,
    edit: &dyn Fn(&str, &Value) -> Option<Option<Value>>,
    extra: &[(&str, Value)],
) -> PathBuf {
    let mut g = GgufFile::open(&source()).unwrap();
    let mut meta: Vec<(String, Value)> = Vec::new();
    for (k, v) in &g.content.metadata {
        match edit(k, v) {
            None => meta.push((k.clone(), v.clone())),
            Some(Some(new)) => meta.push((k.clone(), new)),
            Some(None) => {}
        }
    }
    meta.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let names: Vec<String> = g.content.tensor_infos.keys().cloned().collect();
    let tensors: Vec<(String, QTensor)> = names
        .iter()
        .map(|n| (n.clone(), g.tensor(n, &Device::Cpu).unwrap()))
        .collect();
    let path = out_dir().join(format!("{name}.gguf"));
    let mut f = std::fs::File::create(&path).unwrap();
    let m: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut f, &m, &t).unwrap();
    path
}

/// The tiny GGUF's bytes changed by `edit`.
fn patched(name: &str, edit: &dyn Fn(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(source()).unwrap();
    edit(&mut bytes);
    let path = out_dir().join(format!("{name}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Where tensor `name`'s info sits in the header: (its number of dimensions, its first
/// dimension, its type, its offset) as byte positions.
fn tensor_info(bytes: &[u8], name: &str) -> (usize, usize, usize, usize) {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend(name.as_bytes());
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    let dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let ty = at + 4 + 8 * dims;
    (at, at + 4, ty, ty + 4)
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn add_u64(b: &mut [u8], at: usize, delta: i64) {
    let v = u64::from_le_bytes(b[at..at + 8].try_into().unwrap()).wrapping_add(delta as u64);
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Loads `path`; `Err(message)` for an error, or a panic or a silent load reported as such.
fn load(path: &Path) -> Result<(), String> {
    let r = std::panic::catch_unwind(|| {
        load_cpu_decoder(
            path,
            LoadFormat::Auto,
            WeightFormat::F32,
            None,
            Some(64),
            &mut |_, _| {},
        )
        .map(|_| ())
    });
    match r {
        Err(_) => panic!("{}: the loader panicked", path.display()),
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("{e:#}")),
    }
}

#[test]
fn every_broken_model_file_fails_with_the_problem_named() {
    let key = |k: &'static str, v: Value| {
        move |name: &str, _: &Value| (name == k).then(|| Some(v.clone()))
    };
    let mut cases: Vec<(String, PathBuf, &str)> = Vec::new();
    let mut meta = |name: &str, k: &'static str, v: Value, want: &'static str| {
        let path = rewritten(name, &key(k, v), &[]);
        cases.push((name.into(), path, want));
    };
    meta(
        "heads0",
        "qwen3.attention.head_count",
        Value::U32(0),
        "attention heads",
    );
    meta("heads3", "qwen3.attention.head_count", Value::U32(3), "");
    meta(
        "heads_huge",
        "qwen3.attention.head_count",
        Value::U32(1 << 30),
        "",
    );
    meta(
        "kv_heads0",
        "qwen3.attention.head_count_kv",
        Value::U32(0),
        "",
    );
    meta(
        "kv_heads3",
        "qwen3.attention.head_count_kv",
        Value::U32(3),
        "",
    );
    meta(
        "kv_heads4",
        "qwen3.attention.head_count_kv",
        Value::U32(4),
        "self_attn.k_proj.weight",
    );
    meta(
        "layers0",
        "qwen3.block_count",
        Value::U32(0),
        "`num_hidden_layers` is 0",
    );
    meta("layers3", "qwen3.block_count", Value::U32(3), "blk.2");
    // Found by the fuzzer: 318M layers took minutes and gigabytes before the first missing one.
    meta(
        "layers_huge",
        "qwen3.block_count",
        Value::U32(318_767_106),
        "layers in a file of 25 tensors",
    );
    meta(
        "hidden_huge",
        "qwen3.embedding_length",
        Value::U64(1 << 40),
        "larger than any tensor dimension",
    );
    meta("hidden0", "qwen3.embedding_length", Value::U32(0), "");
    meta("hidden65", "qwen3.embedding_length", Value::U32(65), "");
    meta(
        "ffn1",
        "qwen3.feed_forward_length",
        Value::U32(1),
        "mlp.gate_proj.weight",
    );
    meta("ffn0", "qwen3.feed_forward_length", Value::U32(0), "");
    meta(
        "ffn96",
        "qwen3.feed_forward_length",
        Value::U32(96),
        "mlp.gate_proj.weight",
    );
    meta("head_dim0", "qwen3.attention.key_length", Value::U32(0), "");
    meta(
        "head_dim33",
        "qwen3.attention.key_length",
        Value::U32(33),
        "",
    );
    meta(
        "eps_nan",
        "qwen3.attention.layer_norm_rms_epsilon",
        Value::F32(f32::NAN),
        "rms_norm_eps",
    );
    meta(
        "eps_negative",
        "qwen3.attention.layer_norm_rms_epsilon",
        Value::F32(-1.0),
        "rms_norm_eps",
    );
    meta(
        "eps_inf",
        "qwen3.attention.layer_norm_rms_epsilon",
        Value::F32(f32::INFINITY),
        "rms_norm_eps",
    );
    meta(
        "rope_theta_nan",
        "qwen3.rope.freq_base",
        Value::F32(f32::NAN),
        "rope",
    );
    meta(
        "rope_theta0",
        "qwen3.rope.freq_base",
        Value::F32(0.0),
        "rope",
    );
    meta(
        "rope_factor0",
        "qwen3.rope.scaling.factor",
        Value::F32(0.0),
        "rope",
    );
    meta(
        "context0",
        "qwen3.context_length",
        Value::U32(0),
        "max_position_embeddings",
    );
    meta(
        "heads_string",
        "qwen3.attention.head_count",
        Value::String("four".into()),
        "qwen3.attention.head_count",
    );
    meta(
        "arch_unknown",
        "general.architecture",
        Value::String("qwen99".into()),
        "qwen99",
    );
    meta(
        "arch_number",
        "general.architecture",
        Value::U32(3),
        "general.architecture",
    );
    let dropped = rewritten(
        "no_heads",
        &|k, _| (k == "qwen3.attention.head_count").then_some(None),
        &[],
    );
    cases.push(("no_heads".into(), dropped, "qwen3.attention.head_count"));
    let align0 = rewritten(
        "alignment0",
        &|_, _| None,
        &[("general.alignment", Value::U32(0))],
    );
    cases.push(("alignment0".into(), align0, ""));
    let align3 = rewritten(
        "alignment3",
        &|_, _| None,
        &[("general.alignment", Value::U32(3))],
    );
    cases.push(("alignment3".into(), align3, "alignment"));

    let bytes = std::fs::read(source()).unwrap();
    let data = GgufFile::open(&source())
        .unwrap()
        .content
        .tensor_data_offset as usize;
    let len = bytes.len();
    let mut raw = |name: &str, want: &'static str, edit: &dyn Fn(&mut Vec<u8>)| {
        cases.push((name.into(), patched(name, edit), want));
    };
    raw("magic", "", &|b| b[3] = b'X');
    raw("version99", "", &|b| put_u32(b, 4, 99));
    raw("tensor_count_plus1", "", &|b| add_u64(b, 8, 1));
    raw("tensor_count_huge", "", &|b| add_u64(b, 8, 1 << 40));
    raw("kv_count_plus1", "", &|b| add_u64(b, 16, 1));
    for (i, cut) in [2, 20, 100, data - 40, data + 100, data + 70_000, len - 1]
        .into_iter()
        .enumerate()
    {
        raw(&format!("truncated{i}_at{cut}"), "", &move |b| {
            b.truncate(cut)
        });
    }
    let (_, _, _, off) = tensor_info(&bytes, "blk.0.attn_k.weight");
    raw("offset_plus3", "blk.0.attn_k.weight", &move |b| {
        add_u64(b, off, 3)
    });
    raw("offset_gap", "blk.0.attn_k.weight", &move |b| {
        add_u64(b, off, 32)
    });
    raw("offset_overlap", "blk.0.attn_k.weight", &move |b| {
        add_u64(b, off, -32)
    });
    let (_, _, _, out_off) = tensor_info(&bytes, "output.weight");
    raw("offset_past_end", "output.weight", &move |b| {
        add_u64(b, out_off, 1 << 40)
    });
    let (_, _, q_ty, _) = tensor_info(&bytes, "blk.0.attn_q.weight");
    raw("type_f16_to_f32", "blk.0", &move |b| put_u32(b, q_ty, 0));
    raw("type_f16_to_q8_0", "blk.0", &move |b| put_u32(b, q_ty, 8));
    raw("type_unknown", "", &move |b| put_u32(b, q_ty, 999));
    let (_, _, n_ty, _) = tensor_info(&bytes, "blk.0.attn_q_norm.weight");
    raw("type_f32_to_f16", "blk.0", &move |b| put_u32(b, n_ty, 1));
    let (_, q_dim, _, _) = tensor_info(&bytes, "blk.0.attn_q.weight");
    // (64, 128) stored as (128, 64): the same bytes, the wrong shape.
    raw("dims_swapped", "q_proj", &move |b| {
        b[q_dim..q_dim + 8].copy_from_slice(&128u64.to_le_bytes());
        b[q_dim + 8..q_dim + 16].copy_from_slice(&64u64.to_le_bytes());
    });
    raw("dims_halved", "blk.0", &move |b| {
        b[q_dim..q_dim + 8].copy_from_slice(&32u64.to_le_bytes())
    });
    raw("dims_huge", "blk.0", &move |b| {
        b[q_dim..q_dim + 8].copy_from_slice(&(1u64 << 62).to_le_bytes())
    });
    let (n_dims, _, _, _) = tensor_info(&bytes, "blk.0.attn_q.weight");
    raw("n_dims9", "", &move |b| put_u32(b, n_dims, 9));
    let duplicate = |b: &mut Vec<u8>| {
        // Two tensors named blk.0.attn_q.weight: the second one's name was blk.1's.
        let from = b"blk.1.attn_q.weight";
        let at = b.windows(from.len()).position(|w| w == from).unwrap();
        b[at + 4] = b'0';
    };
    raw("duplicate_name", "", &duplicate);
    raw("renamed", "blk.0.attn_q.weight", &|b| {
        let from = b"blk.0.attn_q.weight";
        let at = b.windows(from.len()).position(|w| w == from).unwrap();
        b[at + 10] = b'x';
    });

    assert!(cases.len() >= 40, "{} cases", cases.len());
    let mut failures = Vec::new();
    for (name, path, want) in &cases {
        match load(path) {
            Ok(()) => failures.push(format!("{name}: loaded without an error")),
            Err(e) => {
                let first = e.lines().next().unwrap_or("");
                println!("{name:24} {first}");
                if !e.contains(want) {
                    failures.push(format!("{name}: the error does not name `{want}`: {e}"));
                }
            }
        }
    }
    println!(
        "{} broken files: {} failed as they should",
        cases.len(),
        cases.len() - failures.len()
    );
    assert!(failures.is_empty(), "{failures:#?}");
}
