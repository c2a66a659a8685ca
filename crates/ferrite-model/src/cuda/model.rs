//! The Llama family on a CUDA GPU as one packed forward pass per step: bf16 weights, matmuls
//! through cuBLAS (cublasGemmEx) or, for steps of one or two rows, ferrite's own with the
//! RMSNorms, the SiLU-mul and the residual adds folded in; everything else in ferrite's kernels; the residual stream
//! in f32, updated by the matmuls' epilogues.

use super::graph::DecodeGraphs;
use super::kernels::{draw_params, AttentionMeta, AttentionShape, Kernels, MatIn, QkvParams};
use super::weights::Weights;
use crate::config::{ModelConfig, RopeStyle};
use crate::rope::{RopeSpec, RopeTable};
use crate::runner::{RowDraw, StepModel};
use crate::step::PackedStep;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

/// A step's index arrays on the device (see [`PackedStep`]).
pub struct StepInputs {
    pub ids: Tensor,
    pub positions: Tensor,
    pub slots: Tensor,
    pub cu_seqlens_q: Tensor,
    pub seq_lens_k: Tensor,
    /// `[num_seqs, max_blocks]`
    pub block_tables: Tensor,
    pub rows: Tensor,
    pub max_blocks: usize,
    /// Longest K/V length, or the longest the inputs may ever hold (graphs).
    pub max_seq_len: usize,
    /// Fixed attention splits (graphs); `None`: chosen from the shape.
    pub splits: Option<usize>,
}

pub struct CudaModel {
    pub config: ModelConfig,
    device: Device,
    kernels: Kernels,
    weights: Weights,
    /// Per layer: K and V `[num_blocks, kv_heads, block_size, head_dim]` bf16.
    cache: Vec<(Tensor, Tensor)>,
    block_size: usize,
    rope_cos: Tensor,
    rope_sin: Tensor,
    max_positions: usize,
    logits: Vec<f32>,
    name: String,
    graphs: DecodeGraphs,
}

impl CudaModel {
    pub fn new(
        config: ModelConfig,
        device: Device,
        weights: Weights,
        max_positions: usize,
        name: String,
    ) -> Result<Self> {
        let Device::Cuda(dev) = &device else {
            bail!("not a CUDA device")
        };
        let kernels = Kernels::load(dev)?;
        let rope = RopeTable::new(&RopeSpec::of(&config), max_positions);
        let (cos, sin) = rope.tables();
        let half = config.rope_dim / 2;
        Ok(Self {
            rope_cos: Tensor::from_slice(cos, (max_positions, half), &device)?,
            rope_sin: Tensor::from_slice(sin, (max_positions, half), &device)?,
            config,
            kernels,
            weights,
            cache: Vec::new(),
            block_size: 0,
            max_positions,
            logits: Vec::new(),
            name,
            graphs: DecodeGraphs::default(),
            device,
        })
    }

    /// Allocates the KV pool once: `num_blocks` blocks of `block_size` tokens in every layer.
    pub fn allocate_cache(&mut self, num_blocks: usize, block_size: usize) -> Result<()> {
        let c = &self.config;
        let shape = (num_blocks, c.num_kv_heads, block_size, c.head_dim);
        self.cache.clear();
        for _ in 0..c.num_layers {
            self.cache.push((
                Tensor::zeros(shape, DType::BF16, &self.device)?,
                Tensor::zeros(shape, DType::BF16, &self.device)?,
            ));
        }
        self.block_size = block_size;
        Ok(())
    }

    /// Fills the KV pool with random values (benchmarks time attention on real-looking data).
    pub fn randomize_cache(&mut self) -> Result<()> {
        for (k, v) in &mut self.cache {
            *k = Tensor::randn(0f32, 1.0, k.shape(), &self.device)?.to_dtype(DType::BF16)?;
            *v = Tensor::randn(0f32, 1.0, v.shape(), &self.device)?.to_dtype(DType::BF16)?;
        }
        Ok(())
    }

    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    fn u32s(&self, v: &[u32]) -> Result<Tensor> {
        Ok(Tensor::from_slice(v, v.len(), &self.device)?)
    }

    /// Replays decode-only steps of up to `max_batch` requests from CUDA graphs, padding
    /// rows writing into `scratch_block`, a block the scheduler never hands out.
    pub fn enable_decode_graphs(&mut self, max_batch: usize, scratch_block: u32) -> Result<()> {
        let Device::Cuda(dev) = &self.device else {
            bail!("not a CUDA device")
        };
        self.graphs = DecodeGraphs::new(
            dev,
            max_batch,
            scratch_block,
            self.block_size,
            self.max_positions,
        )?;
        Ok(())
    }

    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Positions and token ids within what the model serves.
    pub fn check(&self, step: &PackedStep) -> Result<()> {
        step.check(self.max_positions, self.config.vocab_size)
    }

