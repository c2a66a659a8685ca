//! Hybrids of gated delta-net (linear attention) and gated full attention: Qwen3.5 (dense,
//! and its mixture-of-experts members through [`Ffn`]) and Qwen3-Next (the same layers, its
//! input projections fused per key-head group: reordered at load). Most layers are linear attention,
//! each with a fixed-size recurrent state per request; every few a full-attention layer
//! whose output is gated by `sigmoid` of a second half of its Q projection, with partial
//! rotary embedding. Norms are zero-centred (`x * (1 + w)`), as Gemma's.

use super::family::{Buffers, Family};
use super::layers::{
    embedding, lm_head, matrix, norm, output, weight_bytes, Attention, NormWeights,
};
use super::moe::{Ffn, MoeConfig};
use crate::backend::{
    AttentionSpec, Backend, Epilogue, GdnParams, GdnSpec, LinearIn, MoeBytes, Rounding, Stack, Step,
};
use crate::config::ModelConfig;
use crate::rope::RopeSpec;
use crate::weights::config_source::ConfigSource;
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use ferrite_core::kv_layout::KvLayout;

#[derive(Clone, Debug)]
pub struct HybridConfig {
    /// `layer_windows` lists the full-attention layers only: they alone hold K/V.
    pub common: ModelConfig,
    /// Per layer: linear attention or not.
    pub linear: Vec<bool>,
    pub gdn: GdnSpec,
    /// Multi-token-prediction layers the config declares (`num_nextn_predict_layers`,
    /// `mtp_num_hidden_layers`); their weights may still be absent from the checkpoint.
    pub mtp_layers: usize,
}

impl HybridConfig {
    /// One state per linear-attention layer.
    pub fn state_layers(&self) -> Vec<GdnSpec> {
        let n = self.linear.iter().filter(|l| **l).count();
        vec![self.gdn.clone(); n]
    }

    pub fn read(src: &ConfigSource) -> Result<Self> {
        let mut common = ModelConfig::common(src, false)?;
        let n = common.num_layers;
        let linear: Vec<bool> = match src.get("layer_types") {
            Some(v) => serde_json::from_value::<Vec<String>>(v.clone())
                .map_err(|e| src.unsupported(&format!("`layer_types`: {e}")))?
                .iter()
                .map(|t| match t.as_str() {
                    "linear_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(src.unsupported(&format!("layer type `{other}`"))),
                })
                .collect::<Result<_>>()?,
            None => {
                let every = src.opt_usize("full_attention_interval").unwrap_or(4).max(1);
                (0..n).map(|i| (i + 1) % every != 0).collect()
            }
        };
        if linear.len() != n {
            bail!(
                "{}: {} layer types for {n} layers",
                src.path().display(),
                linear.len()
            );
        }
        let factor = src
            .opt_f32("rope_parameters.partial_rotary_factor")
            .or_else(|| src.opt_f32("partial_rotary_factor"))
            .unwrap_or(1.0);
        common.rope_dim = ((common.head_dim as f32 * factor) as usize) & !1;
        common.layer_windows = vec![None; linear.iter().filter(|l| !**l).count()];
        let gdn = GdnSpec {
            num_k_heads: src.usize("linear_num_key_heads")?,
            num_v_heads: src.usize("linear_num_value_heads")?,
            k_dim: src.usize("linear_key_head_dim")?,
            v_dim: src.usize("linear_value_head_dim")?,
            conv_kernel: src.opt_usize("linear_conv_kernel_dim").unwrap_or(4),
            eps: common.rms_norm_eps,
        };
        if gdn.num_k_heads == 0
            || !gdn.num_v_heads.is_multiple_of(gdn.num_k_heads)
            || gdn.conv_kernel < 2
            || gdn.k_dim == 0
            || gdn.v_dim == 0
        {
            bail!("{}: linear attention shape {gdn:?}", src.path().display());
        }
        let mtp_layers = src
            .opt_usize("num_nextn_predict_layers")
            .or_else(|| src.opt_usize("mtp_num_hidden_layers"))
            .unwrap_or(0);
        Ok(Self {
            common,
            linear,
            gdn,
            mtp_layers,
        })
    }

