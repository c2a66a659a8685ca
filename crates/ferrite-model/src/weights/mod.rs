//! Host tensors under Hugging Face names, from a GGUF file or a folder of safetensors. The
//! GGUF name map is written once, here; families ask for `model.layers.3.mlp.up_proj.weight`
//! whatever the file.

pub mod config_source;
pub mod cut;
pub mod download;
pub mod experts;
pub mod footprint;
pub mod gguf;
pub mod hub;
pub mod pick;
pub mod shard;
pub mod supported;

use anyhow::{anyhow, bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use gguf::GgufFile;
use std::path::{Path, PathBuf};

pub enum WeightSource {
    /// GGUF tensors, quantized blocks as stored; `arch` picks the name map.
    Gguf { file: Box<GgufFile>, arch: String },
    Safetensors {
        files: MmapedSafetensors,
        dir: PathBuf,
        /// The language model is stored under `model.language_model.` (multimodal
        /// checkpoints: Qwen3.5, Gemma 3); families ask for `model.`.
        language_model: bool,
    },
    /// No file (`--load-format dummy`): the families draw random weights of the config's
    /// shapes on the backend, ones for norms.
    Dummy,
}

/// GGUF name of a Hugging Face tensor name (llama.cpp's converter's map).
pub(crate) fn gguf_name(arch: &str, name: &str) -> Option<String> {
    let top = match name {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        "rope_freqs" => Some("rope_freqs.weight"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.to_string());
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    if part == "self_attn.sinks" {
        return Some(format!("blk.{layer}.attn_sinks.weight"));
    }
    // Gemma's `post_attention_layernorm` follows attention; Llama's precedes the MLP.
    let gemma = arch.starts_with("gemma");
    let (stem, kind) = part.rsplit_once('.')?;
    let g = match stem {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" if gemma => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        // Mixture-of-experts routers (Mixtral's block is `block_sparse_moe`) and shared experts.
        "mlp.gate" | "block_sparse_moe.gate" => "ffn_gate_inp",
        "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" => "ffn_down_shexp",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{kind}"))
}

impl WeightSource {
    /// How many tensors there are and their largest dimension (`None` for dummy weights):
    /// what a config's layer count and sizes must fit before anything is sized by them.
    pub fn extent(&self) -> Option<(usize, usize)> {
        let (count, largest) = match self {
            Self::Gguf { file, .. } => {
                let infos = &file.content.tensor_infos;
                let dims = infos.values().flat_map(|t| t.shape.dims().to_vec());
                (infos.len(), dims.max())
            }
            Self::Safetensors { files, .. } => {
                let all = files.tensors();
                let dims = all.iter().flat_map(|(_, t)| t.shape().to_vec());
                (all.len(), dims.max())
            }
            Self::Dummy => return None,
        };
        Some((count, largest.unwrap_or(0)))
    }

    pub fn gguf(file: GgufFile) -> Result<Self> {
        let arch = file.string("general.architecture")?;
        Ok(Self::Gguf {
            file: Box::new(file),
            arch,
        })
    }

    /// Every `*.safetensors` file in `dir`.
    pub fn safetensors(dir: &Path) -> Result<Self> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| anyhow!("reading {}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            bail!("no *.safetensors files in {}", dir.display());
        }
        // SAFETY: the files are mapped read-only and not modified while the engine runs.
        let files = unsafe { MmapedSafetensors::multi(&paths)? };
        supported::check_safetensors(&files, dir)?;
        let language_model = files
            .tensors()
            .iter()
            .any(|(n, _)| n.starts_with("model.language_model."));
        Ok(Self::Safetensors {
            files,
            dir: dir.to_path_buf(),
            language_model,
        })
    }

    /// Where a safetensors checkpoint keeps the tensor a family calls `name`.
    pub(crate) fn stored_name(&self, name: &str) -> String {
        match (self, name.strip_prefix("model.")) {
            (
                Self::Safetensors {
                    language_model: true,
                    ..
                },
                Some(rest),
            ) => {
                format!("model.language_model.{rest}")
            }
            _ => name.to_string(),
        }
    }

    pub fn is_gguf(&self) -> bool {
        matches!(self, Self::Gguf { .. })
    }

    pub fn is_dummy(&self) -> bool {
        matches!(self, Self::Dummy)
    }

    pub(crate) fn location(&self) -> String {
        match self {
            Self::Gguf { file, .. } => file.path.display().to_string(),
            Self::Safetensors { dir, .. } => dir.display().to_string(),
            Self::Dummy => "--load-format dummy".into(),
        }
    }

    pub fn has(&self, name: &str) -> bool {
        match self {
            Self::Gguf { file, arch } => gguf_name(arch, name).is_some_and(|g| file.has_tensor(&g)),
            Self::Safetensors { files, .. } => files.get(&self.stored_name(name)).is_ok(),
            Self::Dummy => false,
        }
    }

    /// The tensor `name`: GGUF blocks as stored; safetensors as f32.
    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        let location = self.location();
        match self {
            Self::Gguf { file, arch } => {
                let g = gguf_name(arch, name)
                    .ok_or_else(|| anyhow!("{location}: no GGUF name for tensor `{name}`"))?;
                file.tensor(&g, &Device::Cpu)
            }
            Self::Safetensors { .. } => {
                let stored = self.stored_name(name);
                let Self::Safetensors { files, .. } = self else {
                    unreachable!("matched above")
                };
                let t = files
                    .load(&stored, &Device::Cpu)
                    .map_err(|e| anyhow!("{location}: tensor `{name}`: {e}"))?
                    .to_dtype(DType::F32)?;
                Ok(QTensor::quantize(&t, GgmlDType::F32)?)
            }
            Self::Dummy => bail!("{location}: no tensor `{name}` (random weights)"),
        }
    }

    /// The tensor `name`, which must be `dims` (`[out, in]` for a matrix): a file whose
    /// tensors disagree with its config fails here, not with wrong answers.
    pub fn shaped(&mut self, name: &str, dims: &[usize]) -> Result<QTensor> {
        let t = self.tensor(name)?;
        if t.shape().dims() != dims {
            bail!(
                "{}: tensor `{name}` is {:?}, the config implies {dims:?}",
                self.location(),
                t.shape().dims()
            );
        }
        Ok(t)
    }

    /// `name` if present.
    pub fn opt_tensor(&mut self, name: &str) -> Result<Option<QTensor>> {
        if self.has(name) {
            self.tensor(name).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A small tensor (norm weights, biases) as f32 values.
    pub fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        Ok(self
            .tensor(name)?
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1()?)
    }

    pub fn opt_vector(&mut self, name: &str) -> Result<Option<Vec<f32>>> {
        if self.has(name) {
            self.vector(name).map(Some)
        } else {
            Ok(None)
        }
    }
}
