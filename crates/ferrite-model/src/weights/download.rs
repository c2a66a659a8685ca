//! Downloads from the Hugging Face hub (`HF_ENDPOINT`, `HF_TOKEN`) into the cache layout
//! [`super::hub`] reads, through the hf-hub crate: a progress bar per file on a terminal, a
//! log line per file otherwise; files already in the snapshot are not fetched again.

use super::pick::{pick, Pick};
use anyhow::{anyhow, Error, Result};
use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

fn endpoint() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|e| !e.trim().is_empty())
        .map_or(DEFAULT_ENDPOINT.into(), |e| {
            e.trim().trim_end_matches('/').into()
        })
}

/// Downloads what `quant` picks of repository `id` at `revision` into `cache`; returns the
/// GGUF file or the snapshot folder.
pub fn fetch(id: &str, quant: Option<&str>, revision: &str, cache: &Path) -> Result<PathBuf> {
    let endpoint = endpoint();
    let hub = Hub {
        id,
        revision,
        endpoint: &endpoint,
    };
    let mut builder = ApiBuilder::from_cache(Cache::new(cache.to_path_buf()))
        .with_endpoint(endpoint.clone())
        .with_progress(false)
        .with_retries(2);
    if let Some(token) = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()) {
        builder = builder.with_token(Some(token));
    }
    let api = builder.build().map_err(|e| hub.explain(e))?;
    let repo = Repo::with_revision(id.into(), RepoType::Model, revision.into());
    let remote = api.repo(repo.clone());
    let info = remote.info().map_err(|e| hub.explain(e))?;
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let chosen = pick(id, &files, quant)?;
    let names = match &chosen {
        Pick::Folder(f) => f.clone(),
        Pick::Gguf(g) => vec![g.clone()],
    };
    tracing::info!(
        "downloading {id} (revision {revision}, commit {}) from {endpoint} into {}: {}",
        info.sha,
        cache.display(),
        names.join(", ")
    );
    let local = Cache::new(cache.to_path_buf()).repo(repo);
    for name in &names {
        if local.get(name).is_none() {
            remote
                .download_with_progress(name, FileBar::new())
                .map_err(|e| hub.explain(e).context(format!("downloading {name}")))?;
        }
    }
    let snapshot = cache
        .join(format!("models--{}", id.replace('/', "--")))
        .join("snapshots")
        .join(&info.sha);
    Ok(match chosen {
        Pick::Gguf(g) => snapshot.join(g),
        Pick::Folder(_) => snapshot,
    })
}

struct Hub<'a> {
    id: &'a str,
    revision: &'a str,
    endpoint: &'a str,
}

impl Hub<'_> {
    /// The hub's answer as what it means and what to do.
    fn explain(&self, e: ApiError) -> Error {
        let Hub {
            id,
            revision,
            endpoint,
        } = self;
        match e {
            ApiError::RequestError(r) => match *r {
                ureq::Error::Status(401 | 403, _) => anyhow!(
                    "`{id}` cannot be read from {endpoint}: it does not exist, or it is gated or \
                     private; check the id, accept the model's licence on its page and set \
                     HF_TOKEN to a token that may read it"
                ),
                ureq::Error::Status(404, _) => anyhow!(
                    "`{id}` (revision {revision}) was not found at {endpoint}; check the id and \
                     --revision"
                ),
                ureq::Error::Status(code, _) => {
                    anyhow!("{endpoint} answered HTTP {code} for `{id}`; try again later")
                }
                ureq::Error::Transport(t) => anyhow!(
                    "cannot reach {endpoint} to download `{id}` ({t}); where the hub cannot be \
                     reached, fetch the model elsewhere (`huggingface-cli download {id}`), copy \
                     the cache here and set HF_HUB_OFFLINE=1, or set HF_ENDPOINT to a mirror"
                ),
            },
            e => anyhow!("downloading `{id}` from {endpoint}: {e}"),
        }
    }
}

/// One file's download: a bar on a terminal (indicatif hides it elsewhere), a log line at
/// the end.
struct FileBar {
    bar: ProgressBar,
    name: String,
    size: usize,
}

impl FileBar {
    fn new() -> Self {
        let bar = ProgressBar::new(0).with_style(
            ProgressStyle::with_template(
                "downloading {msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        Self {
            bar,
            name: String::new(),
            size: 0,
        }
    }
}

impl hf_hub::api::Progress for FileBar {
    fn init(&mut self, size: usize, filename: &str) {
        self.bar.set_length(size as u64);
        self.bar.set_position(0);
        self.bar.set_message(filename.to_string());
        self.name = filename.into();
        self.size = size;
    }

    fn update(&mut self, bytes: usize) {
        self.bar.inc(bytes as u64);
    }

    fn finish(&mut self) {
        self.bar.finish_and_clear();
        tracing::info!(
            "downloaded {} ({:.1} MiB)",
            self.name,
            self.size as f64 / (1 << 20) as f64
        );
    }
}
