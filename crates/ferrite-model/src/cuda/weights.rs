//! Weights on the GPU: bf16 from a Hugging Face safetensors checkpoint, from a GGUF file (or its
//! quantized blocks as they are, for candle's quantized CUDA matmuls), or random from the
//! config alone (`--load-format dummy`). Q|K|V and gate|up are stacked so each is one matmul.

use crate::config::ModelConfig;
use crate::weights::gguf::GgufFile;
use anyhow::{bail, Context, Result};
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A weight matrix `[n, k]` as the matmuls read it.
pub enum Linear {
    /// bf16, through cuBLAS or ferrite's small-row matmuls.
    Dense(Tensor),
    /// GGUF blocks on the device, through candle's quantized CUDA matmuls.
    Quant(Arc<QTensor>),
}

impl Linear {
    pub fn dims(&self) -> Result<(usize, usize)> {
        Ok(match self {
            Linear::Dense(t) => t.dims2()?,
            Linear::Quant(q) => q.shape().dims2()?,
        })
    }

    pub fn bytes(&self) -> usize {
        match self {
            Linear::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Linear::Quant(q) => q.storage_size_in_bytes(),
        }
    }

    /// The bf16 matrix, for what only takes one (cuBLAS timings).
    pub fn dense(&self) -> Result<&Tensor> {
        match self {
            Linear::Dense(t) => Ok(t),
            Linear::Quant(q) => bail!("a {:?} matrix is not dense", q.dtype()),
        }
    }
}

/// Block types candle multiplies on the GPU without dequantizing (its MMVQ/MMQ kernels).
fn gpu_quantized(t: GgmlDType) -> bool {
    use GgmlDType::*;
    matches!(
        t,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K
    )
}

/// GGUF matrices `parts` (same width) as one `Linear`: their rows stacked (or, with
/// `interleave`, two matrices' rows alternating, see [`interleave_gate_up`]); quantized
/// when `quantized` and every part has the same block type candle's kernels take, else bf16.
fn gguf_linear(
    parts: &[QTensor],
    interleave: bool,
    quantized: bool,
    dev: &Device,
) -> Result<Linear> {
    let dtype = parts[0].dtype();
    if !(quantized && gpu_quantized(dtype) && parts.iter().all(|p| p.dtype() == dtype)) {
        let dense = parts
            .iter()
            .map(|p| {
                Ok(p.dequantize(&Device::Cpu)?
                    .to_dtype(DType::BF16)?
                    .to_device(dev)?)
            })
            .collect::<Result<Vec<_>>>()?;
        return Ok(Linear::Dense(if interleave {
            interleave_gate_up(&dense[0], &dense[1])?
        } else {
            Tensor::cat(&dense, 0)?
        }));
    }
    // Rows are whole runs of blocks: stacking or interleaving rows moves bytes only.
    let (_, k) = parts[0].shape().dims2()?;
    let row = k / dtype.block_size() * dtype.type_size();
    let data = parts
        .iter()
        .map(|p| p.data())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let rows: usize = data.iter().map(|d| d.len() / row).sum();
    let bytes: Vec<u8> = if interleave {
        data[0]
            .chunks(row)
            .zip(data[1].chunks(row))
            .flat_map(|(g, u)| g.iter().chain(u))
            .copied()
            .collect()
    } else {
        data.concat()
    };
    Ok(Linear::Quant(Arc::new(qtensor_from_ggml(
        dtype,
        &bytes,
        vec![rows, k],
        dev,
    )?)))
}

pub struct LayerWeights {
    pub attn_norm: Tensor,
    /// `[(H + 2 Hkv) D, hidden]`
    pub qkv: Linear,
    pub qkv_bias: Option<Tensor>,
    /// Per-head RMSNorm of Q and K (Qwen3), `[D]`.
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub o: Linear,
    pub ffn_norm: Tensor,
    /// `[2 I, hidden]`: gate and up rows alternating (see [`interleave_gate_up`]).
    pub gate_up: Linear,
    pub down: Linear,
}

pub struct Weights {
    pub embedding: Tensor,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Tensor,
    pub lm_head: Linear,
}

/// Gate `[I, h]` and up `[I, h]` as one `[2I, h]` matrix whose rows alternate gate, up: one
/// matmul makes both, and the small-row matmul's warp that makes gate j makes up j next and
/// writes `silu(gate) * up` itself.
pub fn interleave_gate_up(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (i, h) = gate.dims2()?;
    Ok(Tensor::stack(&[gate, up], 1)?.reshape((2 * i, h))?)
}

impl Weights {
    /// Whether any matrix stays quantized (candle's kernels: no CUDA graphs, see the loader).
    pub fn quantized(&self) -> bool {
        let q = |l: &Linear| matches!(l, Linear::Quant(_));
        q(&self.lm_head)
            || self
                .layers
                .iter()
                .any(|l| [&l.qkv, &l.o, &l.gate_up, &l.down].into_iter().any(q))
    }