    /// With the MTP head (`wanted`) or without: its one full-attention layer holds K/V
    /// after the stack's (one more layer in every block).
    pub fn with_mtp(mut self, wanted: bool, w: &WeightSource) -> Result<Self> {
        if !wanted {
            self.mtp_layers = 0;
            return Ok(self);
        }
        match self.mtp_layers {
            0 => bail!("the config declares no multi-token-prediction layers"),
            1 if w.has(MTP_FC) => {}
            1 => bail!("the checkpoint has no multi-token-prediction weights (`{MTP_FC}`)"),
            n => {
                bail!("{n} multi-token-prediction layers: only checkpoints with one are supported")
            }
        }
        self.common.layer_windows.push(None);
        Ok(self)
    }
}

const MTP_FC: &str = "mtp.fc.weight";

struct LinearAttention<B: Backend> {
    /// Q|K|V, z, b, a.
    in_proj: B::Linear,
    conv: B::Vector,
    a_log: B::Vector,
    dt_bias: B::Vector,
    norm: B::Vector,
    out: B::Linear,
    /// Its state cache: the how-manieth linear-attention layer it is.
    state: usize,
}

enum Mixer<B: Backend> {
    /// Full attention and its output gate's projection.
    Attention(Attention<B>, B::Linear),
    Linear(LinearAttention<B>),
}

struct Layer<B: Backend> {
    input_norm: B::Vector,
    mixer: Mixer<B>,
    ffn_norm: B::Vector,
    ffn: Ffn<B>,
}

/// The multi-token-prediction head (as vLLM runs it): from the target's final hidden state
/// at position p and the embedding of the token at p + 1, each RMS-normed, `fc` (2h to h, its
/// halves kept apart so no concatenation is needed), one full-attention decoder layer with its
/// own K/V, its norm and the target's LM head: the logits of the token at p + 2.
struct Mtp<B: Backend> {
    norm_embedding: B::Vector,
    norm_hidden: B::Vector,
    fc_embedding: B::Linear,
    fc_hidden: B::Linear,
    layer: Layer<B>,
    norm: B::Vector,
}

pub struct Hybrid<B: Backend> {
    config: HybridConfig,
    embedding: B::Embedding,
    layers: Vec<Layer<B>>,
    final_norm: B::Vector,
    lm_head: B::Linear,
    rope: B::Rope,
    mtp: Option<Mtp<B>>,
}

/// A host `[rows, cols]` f32 matrix.
fn host(t: candle_core::Tensor) -> Result<QTensor> {
    // Rebuilt from its values: quantize reads a view's storage from its start.
    let dims = t.dims2()?;
    let t = candle_core::Tensor::from_vec(t.flatten_all()?.to_vec1::<f32>()?, dims, &Device::Cpu)?;
    Ok(QTensor::quantize(&t, GgmlDType::F32)?)
}

/// Qwen3.5's Q projection `[heads * 2d, h]` holds each head's Q rows, then its gate rows:
/// the two apart, `[heads * d, h]` each.
fn split_q_gate(
    w: &mut WeightSource,
    name: &str,
    heads: usize,
    d: usize,
    h: usize,
) -> Result<(QTensor, QTensor)> {
    let t = w
        .shaped(name, &[heads * 2 * d, h])?
        .dequantize(&Device::Cpu)?;
    let t = t.reshape((heads, 2, d, h))?;
    let q = t.narrow(1, 0, 1)?.reshape((heads * d, h))?;
    let gate = t.narrow(1, 1, 1)?.reshape((heads * d, h))?;
    Ok((host(q)?, host(gate)?))
}

/// Qwen3-Next's fused input projections, `in_proj_qkvz` (per key head: its q, k, then its
/// value heads' v and z rows) and `in_proj_ba` (per key head: its value heads' b, then a),
/// reordered as Qwen3.5 keeps them: Q | K | V | Z | B | A.
fn qwen3_next_in_proj(
    w: &mut WeightSource,
    prefix: &str,
    g: &GdnSpec,
    h: usize,
) -> Result<QTensor> {
    let (nk, r) = (g.num_k_heads, g.num_v_heads / g.num_k_heads);
    let group = 2 * g.k_dim + 2 * r * g.v_dim;
    let qkvz = w.shaped(&format!("{prefix}.in_proj_qkvz.weight"), &[nk * group, h])?;
    let qkvz = qkvz.dequantize(&Device::Cpu)?.reshape((nk, group, h))?;
    let ba = w.shaped(&format!("{prefix}.in_proj_ba.weight"), &[nk * 2 * r, h])?;
    let ba = ba.dequantize(&Device::Cpu)?.reshape((nk, 2 * r, h))?;
    let part = |t: &candle_core::Tensor, at: usize, len: usize| -> Result<candle_core::Tensor> {
        Ok(t.narrow(1, at, len)?.reshape((nk * len, h))?)
    };
    let (dk, rv) = (g.k_dim, r * g.v_dim);
    let rows = [
        part(&qkvz, 0, dk)?,
        part(&qkvz, dk, dk)?,
        part(&qkvz, 2 * dk, rv)?,
        part(&qkvz, 2 * dk + rv, rv)?,
        part(&ba, 0, r)?,
        part(&ba, r, r)?,
    ];
    host(candle_core::Tensor::cat(&rows, 0)?)
}

