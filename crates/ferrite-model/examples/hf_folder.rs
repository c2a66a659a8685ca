//! Writes a Hugging Face model folder without weights: a config.json shape with a GGUF's
//! tokenizer (tokenizer.json, tokenizer_config.json with the chat template, and the
//! vocabulary size and BOS/EOS ids set in config.json). Two servers started on it with random
//! weights (ferrite's `--load-format dummy`, transformers' `from_config`) then tokenize and
//! detokenize the same way, so a served benchmark can drive both with the same prompts.
//! Usage: cargo run --release -p ferrite-model --example hf_folder -- MODEL.gguf CONFIG.json OUT_DIR

use anyhow::{bail, Context, Result};
use ferrite_model::tokenizer::ModelTokenizer;
use ferrite_model::weights::gguf::GgufFile;
use serde_json::{json, Value};
use std::path::Path;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [gguf, config, out] = args.as_slice() else {
        bail!("usage: hf_folder MODEL.gguf CONFIG.json OUT_DIR");
    };
    let tok = ModelTokenizer::load(&GgufFile::open(Path::new(gguf))?)?;
    let out = Path::new(out);
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(config)?)?;
    let eos = tok.eos_token_ids.first().copied();
    cfg["vocab_size"] = json!(tok.tokenizer.get_vocab_size(true));
    cfg["bos_token_id"] = json!(tok.bos_token_id);
    cfg["eos_token_id"] = json!(eos);
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
    tok.tokenizer
        .save(out.join("tokenizer.json"), false)
        .map_err(|e| anyhow::anyhow!("writing tokenizer.json: {e}"))?;
    let text = |id: Option<u32>| id.map(|i| tok.token_text(i));
    let tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tok.chat_template,
        "bos_token": text(tok.bos_token_id),
        "eos_token": text(eos),
        "add_bos_token": tok.add_bos,
    });
    std::fs::write(
        out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tokenizer_config)?,
    )?;
    println!(
        "{}: vocabulary {}",
        out.display(),
        tok.tokenizer.get_vocab_size(true)
    );
    Ok(())
}
