//! Model ids as vLLM and llama.cpp take them: `org/name` (a Hugging Face repository, read
//! from the local Hugging Face cache: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`, layout `models--org--name/snapshots/<commit>`), and
//! `org/name:Q4_K_M` for one GGUF file of a repository (llama.cpp's `-hf`). What the cache
//! lacks is downloaded ([`super::download`]) unless `HF_HUB_OFFLINE` is set.

use super::download;
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

/// The Hugging Face cache folder this process reads.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("HF_HUB_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(h) = std::env::var_os("HF_HOME") {
        return PathBuf::from(h).join("hub");
    }
    let home = std::env::var_os("HOME").map_or(PathBuf::from("."), PathBuf::from);
    home.join(".cache/huggingface/hub")
}

/// `HF_HUB_OFFLINE` as huggingface_hub reads it.
pub fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "on" | "yes" | "true"
        )
    })
}

/// `org/name[:quant]` split, when `model` looks like a repository id and not a path.
fn repo_id(model: &str) -> Option<(&str, Option<&str>)> {
    let (id, quant) = match model.split_once(':') {
        Some((id, q)) => (id, Some(q)),
        None => (model, None),
    };
    let (org, name) = id.split_once('/')?;
    let plain = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    (plain(org) && plain(name)).then_some((id, quant))
}

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

/// Files of a snapshot folder, as paths relative to it.
fn snapshot_files(snapshot: &Path) -> Vec<String> {
    let mut files = Vec::new();
    let mut dirs = vec![snapshot.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if let Ok(rel) = p.strip_prefix(snapshot) {
                files.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    files
}

/// `model` as a file or folder to load: itself when it exists, else a repository id looked
/// up at `revision` (a branch, tag or commit; default `main`) in the Hugging Face cache, or
/// in `cache` (vLLM's `--download-dir`, a folder of the same layout) when given; what is not
/// there is downloaded into it, unless `HF_HUB_OFFLINE` is set.
pub fn resolve(model: &Path, revision: Option<&str>, cache: Option<&Path>) -> Result<PathBuf> {
    if model.exists() {
        return Ok(model.to_path_buf());
    }
    let text = model.to_string_lossy();
    let Some((id, quant)) = repo_id(&text) else {
        bail!("cannot open {}: no such file or directory", model.display());
    };
    let cache = cache.map_or_else(cache_dir, Path::to_path_buf);
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let revision = revision.unwrap_or("main");
    let commit = std::fs::read_to_string(repo.join("refs").join(revision))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| revision.to_string());
    let snapshot = repo.join("snapshots").join(&commit);
    let cached = snapshot
        .is_dir()
        .then(|| pick(id, &snapshot_files(&snapshot), quant));
    match cached {
        Some(Ok(Pick::Gguf(f))) => Ok(snapshot.join(f)),
        Some(Ok(Pick::Folder(_))) => Ok(snapshot),
        Some(Err(e)) if offline() => Err(e.context(format!(
            "in the Hugging Face cache at {} (HF_HUB_OFFLINE is set: nothing is downloaded)",
            snapshot.display()
        ))),
        None if offline() => bail!(
            "`{id}` (revision {revision}) is not in the Hugging Face cache at {} and \
             HF_HUB_OFFLINE is set: unset it to download the model, or fetch it with \
             `huggingface-cli download {id} --cache-dir {}` where the hub can be reached, or \
             pass a file or folder",
            cache.display(),
            cache.display()
        ),
        _ => download::fetch(id, quant, revision, &cache),
    }
}