impl<B: Backend> Hybrid<B> {
    pub fn load(
        b: &B,
        config: HybridConfig,
        moe: Option<MoeConfig>,
        layout: &KvLayout,
        w: &mut WeightSource,
        max_positions: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let c = &config.common;
        let h = c.hidden_size;
        let zc = NormWeights::OffsetByOne;
        let spec = AttentionSpec {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: None,
            softcap: None,
            causal: true,
            kv_group: 0,
            kv_slot: 0,
        };
        let g = &config.gdn;
        let (embedding, vocab) = embedding(b, w, c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        let (mut attention_layers, mut linear_layers) = (0, 0);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let mixer = if config.linear[i] {
                let q = |n: &str| format!("{p}.linear_attn.{n}");
                let vd = g.num_v_heads * g.v_dim;
                let parts = [
                    (q("in_proj_qkv.weight"), g.conv_dim()),
                    (q("in_proj_z.weight"), vd),
                    (q("in_proj_b.weight"), g.num_v_heads),
                    (q("in_proj_a.weight"), g.num_v_heads),
                ];
                let vector = |w: &mut WeightSource, name: &str, len: usize, init: f32| {
                    let v = match w.is_dummy() {
                        true => vec![init; len],
                        false => w.vector(name)?,
                    };
                    if v.len() != len {
                        bail!("`{name}` has {} values, the config implies {len}", v.len());
                    }
                    b.vector(v)
                };
                let taps = g.conv_dim() * g.conv_kernel;
                let fused = format!("{p}.linear_attn.in_proj_qkvz.weight");
                let in_proj = match w.has(&fused) {
                    true => {
                        let t = qwen3_next_in_proj(w, &format!("{p}.linear_attn"), g, h)?;
                        b.linear(vec![t], Stack::Concat, Rounding::Fine)?
                    }
                    false => matrix(b, w, &parts, h, Stack::Concat, Rounding::Fine)?,
                };
                let m = LinearAttention {
                    in_proj,
                    conv: vector(w, &q("conv1d.weight"), taps, 0.1)?,
                    a_log: vector(w, &q("A_log"), g.num_v_heads, 0.0)?,
                    dt_bias: vector(w, &q("dt_bias"), g.num_v_heads, 1.0)?,
                    norm: norm(b, w, &q("norm.weight"), g.v_dim, NormWeights::Plain)?,
                    out: matrix(
                        b,
                        w,
                        &[(q("out_proj.weight"), h)],
                        vd,
                        Stack::Concat,
                        Rounding::Coarse,
                    )?,
                    state: linear_layers,
                };
                linear_layers += 1;
                Mixer::Linear(m)
            } else {
                let s = spec.clone().at(layout, attention_layers);
                attention_layers += 1;
                gated_attention(b, w, &p, c, s)?
            };
            layers.push(Layer::load(b, w, &p, i, c, mixer, moe.as_ref())?);
            progress(i + 1, c.num_layers);
        }
        let mtp = match config.mtp_layers {
            0 => None,
            _ => {
                let s = spec.at(layout, attention_layers);
                Some(Mtp::load(b, w, c, s, moe.as_ref())?)
            }
        };
        Ok(Self {
            embedding,
            layers,
            final_norm: norm(b, w, "model.norm.weight", h, zc)?,
            lm_head: lm_head(b, w, vocab, h)?,
            rope: b.rope(&RopeSpec::of(c), max_positions)?,
            config,
            mtp,
        })
    }