    /// Checks the step and copies its index arrays to the device.
    pub fn upload(&self, step: &PackedStep) -> Result<StepInputs> {
        self.check(step)?;
        Ok(StepInputs {
            ids: self.u32s(&step.input_ids)?,
            positions: self.u32s(&step.positions)?,
            slots: self.u32s(&step.kv[0].slot_mapping)?,
            cu_seqlens_q: self.u32s(&step.cu_seqlens_q)?,
            seq_lens_k: self.u32s(&step.seq_lens_k)?,
            block_tables: if step.kv[0].block_tables.is_empty() {
                self.u32s(&[0])?
            } else {
                self.u32s(&step.kv[0].block_tables)?
            },
            rows: self.u32s(&step.logits_indices)?,
            max_blocks: step.kv[0].max_blocks,
            max_seq_len: step.seq_lens_k.iter().copied().max().unwrap_or(0) as usize,
            splits: None,
        })
    }

    /// Runs the step; `[logits_indices.len(), vocab]` f32 logits on the device.
    pub fn forward_logits(&self, step: &PackedStep) -> Result<Tensor> {
        self.run(&self.upload(step)?)
    }

    /// The forward pass over inputs already on the device. It only launches work (no host
    /// copies, no synchronization), so a CUDA graph can capture it.
    pub fn run(&self, inp: &StepInputs) -> Result<Tensor> {
        let c = &self.config;
        let w = &self.weights;
        if self.cache.is_empty() {
            bail!("KV cache not allocated");
        }
        let t = inp.ids.dim(0)?;
        let (ids, positions, slots, rows) = (&inp.ids, &inp.positions, &inp.slots, &inp.rows);
        let meta = AttentionMeta {
            cu_seqlens_q: &inp.cu_seqlens_q,
            seq_lens_k: &inp.seq_lens_k,
            block_tables: &inp.block_tables,
            max_blocks: inp.max_blocks,
            num_seqs: inp.seq_lens_k.dim(0)?,
            num_tokens: t,
            max_seq_len: inp.max_seq_len,
            splits: inp.splits,
        };
        let shape = AttentionShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: self.block_size,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: c.sliding_window.unwrap_or(0),
            softcap: 0.0,
        };
        let k = &self.kernels;
        let eps = c.rms_norm_eps;
        let x = k.embed(ids, &w.embedding)?;
        let norm = |norm, rows| MatIn::Rms {
            x: &x,
            rows,
            norm,
            eps,
        };
        for (l, (kc, vc)) in w.layers.iter().zip(&self.cache) {
            let qkv = k.matmul(norm(&l.attn_norm, None), &l.qkv, DType::BF16)?;
            let q = k.qkv_rope_write(
                &qkv,
                positions,
                slots,
                kc,
                vc,
                &shape,
                &QkvParams {
                    bias: l.qkv_bias.as_ref(),
                    q_norm: l.q_norm.as_ref(),
                    k_norm: l.k_norm.as_ref(),
                    eps,
                    rope_cos: &self.rope_cos,
                    rope_sin: &self.rope_sin,
                    rope_dim: c.rope_dim,
                    neox: c.rope_style == RopeStyle::Neox,
                },
            )?;
            let attn = k.paged_attention(&q, kc, vc, &meta, &shape)?;
            k.matmul_add(MatIn::Bf16(&attn), &l.o, &x)?;
            let act = k.matmul_silu(norm(&l.ffn_norm, None), &l.gate_up)?;
            k.matmul_add(MatIn::Bf16(&act), &l.down, &x)?;
        }
        // Only the rows that need logits get the final norm and the head.
        k.matmul(norm(&w.final_norm, Some(rows)), &w.lm_head, DType::F32)
    }
}

impl CudaModel {
    /// The step's logits and drawn tokens from a graph replay, when a graph serves it.
    fn replay(&mut self, step: &PackedStep, draws: &[RowDraw]) -> Result<Option<(Tensor, Tensor)>> {
        let mut graphs = std::mem::take(&mut self.graphs);
        let b = step.num_seqs();
        let out = graphs.replay(self, step, draws).and_then(|g| {
            g.map(|g| Ok((g.logits.narrow(0, 0, b)?, g.tokens.narrow(0, 0, b)?)))
                .transpose()
        });
        self.graphs = graphs;
        out
    }
}

impl StepModel for CudaModel {
    fn forward(&mut self, step: &PackedStep) -> Result<&mut [f32]> {
        let logits = match self.replay(step, &[])? {
            Some((logits, _)) => logits,
            None => self.forward_logits(step)?,
        };
        self.logits = logits.flatten_all()?.to_vec1()?;
        Ok(&mut self.logits)
    }

    fn forward_argmax(&mut self, step: &PackedStep) -> Result<Vec<u32>> {
        self.forward_draw(step, &vec![RowDraw::Greedy; step.logits_indices.len()])
    }

    fn draws_on_device(&self) -> bool {
        true
    }

    fn forward_draw(&mut self, step: &PackedStep, draws: &[RowDraw]) -> Result<Vec<u32>> {
        if let Some((_, tokens)) = self.replay(step, draws)? {
            return Ok(tokens.to_vec1()?);
        }
        let logits = self.forward_logits(step)?;
        let params = self.u32s(&draw_params(draws, draws.len()))?;
        Ok(self.kernels.sample_rows(&logits, &params)?.to_vec1()?)
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn describe(&self) -> String {
        let weights = if self.weights.quantized() {
            "GGUF blocks through candle's quantized matmuls, the rest bf16"
        } else {
            "bf16 weights"
        };
        format!(
            "backend {} ({weights}), kernels: ferrite CUDA + cuBLAS",
            self.name
        )
    }
}
