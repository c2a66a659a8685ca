//! The hyper-parameters the engine and the families share, read through [`ConfigSource`].

use crate::weights::config_source::ConfigSource;
use anyhow::{bail, Result};

/// How rotary embedding pairs dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): llama.cpp's converter permutes Llama Q/K weights for this.
    Interleaved,
    /// Halves (i, i + d/2): GPT-NeoX style, used as-is by Qwen2 GGUFs.
    Neox,
}

/// How rotary frequencies are stretched for contexts past the trained one (`rope_scaling`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear(f32),
    /// Llama 3.1+: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_positions: usize,
    },
    /// YaRN (Qwen, DeepSeek): NTK-by-parts interpolation and an attention temperature.
    Yarn {
        factor: f32,
        original_max_positions: usize,
        beta_fast: f32,
        beta_slow: f32,
    },
    /// Per-pair divisors read from the checkpoint (GGUF `rope_freqs.weight`: llama.cpp's
    /// converter bakes Llama 3's scaling into it).
    Factors(Vec<f32>),
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub architecture: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_dim: usize,
    pub rope_style: RopeStyle,
    pub rope_scaling: RopeScaling,
    pub context_length: usize,
    pub sliding_window: Option<usize>,
    /// Per attention layer (every layer but linear-attention ones): the window it attends
    /// within, or `None` for the whole context.
    pub layer_windows: Vec<Option<usize>>,
}

impl ModelConfig {
    /// The fields every decoder shares, under their `config.json` names. Hugging Face
    /// checkpoints keep Q/K unpermuted, so their rotary pairs are halves (NeoX style);
    /// llama.cpp's converter permutes Llama's for adjacent pairs.
    pub fn common(src: &ConfigSource, interleaved_in_gguf: bool) -> Result<Self> {
        let hidden_size = src.usize("hidden_size")?;
        let num_heads = src.usize("num_attention_heads")?;
        let num_kv_heads = src.opt_usize("num_key_value_heads").unwrap_or(num_heads);
        src.check_heads(num_heads, num_kv_heads)?;
        let head_dim = src.opt_usize("head_dim").unwrap_or(hidden_size / num_heads);
        let rope_style = if src.is_gguf() && interleaved_in_gguf {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Neox
        };
        let rope_dim = src.opt_usize("rope_dim").unwrap_or(head_dim);
        let num_layers = src.usize("num_hidden_layers")?;
        let intermediate_size = src.usize("intermediate_size")?;
        let positive = [
            ("hidden_size", hidden_size),
            ("num_hidden_layers", num_layers),
            ("intermediate_size", intermediate_size),
            ("head_dim", head_dim),
            ("rope dimensions", rope_dim),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            bail!("{}: `{name}` is 0", src.path().display());
        }
        if rope_dim > head_dim || rope_dim % 2 == 1 {
            bail!(
                "{}: {rope_dim} rotary dimensions for heads of {head_dim}",
                src.path().display()
            );
        }
        let rms_norm_eps = match src.opt_f32("rms_norm_eps") {
            Some(e) if !(e.is_finite() && e >= 0.0) => {
                bail!("{}: `rms_norm_eps` is {e}", src.path().display())
            }
            Some(e) => e,
            None if src.is_gguf() => 1e-5,
            None => 1e-6,
        };
        let rope_theta = src
            .opt_f32("rope_theta")
            .or_else(|| src.opt_f32("rope_parameters.rope_theta"))
            .unwrap_or(10_000.0);
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            bail!(
                "{}: rope base `rope_theta` is {rope_theta}",
                src.path().display()
            );
        }
        let context_length = src.opt_usize("max_position_embeddings").unwrap_or(4096);
        if context_length == 0 {
            bail!("{}: `max_position_embeddings` is 0", src.path().display());
        }
        // Qwen2 configs name a window but turn it off.
        let sliding_window = src
            .opt_usize("sliding_window")
            .filter(|_| src.opt_bool("use_sliding_window") != Some(false));
        Ok(Self {
            architecture: src.architecture().to_string(),
            num_layers,
            hidden_size,
            intermediate_size,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: src.opt_usize("vocab_size").unwrap_or(0),
            rms_norm_eps,
            rope_theta,
            rope_dim,
            rope_style,
            rope_scaling: rope_scaling(src, &["rope_scaling", "rope_parameters"])?,
            context_length,
            sliding_window,
            layer_windows: vec![sliding_window; num_layers],
        })
    }

    /// K and V bytes of one token across all attention layers, at `elem_bytes` per element.
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        2 * self.layer_windows.len() * self.num_kv_heads * self.head_dim * elem_bytes
    }
}

