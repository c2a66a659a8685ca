//! Writes a copy of a Llama-family GGUF keeping only its first N layers: a real model small
//! enough to travel to a GPU host for the cross-backend check (`scripts/cuda/check.sh`).
//! Usage: cargo run --release -p ferrite-model --example cut_gguf -- IN.gguf OUT.gguf N [q4_0]
//! With `q4_0`, the token embedding (the tied LM head too) is re-quantized to Q4_0, the
//! largest saving left once layers are cut.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use std::fs::File;
use std::io::BufWriter;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (input, output, layers, requant) = match args.as_slice() {
        [i, o, l] => (i, o, l, false),
        [i, o, l, q] if q == "q4_0" => (i, o, l, true),
        _ => bail!("usage: cut_gguf IN.gguf OUT.gguf LAYERS [q4_0]"),
    };
    let keep: u32 = layers.parse().context("LAYERS")?;
    let mut reader = File::open(input).with_context(|| format!("opening {input}"))?;
    let content = gguf_file::Content::read(&mut reader)?;
    let arch = content.metadata["general.architecture"]
        .to_string()?
        .clone();
    let block_count = format!("{arch}.block_count");
    let kept = Value::U32(keep);
    let mut metadata: Vec<(&str, &Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), if *k == block_count { &kept } else { v }))
        .collect();
    metadata.sort_by_key(|(k, _)| *k);
    let mut names: Vec<&String> = content
        .tensor_infos
        .keys()
        .filter(|n| {
            n.strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .and_then(|i| i.parse::<u32>().ok())
                .is_none_or(|i| i < keep)
        })
        .collect();
    names.sort();
    let tensors = names
        .iter()
        .map(|n| {
            let t = content.tensor(&mut reader, n, &Device::Cpu)?;
            if requant && n.as_str() == "token_embd.weight" {
                QTensor::quantize(&t.dequantize(&Device::Cpu)?, GgmlDType::Q4_0)
            } else {
                Ok(t)
            }
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let pairs: Vec<(&str, &_)> = names.iter().map(|n| n.as_str()).zip(&tensors).collect();
    let mut w = BufWriter::new(File::create(output)?);
    gguf_file::write(&mut w, &metadata, &pairs)?;
    println!("{output}: {} tensors, {keep} layers", pairs.len());
    Ok(())
}
