//! Which files of a Hugging Face repository a model id loads.

use anyhow::{bail, Result};

/// What of a repository is loaded.
#[derive(Debug, PartialEq)]
pub enum Pick {
    /// A Hugging Face folder (config.json): these of its files.
    Folder(Vec<String>),
    /// One GGUF file.
    Gguf(String),
}

/// Files a folder checkpoint is loaded from: config, tokenizer, safetensors, and the
/// sentence-transformers description of an embedding model.
fn folder_file(name: &str) -> bool {
    const NAMED: &[&str] = &[
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "chat_template.json",
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
        "1_Pooling/config.json",
    ];
    NAMED.contains(&name) || (!name.contains('/') && name.contains(".safetensors"))
}

/// Chooses from a repository's `files`: the GGUF whose name holds `quant`, else the folder
/// when it has config.json, else its one GGUF file.
pub fn pick(id: &str, files: &[String], quant: Option<&str>) -> Result<Pick> {
    let mut ggufs: Vec<&String> = files.iter().filter(|f| f.ends_with(".gguf")).collect();
    ggufs.sort();
    let listed = |fs: &[&String]| match fs {
        [] => "none".to_string(),
        fs => fs.iter().map(|f| f.as_str()).collect::<Vec<_>>().join(", "),
    };
    match quant {
        Some(q) => {
            let q = q.to_ascii_lowercase();
            let hits: Vec<&String> = ggufs
                .iter()
                .copied()
                .filter(|f| f.to_ascii_lowercase().contains(&q))
                .collect();
            match hits.as_slice() {
                [one] => Ok(Pick::Gguf(one.to_string())),
                [] => bail!(
                    "`{id}` has no GGUF file matching `{q}` (it has: {})",
                    listed(&ggufs)
                ),
                many => bail!("`{id}:{q}` matches several GGUF files: {}", listed(many)),
            }
        }
        None if files.iter().any(|f| f == "config.json") => Ok(Pick::Folder(
            files.iter().filter(|f| folder_file(f)).cloned().collect(),
        )),
        None => match ggufs.as_slice() {
            [one] => Ok(Pick::Gguf(one.to_string())),
            [] => bail!("`{id}` has neither config.json nor a GGUF file"),
            many => bail!(
                "`{id}` holds several GGUF files ({}): name one, as `{id}:Q4_K_M`",
                listed(many)
            ),
        },
    }
}
