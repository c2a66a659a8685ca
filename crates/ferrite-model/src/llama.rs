//! The Llama family (SmolLM, Llama 2/3, Mistral, Qwen2 with its QKV bias) as one packed
//! forward pass: every token-wise layer runs on `[T, hidden]`; attention is the paged
//! varlen op; the LM head runs only on the rows in `logits_indices`.

use crate::attention::{paged_attention, AttentionMeta, AttentionParams};
use crate::config::ModelConfig;
use crate::gguf::GgufFile;
use crate::kv_cache::{write_kv, KvCache};
use crate::linear::{project, Linear, LinearInput, WeightFormat};
use crate::ops::{add_in_place, rms_norm, silu_mul, RopeTable};
use crate::quant::activations::QuantizedActs;
use crate::step::PackedStep;
use anyhow::{bail, Result};
use candle_core::quantized::QTensor;
use candle_core::Device;

struct Layer {
    attn_norm: Vec<f32>,
    /// Q|K|V rows fused when their types match, else three separate projections.
    qkv: Vec<Linear>,
    qkv_bias: Option<Vec<f32>>,
    o: Linear,
    ffn_norm: Vec<f32>,
    gate_up: Vec<Linear>,
    down: Linear,
}

pub struct LlamaModel {
    pub config: ModelConfig,
    pub format: WeightFormat,
    embedding: Vec<f32>,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    lm_head: Linear,
    rope: RopeTable,
    weight_bytes: usize,
    ws: Workspace,
}

/// Buffers of one step. They grow to the largest step (the start-up profile runs one at the
/// full token budget) and are reused, so later steps allocate nothing here.
#[derive(Default)]
struct Workspace {
    x: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    /// One projection's output when Q/K/V or gate/up are not stacked.
    part: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    /// Output of the attention and FFN down projections.
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    /// Quantized matmul input.
    acts: QuantizedActs,
    logits: Vec<f32>,
}

/// `buf` resized to `len` (allocating only past its capacity).
fn sized(buf: &mut Vec<f32>, len: usize) -> &mut Vec<f32> {
    buf.resize(len, 0.0);
    buf
}

fn f32_vec(t: QTensor) -> Result<Vec<f32>> {
    Ok(t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?)
}

