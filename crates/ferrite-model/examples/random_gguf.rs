//! Writes a Llama GGUF with the shape of a Hugging Face config.json, random F16 weights and the
//! tokenizer of another GGUF: the model llama.cpp serves in the GPU peer benchmark
//! (`scripts/cuda/serve-peer.sh llamacpp`), the same shape and vocabulary as the folder ferrite
//! and transformers serve there with random weights (`examples/hf_folder.rs`).
//! With `q4_0` or `q4_1` the matrices are blocks of that format instead (ferrite's quantized
//! GGUF path on the GPU).
//! Usage: cargo run --release -p ferrite-model --example random_gguf -- TOKENIZER.gguf CONFIG.json OUT.gguf [q4_0|q4_1]

use anyhow::{bail, Context, Result};
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use half::f16;
use rand::{Rng, SeedableRng};
use std::fs::File;
use std::io::BufWriter;

/// Blocks of values drawn once and reused round-robin from a per-tensor offset: a benchmark
/// needs the bytes, not fresh randomness for each of billions of weights.
struct Pool {
    dtype: GgmlDType,
    bytes: Vec<u8>,
}

impl Pool {
    fn new(dtype: GgmlDType) -> Result<Self> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let values: Vec<f32> = (0..1 << 24)
            .map(|_| rng.random_range(-0.03f32..0.03))
            .collect();
        let bytes = match dtype {
            GgmlDType::F16 => values
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
            _ => {
                let t = candle_core::Tensor::from_vec(values, (1 << 14, 1 << 10), &Device::Cpu)?;
                QTensor::quantize(&t, dtype)?.data()?.into_owned()
            }
        };
        Ok(Self { dtype, bytes })
    }

    fn matrix(&self, rows: usize, cols: usize, offset: usize) -> Result<QTensor> {
        let block = self.dtype.type_size();
        let (have, want) = (
            self.bytes.len() / block,
            rows * cols / self.dtype.block_size(),
        );
        let bytes: Vec<u8> = (0..want)
            .flat_map(|b| {
                let at = (b + offset) % have * block;
                self.bytes[at..at + block].iter().copied()
            })
            .collect();
        Ok(qtensor_from_ggml(
            self.dtype,
            &bytes,
            vec![rows, cols],
            &Device::Cpu,
        )?)
    }
}

fn ones(n: usize) -> Result<QTensor> {
    let bytes: Vec<u8> = (0..n).flat_map(|_| 1f32.to_le_bytes()).collect();
    Ok(qtensor_from_ggml(
        GgmlDType::F32,
        &bytes,
        vec![n],
        &Device::Cpu,
    )?)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (tokenizer, config, output, dtype) = match args.as_slice() {
        [t, c, o] => (t, c, o, GgmlDType::F16),
        [t, c, o, q] if q == "q4_0" => (t, c, o, GgmlDType::Q4_0),
        [t, c, o, q] if q == "q4_1" => (t, c, o, GgmlDType::Q4_1),
        _ => bail!("usage: random_gguf TOKENIZER.gguf CONFIG.json OUT.gguf [q4_0|q4_1]"),
    };
    let mut reader = File::open(tokenizer).with_context(|| format!("opening {tokenizer}"))?;
    let content = gguf_file::Content::read(&mut reader)?;
    let vocab = match &content.metadata["tokenizer.ggml.tokens"] {
        Value::Array(tokens) => tokens.len(),
        _ => bail!("{tokenizer}: no tokenizer.ggml.tokens"),
    };
    let c = ferrite_model::checkpoint::read_config(std::path::Path::new(config))?;
    let (h, layers) = (c.hidden_size, c.num_layers);
    let u32v = |v: usize| Value::U32(v as u32);
    let own = [
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("random".into())),
        // llama.cpp's file types: 1 mostly F16, 2 mostly Q4_0, 3 mostly Q4_1.
        (
            "general.file_type",
            Value::U32(match dtype {
                GgmlDType::Q4_0 => 2,
                GgmlDType::Q4_1 => 3,
                _ => 1,
            }),
        ),
        // The server sizes its context with -c; this only has to be at least that.
        ("llama.context_length", Value::U32(131072)),
        ("llama.embedding_length", u32v(h)),
        ("llama.block_count", u32v(layers)),
        ("llama.feed_forward_length", u32v(c.intermediate_size)),
        ("llama.rope.dimension_count", u32v(c.head_dim)),
        ("llama.attention.head_count", u32v(c.num_heads)),
        ("llama.attention.head_count_kv", u32v(c.num_kv_heads)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(c.rms_norm_eps),
        ),
        ("llama.rope.freq_base", Value::F32(c.rope_theta)),
        ("llama.vocab_size", u32v(vocab)),
    ];
    let mut metadata: Vec<(&str, &Value)> = own.iter().map(|(k, v)| (*k, v)).collect();
    metadata.extend(
        content
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .map(|(k, v)| (k.as_str(), v)),
    );
    let pool = Pool::new(dtype)?;
    let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let mut tensors: Vec<(String, QTensor)> = vec![
        ("token_embd.weight".into(), pool.matrix(vocab, h, 0)?),
        ("output.weight".into(), pool.matrix(vocab, h, 1)?),
        ("output_norm.weight".into(), ones(h)?),
    ];
    for i in 0..layers {
        let shapes = [
            ("attn_q", q, h),
            ("attn_k", kv, h),
            ("attn_v", kv, h),
            ("attn_output", h, q),
            ("ffn_gate", c.intermediate_size, h),
            ("ffn_up", c.intermediate_size, h),
            ("ffn_down", h, c.intermediate_size),
        ];
        for (j, (name, rows, cols)) in shapes.into_iter().enumerate() {
            let t = pool.matrix(rows, cols, 7919 * (i * 7 + j))?;
            tensors.push((format!("blk.{i}.{name}.weight"), t));
        }
        tensors.push((format!("blk.{i}.attn_norm.weight"), ones(h)?));
        tensors.push((format!("blk.{i}.ffn_norm.weight"), ones(h)?));
    }
    let pairs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut w = BufWriter::new(File::create(output)?);
    gguf_file::write(&mut w, &metadata, &pairs)?;
    println!(
        "{output}: {layers} layers, hidden {h}, vocabulary {vocab}, {} tensors, {dtype:?} matrices",
        pairs.len()
    );
    Ok(())
}
