//! A copy of a GGUF that keeps only its first layers: a real model of the same vocabulary,
//! smaller and faster (a draft model for speculation, or one small enough to travel to a
//! GPU host for the cross-backend check).

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

/// Writes `input`'s first `keep` layers (and everything outside the layers) to `output`;
/// with `requant_embedding` the token embedding (the tied LM head too) is re-quantized to
/// Q4_0, the largest saving left once layers are cut. Returns the tensors written.
pub fn first_layers(
    input: &Path,
    output: &Path,
    keep: u32,
    requant_embedding: bool,
) -> Result<usize> {
    let mut reader = File::open(input).with_context(|| format!("opening {}", input.display()))?;
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
            if requant_embedding && n.as_str() == "token_embd.weight" {
                QTensor::quantize(&t.dequantize(&Device::Cpu)?, GgmlDType::Q4_0)
            } else {
                Ok(t)
            }
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let pairs: Vec<(&str, &_)> = names.iter().map(|n| n.as_str()).zip(&tensors).collect();
    let mut w = BufWriter::new(
        File::create(output).with_context(|| format!("creating {}", output.display()))?,
    );
    gguf_file::write(&mut w, &metadata, &pairs)?;
    Ok(pairs.len())
}
