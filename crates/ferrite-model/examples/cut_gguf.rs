//! Writes a copy of a Llama-family GGUF keeping only its first N layers: a real model small
//! enough to travel to a GPU host for the cross-backend check (`scripts/cuda/check.sh`), or
//! a draft model for speculation (`docs/benchmarks/cpu-speculative.md`).
//! Usage: cargo run --release -p ferrite-model --example cut_gguf -- IN.gguf OUT.gguf N [q4_0]
//! With `q4_0`, the token embedding (the tied LM head too) is re-quantized to Q4_0.

use anyhow::{bail, Context, Result};
use std::path::Path;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (input, output, layers, requant) = match args.as_slice() {
        [i, o, l] => (i, o, l, false),
        [i, o, l, q] if q == "q4_0" => (i, o, l, true),
        _ => bail!("usage: cut_gguf IN.gguf OUT.gguf LAYERS [q4_0]"),
    };
    let keep: u32 = layers.parse().context("LAYERS")?;
    let n = ferrite_model::weights::cut::first_layers(
        Path::new(input),
        Path::new(output),
        keep,
        requant,
    )?;
    println!("{output}: {n} tensors, {keep} layers");
    Ok(())
}