impl LlamaModel {
    /// Loads every tensor; `progress` is told after each layer.
    pub fn load(
        gguf: &mut GgufFile,
        format: WeightFormat,
        max_positions: usize,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        let config = ModelConfig::from_gguf(gguf)?;
        let format = format.resolve(gguf.param_count() as u64);
        let dev = Device::Cpu;
        let embd = gguf.tensor("token_embd.weight", &dev)?;
        let (vocab, hidden) = embd.shape().dims2()?;
        if hidden != config.hidden_size {
            bail!(
                "token_embd is {hidden} wide, metadata says {}",
                config.hidden_size
            );
        }
        let lm_head_q = if gguf.has_tensor("output.weight") {
            gguf.tensor("output.weight", &dev)?
        } else {
            // Tied embeddings: the LM head reuses the embedding matrix.
            gguf.tensor("token_embd.weight", &dev)?
        };
        let embedding = f32_vec(embd)?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let mut t = |n: &str| gguf.tensor(&format!("blk.{i}.{n}"), &dev);
            let q = t("attn_q.weight")?;
            let k = t("attn_k.weight")?;
            let v = t("attn_v.weight")?;
            let qkv_bias = match t("attn_q.bias") {
                Ok(qb) => {
                    let mut b = f32_vec(qb)?;
                    b.extend(f32_vec(t("attn_k.bias")?)?);
                    b.extend(f32_vec(t("attn_v.bias")?)?);
                    Some(b)
                }
                Err(_) => None,
            };
            layers.push(Layer {
                attn_norm: f32_vec(t("attn_norm.weight")?)?,
                qkv: Linear::projections(vec![q, k, v], format)?,
                qkv_bias,
                o: Linear::new(t("attn_output.weight")?, format)?,
                ffn_norm: f32_vec(t("ffn_norm.weight")?)?,
                gate_up: Linear::projections(
                    vec![t("ffn_gate.weight")?, t("ffn_up.weight")?],
                    format,
                )?,
                down: Linear::new(t("ffn_down.weight")?, format)?,
            });
            progress(i + 1, config.num_layers);
        }
        let final_norm = f32_vec(gguf.tensor("output_norm.weight", &dev)?)?;
        let lm_head = Linear::new(lm_head_q, format)?;
        let rope = RopeTable::new(
            config.rope_dim,
            config.rope_theta,
            max_positions,
            config.rope_style,
        );
        let mut weight_bytes = embedding.len() * 4 + final_norm.len() * 4 + lm_head.bytes();
        for l in &layers {
            weight_bytes += l
                .qkv
                .iter()
                .chain(&l.gate_up)
                .map(Linear::bytes)
                .sum::<usize>()
                + l.o.bytes()
                + l.down.bytes()
                + (l.attn_norm.len() + l.ffn_norm.len()) * 4
                + l.qkv_bias.as_ref().map_or(0, |b| b.len() * 4);
        }
        let mut config = config;
        config.vocab_size = vocab;
        Ok(Self {
            config,
            format,
            embedding,
            layers,
            final_norm,
            lm_head,
            rope,
            weight_bytes,
            ws: Workspace::default(),
        })
    }

    /// Bytes the weights occupy in memory.
    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Runs the packed step; returns `[logits_indices.len(), vocab]` logits, row-major.
    pub fn forward(&mut self, step: &PackedStep, cache: &mut KvCache) -> Result<&mut [f32]> {
        let c = &self.config;
        let t = step.num_tokens();
        let (h, d) = (c.hidden_size, c.head_dim);
        let (q_w, kv_w) = (c.num_heads * d, c.num_kv_heads * d);
        if let Some(&p) = step.positions.iter().max() {
            if p as usize >= self.rope.max_positions() {
                bail!(
                    "position {p} is beyond the model's {} positions",
                    self.rope.max_positions()
                );
            }
        }
        if let Some(&id) = step
            .input_ids
            .iter()
            .find(|&&id| id as usize >= c.vocab_size)
        {
            bail!(
                "token id {id} is outside the vocabulary of {}",
                c.vocab_size
            );
        }
        let ws = &mut self.ws;
        let x = sized(&mut ws.x, t * h);
        for (row, &id) in x.chunks_mut(h).zip(&step.input_ids) {
            row.copy_from_slice(&self.embedding[id as usize * h..][..h]);
        }
        let meta = AttentionMeta {
            cu_seqlens_q: &step.cu_seqlens_q,
            seq_lens_k: &step.seq_lens_k,
            block_tables: &step.block_tables,
            max_blocks: step.max_blocks,
            block_size: cache.shape.block_size,
        };
        let params = AttentionParams {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            sliding_window: c.sliding_window,
            softcap: None,
        };
        let normed = sized(&mut ws.normed, t * h);
        let attn = sized(&mut ws.attn, t * q_w);
        let act = sized(&mut ws.act, t * c.intermediate_size);
        let (q, k, v) = (
            sized(&mut ws.q, t * q_w),
            sized(&mut ws.k, t * kv_w),
            sized(&mut ws.v, t * kv_w),
        );
        let shape = cache.shape;
        for (layer, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            rms_norm(x, &layer.attn_norm, c.rms_norm_eps, normed);
            let input = LinearInput::new(normed, t, h, &mut ws.acts);
            project(&layer.qkv, &input, &mut ws.qkv, &mut ws.part)?;
            if let Some(b) = &layer.qkv_bias {
                ws.qkv
                    .chunks_mut(b.len())
                    .for_each(|r| r.iter_mut().zip(b).for_each(|(v, b)| *v += b));
            }
            for (((r, q), k), v) in ws
                .qkv
                .chunks(q_w + 2 * kv_w)
                .zip(q.chunks_mut(q_w))
                .zip(k.chunks_mut(kv_w))
                .zip(v.chunks_mut(kv_w))
            {
                q.copy_from_slice(&r[..q_w]);
                k.copy_from_slice(&r[q_w..q_w + kv_w]);
                v.copy_from_slice(&r[q_w + kv_w..]);
            }
            self.rope.apply(q, &step.positions, c.num_heads, d);
            self.rope.apply(k, &step.positions, c.num_kv_heads, d);
            write_kv(lc, k, v, &step.slot_mapping, &shape);
            paged_attention(q, &lc.k, &lc.v, &meta, &params, attn);
            let input = LinearInput::new(attn, t, q_w, &mut ws.acts);
            layer.o.forward(&input, &mut ws.proj)?;
            add_in_place(x, &ws.proj);

            rms_norm(x, &layer.ffn_norm, c.rms_norm_eps, normed);
            let input = LinearInput::new(normed, t, h, &mut ws.acts);
            project(&layer.gate_up, &input, &mut ws.gate_up, &mut ws.part)?;
            silu_mul(&ws.gate_up, c.intermediate_size, act);
            let input = LinearInput::new(act, t, c.intermediate_size, &mut ws.acts);
            layer.down.forward(&input, &mut ws.proj)?;
            add_in_place(x, &ws.proj);
        }
        // Only the rows that need logits go through the final norm and the LM head.
        let rows = step.logits_indices.len();
        let sel = sized(&mut ws.q, rows * h);
        for (dst, &i) in sel.chunks_mut(h).zip(&step.logits_indices) {
            dst.copy_from_slice(&x[i as usize * h..][..h]);
        }
        let sel_normed = sized(&mut ws.normed, rows * h);
        rms_norm(&ws.q, &self.final_norm, c.rms_norm_eps, sel_normed);
        self.lm_head.forward(
            &LinearInput::new(sel_normed, rows, h, &mut ws.acts),
            &mut ws.logits,
        )?;
        Ok(&mut ws.logits)
    }
}
