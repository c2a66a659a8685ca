//! bf16 weights on the GPU: from a Hugging Face safetensors checkpoint, from a GGUF file
//! (dequantized on the host), or random from the config alone (`--load-format dummy`). Q|K|V and gate|up are stacked so each is one matmul.

use crate::config::ModelConfig;
use crate::gguf::GgufFile;
use anyhow::{bail, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};

pub struct LayerWeights {
    pub attn_norm: Tensor,
    /// `[(H + 2 Hkv) D, hidden]`
    pub qkv: Tensor,
    pub qkv_bias: Option<Tensor>,
    /// Per-head RMSNorm of Q and K (Qwen3), `[D]`.
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub o: Tensor,
    pub ffn_norm: Tensor,
    /// `[2 I, hidden]`: gate and up rows alternating (see [`interleave_gate_up`]).
    pub gate_up: Tensor,
    pub down: Tensor,
}

pub struct Weights {
    pub embedding: Tensor,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Tensor,
    pub lm_head: Tensor,
}

/// Gate `[I, h]` and up `[I, h]` as one `[2I, h]` matrix whose rows alternate gate, up: one
/// matmul makes both, and the small-row matmul's warp that makes gate j makes up j next and
/// writes `silu(gate) * up` itself.
pub fn interleave_gate_up(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (i, h) = gate.dims2()?;
    Ok(Tensor::stack(&[gate, up], 1)?.reshape((2 * i, h))?)
}

impl Weights {
    pub fn bytes(&self) -> usize {
        let size = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let opt = |t: &Option<Tensor>| t.as_ref().map_or(0, size);
        let mut n = size(&self.embedding) + size(&self.final_norm) + size(&self.lm_head);
        for l in &self.layers {
            n += [&l.attn_norm, &l.qkv, &l.o, &l.ffn_norm, &l.gate_up, &l.down]
                .into_iter()
                .map(size)
                .sum::<usize>()
                + opt(&l.qkv_bias)
                + opt(&l.q_norm)
                + opt(&l.k_norm);
        }
        n
    }

    /// Every tensor of a GGUF Llama-family file, dequantized to bf16 on `dev`.
    pub fn from_gguf(
        gguf: &mut GgufFile,
        config: &ModelConfig,
        dev: &Device,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        let mut get = |name: &str| -> Result<Tensor> {
            let q = gguf.tensor(name, &Device::Cpu)?;
            Ok(q.dequantize(&Device::Cpu)?
                .to_dtype(DType::BF16)?
                .to_device(dev)?)
        };
        let embedding = get("token_embd.weight")?;
        let final_norm = get("output_norm.weight")?;
        let lm_head =
            get("output.weight").or_else(|_| Ok::<_, anyhow::Error>(embedding.clone()))?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let mut t = |n: &str| get(&format!("blk.{i}.{n}"));
            let qkv_bias = match t("attn_q.bias") {
                Ok(q) => Some(Tensor::cat(&[q, t("attn_k.bias")?, t("attn_v.bias")?], 0)?),
                Err(_) => None,
            };
            layers.push(LayerWeights {
                attn_norm: t("attn_norm.weight")?,
                qkv: Tensor::cat(
                    &[
                        t("attn_q.weight")?,
                        t("attn_k.weight")?,
                        t("attn_v.weight")?,
                    ],
                    0,
                )?,
                qkv_bias,
                q_norm: t("attn_q_norm.weight").ok(),
                k_norm: t("attn_k_norm.weight").ok(),
                o: t("attn_output.weight")?,
                ffn_norm: t("ffn_norm.weight")?,
                gate_up: interleave_gate_up(&t("ffn_gate.weight")?, &t("ffn_up.weight")?)?,
                down: t("ffn_down.weight")?,
            });
            progress(i + 1, config.num_layers);
        }
        Ok(Self {
            embedding,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// A Hugging Face checkpoint: every `*.safetensors` file in `dir` (Llama, Mistral, Qwen2
    /// with its QKV bias, Qwen3 with its Q/K norms), converted to bf16 on `dev`.
    pub fn from_safetensors(
        dir: &Path,
        config: &ModelConfig,
        dev: &Device,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            bail!("no *.safetensors files in {}", dir.display());
        }
        // SAFETY: the files are mapped read-only and not modified while the weights load.
        let st = unsafe { MmapedSafetensors::multi(&files)? };
        let get = |name: &str| -> Result<Tensor> {
            Ok(st
                .load(name, dev)
                .with_context(|| format!("tensor {name} in {}", dir.display()))?
                .to_dtype(DType::BF16)?)
        };
        let has = |name: &str| st.get(name).is_ok();
        let embedding = get("model.embed_tokens.weight")?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = format!("model.layers.{i}");
            let t = |n: &str| get(&format!("{p}.{n}"));
            let qkv_bias = if has(&format!("{p}.self_attn.q_proj.bias")) {
                Some(Tensor::cat(
                    &[
                        t("self_attn.q_proj.bias")?,
                        t("self_attn.k_proj.bias")?,
                        t("self_attn.v_proj.bias")?,
                    ],
                    0,
                )?)
            } else {
                None
            };
            let norm = |n: &str| -> Result<Option<Tensor>> {
                let name = format!("{p}.self_attn.{n}.weight");
                Ok(if has(&name) { Some(get(&name)?) } else { None })
            };
            layers.push(LayerWeights {
                attn_norm: t("input_layernorm.weight")?,
                qkv: Tensor::cat(
                    &[
                        t("self_attn.q_proj.weight")?,
                        t("self_attn.k_proj.weight")?,
                        t("self_attn.v_proj.weight")?,
                    ],
                    0,
                )?,
                qkv_bias,
                q_norm: norm("q_norm")?,
                k_norm: norm("k_norm")?,
                o: t("self_attn.o_proj.weight")?,
                ffn_norm: t("post_attention_layernorm.weight")?,
                gate_up: interleave_gate_up(
                    &t("mlp.gate_proj.weight")?,
                    &t("mlp.up_proj.weight")?,
                )?,
                down: t("mlp.down_proj.weight")?,
            });
            progress(i + 1, config.num_layers);
        }
        Ok(Self {
            lm_head: if has("lm_head.weight") {
                get("lm_head.weight")?
            } else {
                // Tied embeddings.
                embedding.clone()
            },
            final_norm: get("model.norm.weight")?,
            embedding,
            layers,
        })
    }

    /// Random weights of the config's shapes, drawn on the device: normal with std 0.02 for
    /// matrices (so activations keep a realistic scale), ones for norms.
    pub fn dummy(
        config: &ModelConfig,
        dev: &Device,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        let c = config;
        let (h, d) = (c.hidden_size, c.head_dim);
        let matrix = |rows: usize, cols: usize| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, 0.02, (rows, cols), dev)?.to_dtype(DType::BF16)?)
        };
        let ones = |n: usize| -> Result<Tensor> { Ok(Tensor::ones(n, DType::BF16, dev)?) };
        let embedding = matrix(c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            layers.push(LayerWeights {
                attn_norm: ones(h)?,
                qkv: matrix((c.num_heads + 2 * c.num_kv_heads) * d, h)?,
                qkv_bias: None,
                q_norm: None,
                k_norm: None,
                o: matrix(h, c.num_heads * d)?,
                ffn_norm: ones(h)?,
                gate_up: matrix(2 * c.intermediate_size, h)?,
                down: matrix(h, c.intermediate_size)?,
            });
            progress(i + 1, c.num_layers);
        }
        Ok(Self {
            lm_head: matrix(c.vocab_size, h)?,
            embedding,
            layers,
            final_norm: ones(h)?,
        })
    }
}
