//! Model hyper-parameters read from GGUF metadata, for the Llama family.

use crate::gguf::GgufFile;
use anyhow::{bail, Result};

/// How rotary embedding pairs dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): llama.cpp's converter permutes Llama Q/K weights for this.
    Interleaved,
    /// Halves (i, i + d/2): GPT-NeoX style, used as-is by Qwen2 GGUFs.
    Neox,
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
    pub context_length: usize,
    pub sliding_window: Option<usize>,
}

pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "mistral", "qwen2"];

impl ModelConfig {
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = g.string("general.architecture")?;
        if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
            bail!(
                "unsupported model architecture `{arch}` in {} (supported: {})",
                g.path.display(),
                SUPPORTED_ARCHITECTURES.join(", ")
            );
        }
        let key = |k: &str| format!("{arch}.{k}");
        let hidden_size = g.usize(&key("embedding_length"))?;
        let num_heads = g.usize(&key("attention.head_count"))?;
        let num_kv_heads = g
            .opt_u64(&key("attention.head_count_kv"))
            .map_or(num_heads, |v| v as usize);
        if num_heads % num_kv_heads != 0 {
            bail!("{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads");
        }
        let head_dim = g
            .opt_u64(&key("attention.key_length"))
            .map_or(hidden_size / num_heads, |v| v as usize);
        let vocab_size = g
            .opt_u64(&key("vocab_size"))
            .map(|v| v as usize)
            .or_else(|| {
                g.string_array("tokenizer.ggml.tokens")
                    .ok()
                    .map(|t| t.len())
            })
            .unwrap_or(0);
        Ok(Self {
            num_layers: g.usize(&key("block_count"))?,
            hidden_size,
            intermediate_size: g.usize(&key("feed_forward_length"))?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: g
                .opt_f32(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5),
            rope_theta: g.opt_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_dim: g
                .opt_u64(&key("rope.dimension_count"))
                .map_or(head_dim, |v| v as usize),
            rope_style: if arch == "qwen2" {
                RopeStyle::Neox
            } else {
                RopeStyle::Interleaved
            },
            context_length: g.usize(&key("context_length")).unwrap_or(4096),
            sliding_window: g
                .opt_u64(&key("attention.sliding_window"))
                .map(|v| v as usize),
            architecture: arch,
        })
    }

    /// From a Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3). Hugging Face
    /// checkpoints keep Q/K unpermuted, so rotary pairs are halves (NeoX style).
    pub fn from_hf_config(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        let j: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("{} is not JSON: {e}", path.display()))?;
        let num = |k: &str| j.get(k).and_then(|v| v.as_u64()).map(|v| v as usize);
        let need = |k: &str| {
            num(k).ok_or_else(|| anyhow::anyhow!("{} has no integer `{k}`", path.display()))
        };
        let model_type = j.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
        let architecture = match model_type {
            "llama" | "mistral" | "qwen2" | "qwen3" => model_type.to_string(),
            _ => bail!(
                "unsupported model_type `{model_type}` in {} (supported: llama, mistral, qwen2, qwen3)",
                path.display()
            ),
        };
        let hidden_size = need("hidden_size")?;
        let num_heads = need("num_attention_heads")?;
        let num_kv_heads = num("num_key_value_heads").unwrap_or(num_heads);
        if num_heads % num_kv_heads != 0 {
            bail!("{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads");
        }
        let head_dim = num("head_dim").unwrap_or(hidden_size / num_heads);
        let float = |k: &str| j.get(k).and_then(|v| v.as_f64()).map(|v| v as f32);
        Ok(Self {
            num_layers: need("num_hidden_layers")?,
            hidden_size,
            intermediate_size: need("intermediate_size")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: need("vocab_size")?,
            rms_norm_eps: float("rms_norm_eps").unwrap_or(1e-6),
            rope_theta: float("rope_theta").unwrap_or(10_000.0),
            rope_dim: head_dim,
            rope_style: RopeStyle::Neox,
            context_length: num("max_position_embeddings").unwrap_or(4096),
            // Qwen2 configs name a window but turn it off.
            sliding_window: num("sliding_window")
                .filter(|_| j.get("use_sliding_window").and_then(|v| v.as_bool()) != Some(false)),
            architecture,
        })
    }

    /// K and V bytes of one token across all layers, at `elem_bytes` per element.
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_bytes
    }
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
        let c = ModelConfig::from_hf_config(&path);
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
        assert!(err.contains("unsupported model_type `gpt2`"), "{err}");
        let missing = r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}"#;
        let err = parse(missing).unwrap_err().to_string();
        assert!(err.contains("no integer `num_hidden_layers`"), "{err}");
    }
}
