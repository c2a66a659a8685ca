//! A model's hyper-parameters under Hugging Face `config.json` names, whether they come from
//! a `config.json` or from GGUF metadata: the GGUF key map is written once, here, so the
//! families read one vocabulary.

use crate::weights::gguf::GgufFile;
use anyhow::{anyhow, bail, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

pub enum ConfigSource {
    Gguf {
        arch: String,
        meta: Box<GgufMeta>,
        path: PathBuf,
    },
    Hf {
        json: Value,
        path: PathBuf,
    },
}

/// The GGUF values a config reads, copied out of the file so the source outlives it.
pub struct GgufMeta {
    values: std::collections::HashMap<String, Value>,
}

/// `config.json` key -> GGUF key after `{arch}.` (llama.cpp's converter names).
const GGUF_KEYS: &[(&str, &str)] = &[
    ("hidden_size", "embedding_length"),
    ("num_hidden_layers", "block_count"),
    ("intermediate_size", "feed_forward_length"),
    ("num_attention_heads", "attention.head_count"),
    ("num_key_value_heads", "attention.head_count_kv"),
    ("head_dim", "attention.key_length"),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    ("rope_theta", "rope.freq_base"),
    ("max_position_embeddings", "context_length"),
    ("sliding_window", "attention.sliding_window"),
    ("attn_logit_softcapping", "attn_logit_softcapping"),
    ("final_logit_softcapping", "final_logit_softcapping"),
    ("rope_dim", "rope.dimension_count"),
    ("vocab_size", "vocab_size"),
    ("num_experts", "expert_count"),
    ("num_experts_per_tok", "expert_used_count"),
    ("moe_intermediate_size", "expert_feed_forward_length"),
    (
        "shared_expert_intermediate_size",
        "expert_shared_feed_forward_length",
    ),
    ("norm_topk_prob", "expert_weights_norm"),
    // rope_scaling, flattened: `rope_scaling.factor` etc.
    ("rope_scaling.rope_type", "rope.scaling.type"),
    ("rope_scaling.factor", "rope.scaling.factor"),
    (
        "rope_scaling.original_max_position_embeddings",
        "rope.scaling.original_context_length",
    ),
];

fn gguf_value(v: &candle_core::quantized::gguf_file::Value) -> Option<Value> {
    use candle_core::quantized::gguf_file::Value as G;
    Some(match v {
        G::U8(x) => Value::from(*x),
        G::I8(x) => Value::from(*x),
        G::U16(x) => Value::from(*x),
        G::I16(x) => Value::from(*x),
        G::U32(x) => Value::from(*x),
        G::I32(x) => Value::from(*x),
        G::U64(x) => Value::from(*x),
        G::I64(x) => Value::from(*x),
        // JSON has no NaN or infinity: kept as text, so a broken value is seen, not defaulted.
        G::F32(x) if !x.is_finite() => Value::from(x.to_string()),
        G::F64(x) if !x.is_finite() => Value::from(x.to_string()),
        G::F32(x) => Value::from(*x as f64),
        G::F64(x) => Value::from(*x),
        G::Bool(x) => Value::from(*x),
        G::String(x) => Value::from(x.clone()),
        G::Array(_) => return None,
    })
}

impl ConfigSource {
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = g.string("general.architecture")?;
        let prefix = format!("{arch}.");
        let values = g
            .content
            .metadata
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(&prefix)?.to_string(), gguf_value(v)?)))
            .collect();
        let mut meta = GgufMeta { values };
        if !meta.values.contains_key("vocab_size") {
            if let Ok(t) = g.string_array("tokenizer.ggml.tokens") {
                meta.values
                    .insert("vocab_size".into(), Value::from(t.len()));
            }
        }
        Ok(Self::Gguf {
            arch,
            meta: Box::new(meta),
            path: g.path.clone(),
        })
    }

    /// A `config.json` (the path of the file).
    pub fn from_hf(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow!("reading {}: {e}", path.display()))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| anyhow!("{} is not JSON: {e}", path.display()))?;
        super::supported::check_hf_config(&json, path)?;
        // Multimodal checkpoints nest the language model's config.
        let json = match json.get("text_config") {
            Some(t) if t.get("hidden_size").is_some() => {
                let mut t = t.clone();
                if t.get("model_type").is_none() {
                    t["model_type"] = json["model_type"].clone();
                }
                t
            }
            _ => json,
        };
        Ok(Self::Hf {
            json,
            path: path.to_path_buf(),
        })
    }

    pub fn is_gguf(&self) -> bool {
        matches!(self, Self::Gguf { .. })
    }

    /// The architecture: GGUF `general.architecture` or `model_type`.
    pub fn architecture(&self) -> &str {
        match self {
            Self::Gguf { arch, .. } => arch,
            Self::Hf { json, .. } => json.get("model_type").and_then(Value::as_str).unwrap_or(""),
        }
    }

    pub fn path(&self) -> &Path {
        match self {
            Self::Gguf { path, .. } | Self::Hf { path, .. } => path,
        }
    }

    /// A value by its `config.json` name (`a.b` reaches into objects).
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Self::Gguf { meta, .. } => {
                let (_, g) = GGUF_KEYS.iter().find(|(hf, _)| *hf == key)?;
                meta.values.get(*g)
            }
            Self::Hf { json, .. } => key
                .split('.')
                .try_fold(json, |v, k| v.get(k))
                .filter(|v| !v.is_null()),
        }
    }

    pub fn opt_usize(&self, key: &str) -> Option<usize> {
        self.get(key).and_then(Value::as_u64).map(|v| v as usize)
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key).ok_or_else(|| {
            let stored = match self {
                Self::Gguf { .. } => GGUF_KEYS
                    .iter()
                    .find(|(hf, _)| *hf == key)
                    .map(|(_, g)| format!(" (GGUF `{}.{g}`)", self.architecture())),
                Self::Hf { .. } => None,
            };
            anyhow!(
                "{} has no integer `{key}`{}",
                self.path().display(),
                stored.unwrap_or_default()
            )
        })
    }

    pub fn opt_f32(&self, key: &str) -> Option<f32> {
        let v = self.get(key)?;
        v.as_f64()
            .map(|v| v as f32)
            .or_else(|| v.as_str()?.parse().ok())
    }

    pub fn opt_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(Value::as_bool)
    }

    pub fn opt_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// `bail!`s naming the file.
    pub fn unsupported(&self, what: &str) -> anyhow::Error {
        anyhow!("{}: {what}", self.path().display())
    }

    /// Checks a divisibility the attention layout needs.
    pub fn check_heads(&self, heads: usize, kv_heads: usize) -> Result<()> {
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            bail!("{heads} attention heads are not a multiple of {kv_heads} KV heads");
        }
        Ok(())
    }
}