/// The first of the objects `at` (`rope_scaling`, transformers 5's `rope_parameters`, ...)
/// that names a scaling, or GGUF's `rope.scaling.*`.
pub fn rope_scaling(src: &ConfigSource, at: &[&str]) -> Result<RopeScaling> {
    let key = |k: &str| {
        at.iter()
            .map(|p| format!("{p}.{k}"))
            .find(|k| src.get(k).is_some())
    };
    let f = |k: &str, default: f32| key(k).and_then(|k| src.opt_f32(&k)).unwrap_or(default);
    let kind = key("rope_type")
        .or_else(|| key("type"))
        .and_then(|k| src.opt_str(&k).map(str::to_string))
        .unwrap_or_default();
    let original = key("original_max_position_embeddings").and_then(|k| src.opt_usize(&k));
    let factor = f("factor", 1.0);
    if !(factor.is_finite() && factor > 0.0) {
        bail!("{}: rope scaling factor is {factor}", src.path().display());
    }
    Ok(match kind.as_str() {
        "" | "default" | "none" => RopeScaling::None,
        "linear" => RopeScaling::Linear(factor),
        "llama3" => RopeScaling::Llama3 {
            factor,
            low_freq_factor: f("low_freq_factor", 1.0),
            high_freq_factor: f("high_freq_factor", 4.0),
            original_max_positions: original.unwrap_or(8192),
        },
        "yarn" => RopeScaling::Yarn {
            factor,
            original_max_positions: original
                .or_else(|| src.opt_usize("max_position_embeddings"))
                .unwrap_or(4096),
            beta_fast: f("beta_fast", 32.0),
            beta_slow: f("beta_slow", 1.0),
        },
        other => bail!(
            "{}: rope scaling `{other}` is not supported (supported: linear, llama3, yarn)",
            src.path().display()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<ModelConfig> {
        let dir = std::env::temp_dir().join(format!("ferrite-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!(
            "{:x}.json",
            json.len() * 31 + json.as_bytes()[20] as usize
        ));
        std::fs::write(&path, json).unwrap();
        let c = crate::checkpoint::read_config(&path);
        std::fs::remove_file(&path).unwrap();
        c
    }

    #[test]
    fn reads_a_llama_3_config() {
        let c = parse(include_str!("../../../scripts/cuda/llama-3.1-8b.json")).unwrap();
        assert_eq!(
            (c.num_layers, c.hidden_size, c.intermediate_size),
            (32, 4096, 14336)
        );
        assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (32, 8, 128));
        assert_eq!((c.vocab_size, c.context_length), (128256, 131072));
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.rope_style, RopeStyle::Neox);
        assert_eq!(c.sliding_window, None);
    }

    #[test]
    fn qwen2_window_off_unless_used_and_bad_configs_named() {
        let qwen = r#"{"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "vocab_size": 151936, "sliding_window": 32768, "use_sliding_window": false}"#;
        let c = parse(qwen).unwrap();
        assert_eq!((c.head_dim, c.sliding_window), (64, None));
        let mistral = r#"{"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 32000, "sliding_window": 4096}"#;
        assert_eq!(parse(mistral).unwrap().sliding_window, Some(4096));
        let gpt = r#"{"model_type": "gpt2", "hidden_size": 768, "n_layer": 12}"#;
        let err = parse(gpt).unwrap_err().to_string();
        assert!(
            err.contains("unsupported model architecture `gpt2`"),
            "{err}"
        );
        let missing = r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}"#;
        let err = parse(missing).unwrap_err().to_string();
        assert!(err.contains("no integer `num_hidden_layers`"), "{err}");
    }
}
