//! Model ids as vLLM and llama.cpp take them: `org/name` (a Hugging Face repository, read
//! from the local Hugging Face cache: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`, layout `models--org--name/snapshots/<commit>`), and
//! `org/name:Q4_K_M` for one GGUF file of a repository (llama.cpp's `-hf`).

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

/// `model` as a file or folder to load: itself when it exists, else a repository id looked
/// up at `revision` (a branch, tag or commit; default `main`) in the Hugging Face cache, or
/// in `cache` (vLLM's `--download-dir`, a folder of the same layout) when given.
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
    if !snapshot.is_dir() {
        bail!(
            "`{id}` (revision {revision}) is not in the Hugging Face cache at {}: ferrite reads \
             models from the cache and does not download them; fetch it with \
             `huggingface-cli download {id} --cache-dir {}` (or `hf download`), or pass a file \
             or folder",
            cache.display(),
            cache.display()
        );
    }
    let ggufs: Vec<PathBuf> = std::fs::read_dir(&snapshot)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    match quant {
        Some(q) => {
            let q = q.to_ascii_lowercase();
            let mut hits: Vec<&PathBuf> = ggufs
                .iter()
                .filter(|p| p.to_string_lossy().to_ascii_lowercase().contains(&q))
                .collect();
            hits.sort();
            match hits.as_slice() {
                [one] => Ok(one.to_path_buf()),
                [] => bail!(
                    "`{id}` has no GGUF file matching `{q}` in {} (it has: {})",
                    snapshot.display(),
                    names(&ggufs)
                ),
                many => bail!(
                    "`{id}:{q}` matches several GGUF files: {}",
                    names(&many.iter().map(|p| p.to_path_buf()).collect::<Vec<_>>())
                ),
            }
        }
        None if snapshot.join("config.json").exists() => Ok(snapshot),
        None => match ggufs.as_slice() {
            [one] => Ok(one.clone()),
            [] => bail!(
                "`{id}` in {} has neither config.json nor a GGUF file",
                snapshot.display()
            ),
            _ => bail!(
                "`{id}` holds several GGUF files ({}): name one, as `{id}:Q4_K_M`",
                names(&ggufs)
            ),
        },
    }
}

fn names(paths: &[PathBuf]) -> String {
    let mut n: Vec<String> = paths
        .iter()
        .filter_map(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
        .collect();
    n.sort();
    if n.is_empty() {
        "none".into()
    } else {
        n.join(", ")
    }
}