    /// One layer over the residual stream `ws.x`.
    fn layer(
        &self,
        b: &mut B,
        s: &Step<B>,
        l: &Layer<B>,
        cache: &mut [B::LayerCache],
        states: &mut [B::StateCache],
        ws: &mut Buffers<B>,
    ) -> Result<()> {
        let eps = self.config.common.rms_norm_eps;
        let input = LinearIn::RmsNorm {
            x: &ws.x,
            norm: &l.input_norm,
            eps,
        };
        match &l.mixer {
            Mixer::Attention(attn, gate) => {
                let lc = &mut cache[attn.spec.kv_slot];
                attn.attend(b, s, input, &self.rope, eps, lc, &mut ws.tmp)?;
                let input = LinearIn::RmsNorm {
                    x: &ws.x,
                    norm: &l.input_norm,
                    eps,
                };
                b.matmul(input, gate, Epilogue::Store(&mut ws.tmp.gate))?;
                b.gate_sigmoid(&mut ws.tmp.attn, &ws.tmp.gate)?;
                let o_in = LinearIn::Plain(&ws.tmp.attn);
                b.matmul(o_in, &attn.o, Epilogue::AddInto(&mut ws.x))?;
            }
            Mixer::Linear(m) => {
                b.matmul(input, &m.in_proj, Epilogue::Store(&mut ws.tmp.qkv))?;
                let p = GdnParams {
                    conv: &m.conv,
                    a_log: &m.a_log,
                    dt_bias: &m.dt_bias,
                    norm: &m.norm,
                };
                let st = &mut states[m.state];
                let g = &self.config.gdn;
                b.gated_delta(s, &ws.tmp.qkv, &p, g, st, &mut ws.tmp.attn)?;
                let o_in = LinearIn::Plain(&ws.tmp.attn);
                b.matmul(o_in, &m.out, Epilogue::AddInto(&mut ws.x))?;
            }
        }
        l.ffn.forward(b, &mut ws.x, &l.ffn_norm, eps, &mut ws.tmp)
    }
}

/// A full-attention mixer (`{p}.self_attn`): attention and its output gate's projection.
fn gated_attention<B: Backend>(
    b: &B,
    w: &mut WeightSource,
    p: &str,
    c: &ModelConfig,
    spec: AttentionSpec,
) -> Result<Mixer<B>> {
    let h = c.hidden_size;
    let a = format!("{p}.self_attn.q_proj.weight");
    let qd = c.num_heads * c.head_dim;
    let (q, gate) = match w.is_dummy() {
        true => (
            None,
            b.random_linear(&[qd], h, Stack::Concat, Rounding::Coarse)?,
        ),
        false => {
            let (q, gate) = split_q_gate(w, &a, c.num_heads, c.head_dim, h)?;
            (
                Some(q),
                b.linear(vec![gate], Stack::Concat, Rounding::Coarse)?,
            )
        }
    };
    let zc = NormWeights::OffsetByOne;
    Ok(Mixer::Attention(
        Attention::load_with_q(b, w, p, h, spec, zc, q)?,
        gate,
    ))
}

impl<B: Backend> Layer<B> {
    /// Layer `p` around `mixer`; `index` decides a mixture-of-experts MLP.
    fn load(
        b: &B,
        w: &mut WeightSource,
        p: &str,
        index: usize,
        c: &ModelConfig,
        mixer: Mixer<B>,
        moe: Option<&MoeConfig>,
    ) -> Result<Self> {
        let (h, zc) = (c.hidden_size, NormWeights::OffsetByOne);
        Ok(Self {
            input_norm: norm(b, w, &format!("{p}.input_layernorm.weight"), h, zc)?,
            mixer,
            ffn_norm: norm(b, w, &format!("{p}.post_attention_layernorm.weight"), h, zc)?,
            ffn: Ffn::load(b, w, p, index, h, c.intermediate_size, moe)?,
        })
    }

    fn bytes(&self, b: &B) -> usize {
        let mixer = match &self.mixer {
            Mixer::Attention(a, g) => a.bytes(b) + b.linear_bytes(g),
            Mixer::Linear(m) => b.linear_bytes(&m.in_proj) + b.linear_bytes(&m.out),
        };
        mixer + self.ffn.bytes(b)
    }
}

