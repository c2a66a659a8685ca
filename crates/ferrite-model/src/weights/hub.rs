//! Model ids as vLLM and llama.cpp take them: `org/name` (a Hugging Face repository, read
//! from the local Hugging Face cache: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`, layout `models--org--name/snapshots/<commit>`), and
//! `org/name:Q4_K_M` for one GGUF file of a repository (llama.cpp's `-hf`). What the cache
//! lacks is downloaded ([`super::download`]) unless `HF_HUB_OFFLINE` is set.

use super::download;
use super::pick::{pick, Pick};
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