    pub fn bytes(&self) -> usize {
        let size = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let opt = |t: &Option<Tensor>| t.as_ref().map_or(0, size);
        let mut n = size(&self.embedding) + size(&self.final_norm) + self.lm_head.bytes();
        for l in &self.layers {
            n += size(&l.attn_norm)
                + size(&l.ffn_norm)
                + [&l.qkv, &l.o, &l.gate_up, &l.down]
                    .into_iter()
                    .map(Linear::bytes)
                    .sum::<usize>()
                + opt(&l.qkv_bias)
                + opt(&l.q_norm)
                + opt(&l.k_norm);
        }
        n
    }

    /// Every tensor of a GGUF Llama-family file on `dev`: with `quantized`, the matrices whose
    /// blocks candle's CUDA kernels multiply stay as they are; everything else is dequantized
    /// to bf16.
    pub fn from_gguf(
        gguf: &mut GgufFile,
        config: &ModelConfig,
        dev: &Device,
        quantized: bool,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        let mut raw = |name: &str| gguf.tensor(name, &Device::Cpu);
        let bf16 = |q: QTensor| -> Result<Tensor> {
            Ok(q.dequantize(&Device::Cpu)?
                .to_dtype(DType::BF16)?
                .to_device(dev)?)
        };
        let embedding_q = raw("token_embd.weight")?;
        let lm_head = match raw("output.weight") {
            Ok(head) => gguf_linear(&[head], false, quantized, dev)?,
            Err(_) => gguf_linear(std::slice::from_ref(&embedding_q), false, quantized, dev)?,
        };
        let embedding = bf16(embedding_q)?;
        let final_norm = bf16(raw("output_norm.weight")?)?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let mut t = |n: &str| raw(&format!("blk.{i}.{n}"));
            let qkv_bias = match t("attn_q.bias") {
                Ok(q) => Some(Tensor::cat(
                    &[bf16(q)?, bf16(t("attn_k.bias")?)?, bf16(t("attn_v.bias")?)?],
                    0,
                )?),
                Err(_) => None,
            };
            let qkv = [
                t("attn_q.weight")?,
                t("attn_k.weight")?,
                t("attn_v.weight")?,
            ];
            let gate_up = [t("ffn_gate.weight")?, t("ffn_up.weight")?];
            layers.push(LayerWeights {
                attn_norm: bf16(t("attn_norm.weight")?)?,
                qkv: gguf_linear(&qkv, false, quantized, dev)?,
                qkv_bias,
                q_norm: t("attn_q_norm.weight").ok().map(bf16).transpose()?,
                k_norm: t("attn_k_norm.weight").ok().map(bf16).transpose()?,
                o: gguf_linear(&[t("attn_output.weight")?], false, quantized, dev)?,
                ffn_norm: bf16(t("ffn_norm.weight")?)?,
                gate_up: gguf_linear(&gate_up, true, quantized, dev)?,
                down: gguf_linear(&[t("ffn_down.weight")?], false, quantized, dev)?,
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
                qkv: Linear::Dense(Tensor::cat(
                    &[
                        t("self_attn.q_proj.weight")?,
                        t("self_attn.k_proj.weight")?,
                        t("self_attn.v_proj.weight")?,
                    ],
                    0,
                )?),
                qkv_bias,
                q_norm: norm("q_norm")?,
                k_norm: norm("k_norm")?,
                o: Linear::Dense(t("self_attn.o_proj.weight")?),
                ffn_norm: t("post_attention_layernorm.weight")?,
                gate_up: Linear::Dense(interleave_gate_up(
                    &t("mlp.gate_proj.weight")?,
                    &t("mlp.up_proj.weight")?,
                )?),
                down: Linear::Dense(t("mlp.down_proj.weight")?),
            });
            progress(i + 1, config.num_layers);
        }
        Ok(Self {
            lm_head: Linear::Dense(if has("lm_head.weight") {
                get("lm_head.weight")?
            } else {
                // Tied embeddings.
                embedding.clone()
            }),
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
        let linear =
            |rows: usize, cols: usize| Ok::<_, anyhow::Error>(Linear::Dense(matrix(rows, cols)?));
        let ones = |n: usize| -> Result<Tensor> { Ok(Tensor::ones(n, DType::BF16, dev)?) };
        let embedding = matrix(c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            layers.push(LayerWeights {
                attn_norm: ones(h)?,
                qkv: linear((c.num_heads + 2 * c.num_kv_heads) * d, h)?,
                qkv_bias: None,
                q_norm: None,
                k_norm: None,
                o: linear(h, c.num_heads * d)?,
                ffn_norm: ones(h)?,
                gate_up: linear(2 * c.intermediate_size, h)?,
                down: linear(h, c.intermediate_size)?,
            });
            progress(i + 1, c.num_layers);
        }
        Ok(Self {
            lm_head: linear(c.vocab_size, h)?,
            embedding,
            layers,
            final_norm: ones(h)?,
        })
    }
}