impl<B: Backend> Mtp<B> {
    fn load(
        b: &B,
        w: &mut WeightSource,
        c: &ModelConfig,
        spec: AttentionSpec,
        moe: Option<&MoeConfig>,
    ) -> Result<Self> {
        let (h, zc) = (c.hidden_size, NormWeights::OffsetByOne);
        let fc = w.shaped(MTP_FC, &[h, 2 * h])?.dequantize(&Device::Cpu)?;
        let half = |at: usize| -> Result<B::Linear> {
            let t = host(fc.narrow(1, at, h)?)?;
            b.linear(vec![t], Stack::Concat, Rounding::Coarse)
        };
        // vLLM builds the layer as `mtp.layers.0`: its MLP is of layer 0's kind.
        let p = "mtp.layers.0";
        let mixer = gated_attention(b, w, p, c, spec)?;
        Ok(Self {
            norm_embedding: norm(b, w, "mtp.pre_fc_norm_embedding.weight", h, zc)?,
            norm_hidden: norm(b, w, "mtp.pre_fc_norm_hidden.weight", h, zc)?,
            fc_embedding: half(0)?,
            fc_hidden: half(h)?,
            layer: Layer::load(b, w, p, 0, c, mixer, moe)?,
            norm: norm(b, w, "mtp.norm.weight", h, zc)?,
        })
    }
}

impl<B: Backend> Family<B> for Hybrid<B> {
    fn forward(
        &self,
        b: &mut B,
        s: &Step<B>,
        cache: &mut [B::LayerCache],
        states: &mut [B::StateCache],
        ws: &mut Buffers<B>,
    ) -> Result<()> {
        let eps = self.config.common.rms_norm_eps;
        b.embed(s, &self.embedding, None, &mut ws.x)?;
        for l in &self.layers {
            self.layer(b, s, l, cache, states, ws)?;
        }
        output(b, s, &ws.x, &self.final_norm, eps, &self.lm_head, None)
    }

    fn mtp(
        &self,
        b: &mut B,
        s: &Step<B>,
        cache: &mut [B::LayerCache],
        ws: &mut Buffers<B>,
        chained: bool,
    ) -> Result<()> {
        let Some(m) = &self.mtp else {
            bail!("this checkpoint has no multi-token-prediction weights");
        };
        let eps = self.config.common.rms_norm_eps;
        // The hidden state as vLLM hands it to the head: the target's after its final norm,
        // or the head's own after its norm (a chained draft), at the rows this step continues.
        let norm = if chained { &m.norm } else { &self.final_norm };
        b.rms_norm_rows(&ws.x, &s.host.hidden.rows, norm, eps, &mut ws.tmp.attn)?;
        let hidden = LinearIn::RmsNorm {
            x: &ws.tmp.attn,
            norm: &m.norm_hidden,
            eps,
        };
        b.matmul(
            hidden,
            &m.fc_hidden,
            Epilogue::StoreResidual(&mut ws.tmp.act),
        )?;
        b.embed(s, &self.embedding, None, &mut ws.x)?;
        let embedded = LinearIn::RmsNorm {
            x: &ws.x,
            norm: &m.norm_embedding,
            eps,
        };
        b.matmul(
            embedded,
            &m.fc_embedding,
            Epilogue::AddInto(&mut ws.tmp.act),
        )?;
        std::mem::swap(&mut ws.x, &mut ws.tmp.act);
        self.layer(b, s, &m.layer, cache, &mut [], ws)?;
        output(b, s, &ws.x, &m.norm, eps, &self.lm_head, None)
    }

    fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    fn weight_bytes(&self, b: &B) -> usize {
        let mtp = self.mtp.iter().map(|m| {
            m.layer.bytes(b) + b.linear_bytes(&m.fc_embedding) + b.linear_bytes(&m.fc_hidden)
        });
        let layers = self.layers.iter().map(|l| l.bytes(b)).chain(mtp);
        weight_bytes(b, &self.embedding, &self.lm_head, layers)
    }

    fn expert_bytes(&self, b: &B) -> MoeBytes {
        let mtp = self.mtp.iter().map(|m| &m.layer);
        let layers = self.layers.iter().chain(mtp).map(|l| l.ffn.expert_bytes(b));
        layers.fold(MoeBytes::default(), |a, l| a + l)
    }

    fn state_layers(&self) -> Vec<GdnSpec> {
        self.config.state_layers()
    }
}
