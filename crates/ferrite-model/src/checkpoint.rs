//! A checkpoint on disk: its configuration, weights and tokenizer, from a GGUF file or a
//! Hugging Face folder (`config.json`, `*.safetensors`, `tokenizer.json`, ...).

use crate::config::ModelConfig;
use crate::models;
use crate::settings::LoadFormat;
use crate::tokenizer::ModelTokenizer;
use crate::weights::config_source::ConfigSource;
use crate::weights::gguf::GgufFile;
use crate::weights::WeightSource;
use anyhow::Result;
use std::path::{Path, PathBuf};

/// A Hugging Face model given as its folder or its `config.json`: the config's path.
pub fn hf_config_path(model: &Path) -> PathBuf {
    if model.is_dir() {
        model.join("config.json")
    } else {
        model.to_path_buf()
    }
}

pub fn is_gguf(model: &Path) -> bool {
    model.extension().is_some_and(|e| e == "gguf")
}

/// The model's configuration source without loading it: GGUF metadata, or a Hugging Face
/// `config.json` (given, or in the given folder).
pub fn config_source(model: &Path) -> Result<ConfigSource> {
    if is_gguf(model) {
        return ConfigSource::from_gguf(&GgufFile::open(model)?);
    }
    ConfigSource::from_hf(&hf_config_path(model))
}

pub fn read_config(model: &Path) -> Result<ModelConfig> {
    let model = crate::weights::hub::resolve(model, None, None)?;
    models::config(&config_source(&model)?)
}

/// The configuration and weights of `MODEL`: a GGUF file, or a Hugging Face folder
/// (`config.json`, `*.safetensors`); with `LoadFormat::Dummy` the configuration alone.
pub fn open_weights(model: &Path, format: LoadFormat) -> Result<(ConfigSource, WeightSource)> {
    if format == LoadFormat::Dummy {
        return Ok((config_source(model)?, WeightSource::Dummy));
    }
    let (src, weights) = if is_gguf(model) {
        let gguf = GgufFile::open(model)?;
        (ConfigSource::from_gguf(&gguf)?, WeightSource::gguf(gguf)?)
    } else {
        let path = hf_config_path(model);
        let dir = path.parent().unwrap_or(Path::new("."));
        (
            ConfigSource::from_hf(&path)?,
            WeightSource::safetensors(dir)?,
        )
    };
    check_extent(&src, &weights)?;
    Ok((src, weights))
}

/// Each layer has tensors, and every size is some tensor's dimension: a config the file cannot
/// hold (a corrupted layer count, a width of 2^40) is refused before it sizes anything.
pub fn check_extent(src: &ConfigSource, weights: &WeightSource) -> Result<()> {
    let Some((count, largest)) = weights.extent() else {
        return Ok(());
    };
    if let Some(layers) = src.opt_usize("num_hidden_layers") {
        anyhow::ensure!(
            layers <= count,
            "{}: {layers} layers in a file of {count} tensors",
            src.path().display()
        );
    }
    for key in [
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "head_dim",
    ] {
        if let Some(v) = src.opt_usize(key) {
            anyhow::ensure!(
                v <= largest,
                "{}: `{key}` is {v}, larger than any tensor dimension ({largest})",
                src.path().display()
            );
        }
    }
    Ok(())
}

/// The tokenizer of `MODEL`: GGUF metadata, or `tokenizer.json` and its companions.
pub fn open_tokenizer(model: &Path) -> Result<ModelTokenizer> {
    if is_gguf(model) {
        return ModelTokenizer::load(&GgufFile::open(model)?);
    }
    let config = read_config(model)?;
    ModelTokenizer::for_config(&hf_config_path(model), config.vocab_size)
}
