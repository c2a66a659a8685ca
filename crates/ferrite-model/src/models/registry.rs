//! From a checkpoint's architecture to its family: the config it reads, its recurrent-state
//! layers, and the loaded [`Model`].

use super::family::Family;
use super::model::Model;
use super::{bert, gemma, layers, llama, qwen_hybrid};
use crate::backend::{Backend, GdnSpec};
use crate::config::ModelConfig;
use crate::weights::config_source::ConfigSource;
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use ferrite_core::kv_layout::KvLayout;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3; Mixtral, Qwen2-MoE, Qwen3-MoE.
    Llama,
    /// Gemma 2 and Gemma 3 (text).
    Gemma,
    /// Gated delta-net and gated attention: Qwen3.5 (dense and MoE), Qwen3-Next.
    Hybrid,
    /// BERT encoders (embedding models).
    Bert,
}

const ARCHITECTURES: &[(&str, Kind)] = &[
    ("llama", Kind::Llama),
    ("mistral", Kind::Llama),
    ("qwen2", Kind::Llama),
    ("qwen3", Kind::Llama),
    ("mixtral", Kind::Llama),
    ("qwen2_moe", Kind::Llama),
    ("qwen2moe", Kind::Llama),
    ("qwen3_moe", Kind::Llama),
    ("qwen3moe", Kind::Llama),
    ("gemma2", Kind::Gemma),
    ("gemma3", Kind::Gemma),
    ("gemma3_text", Kind::Gemma),
    ("qwen3_5", Kind::Hybrid),
    ("qwen3_5_text", Kind::Hybrid),
    ("qwen3_5_moe", Kind::Hybrid),
    ("qwen3_5_moe_text", Kind::Hybrid),
    ("qwen3_next", Kind::Hybrid),
    ("bert", Kind::Bert),
];

/// Whether the checkpoint is an encoder (bidirectional attention: embeddings only).
pub fn is_encoder(src: &ConfigSource) -> Result<bool> {
    Ok(kind(src)? == Kind::Bert)
}

fn kind(src: &ConfigSource) -> Result<Kind> {
    let arch = src.architecture();
    match ARCHITECTURES.iter().find(|(a, _)| *a == arch) {
        Some((_, k)) => Ok(*k),
        None => bail!(
            "unsupported model architecture `{arch}` in {} (supported: {})",
            src.path().display(),
            ARCHITECTURES
                .iter()
                .map(|(a, _)| *a)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The engine-facing configuration of a checkpoint.
pub fn config(src: &ConfigSource) -> Result<ModelConfig> {
    match kind(src)? {
        Kind::Llama => llama::config(src),
        Kind::Gemma => Ok(gemma::GemmaConfig::read(src)?.common),
        Kind::Hybrid => Ok(qwen_hybrid::HybridConfig::read(src)?.common),
        Kind::Bert => bert::config(src),
    }
}

/// The recurrent-state layers of a checkpoint's family, from its config alone (none but
/// hybrids').
pub fn state_layers(src: &ConfigSource) -> Result<Vec<GdnSpec>> {
    Ok(match kind(src)? {
        Kind::Hybrid => qwen_hybrid::HybridConfig::read(src)?.state_layers(),
        Kind::Llama | Kind::Gemma | Kind::Bert => Vec::new(),
    })
}

/// Loads the checkpoint's family onto `backend`; `progress(done, total)` follows the layers.
/// A multi-token-prediction head in the checkpoint is left unread.
pub fn load<B: Backend + 'static>(
    backend: B,
    src: &ConfigSource,
    weights: &mut WeightSource,
    max_positions: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Model<B>> {
    load_family(backend, src, weights, max_positions, false, progress)
}

/// [`load`] with the checkpoint's multi-token-prediction head (an error where it has none):
/// its weights, and its layer's K/V in every block.
pub fn load_with_mtp<B: Backend + 'static>(
    backend: B,
    src: &ConfigSource,
    weights: &mut WeightSource,
    max_positions: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Model<B>> {
    load_family(backend, src, weights, max_positions, true, progress)
}

fn load_family<B: Backend + 'static>(
    backend: B,
    src: &ConfigSource,
    weights: &mut WeightSource,
    max_positions: usize,
    mtp: bool,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Model<B>> {
    let mut config = config(src)?;
    if backend.group().is_some() {
        // The families whose forward sums their shards; the rest would load them and
        // compute wrong answers.
        if kind(src)? != Kind::Llama || mtp {
            bail!(
                "{}: `{}` is not split across ranks yet (tensor and pipeline parallelism serve the Llama family: Llama, Mistral, Qwen2, Qwen3)",
                src.path().display(),
                src.architecture()
            );
        }
    }
    let hybrid = match kind(src)? {
        Kind::Hybrid => Some(qwen_hybrid::HybridConfig::read(src)?.with_mtp(mtp, weights)?),
        _ if mtp => bail!(
            "{}: this family has no multi-token-prediction head",
            src.path().display()
        ),
        _ => None,
    };
    if let Some(h) = &hybrid {
        config.layer_windows = h.common.layer_windows.clone();
    }
    let layout = KvLayout::new(&config.layer_windows);
    let family: Box<dyn Family<B>> = match kind(src)? {
        Kind::Llama => Box::new(llama::Llama::load(
            &backend,
            llama::config(src)?,
            super::moe::MoeConfig::read(src)?,
            &layout,
            weights,
            max_positions,
            progress,
        )?),
        Kind::Gemma => Box::new(gemma::Gemma::load(
            &backend,
            gemma::GemmaConfig::read(src)?,
            &layout,
            weights,
            max_positions,
            progress,
        )?),
        Kind::Hybrid => Box::new(qwen_hybrid::Hybrid::load(
            &backend,
            hybrid.expect("a hybrid's config, read above"),
            super::moe::MoeConfig::read(src)?,
            &layout,
            weights,
            max_positions,
            progress,
        )?),
        Kind::Bert => Box::new(bert::Bert::load(
            &backend,
            bert::config(src)?,
            &layout,
            weights,
            max_positions,
            progress,
        )?),
    };
    if let Some(v) = layers::embedding_rows(weights)? {
        config.vocab_size = v;
    }
    Ok(Model::new(config, backend, family, layout, max_positions))
}
