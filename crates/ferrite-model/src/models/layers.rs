//! The pieces the decoder families share: the attention block from its input to the output
//! projection's input, the gated MLP's weights, norms, and the weights' byte count.

use super::Scratch;
use crate::backend::{AttentionSpec, Backend, Epilogue, LinearIn, QkvPrep, Stack, Step};
use crate::weights::WeightSource;
use anyhow::Result;

/// How a checkpoint stores RMSNorm weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormWeights {
    /// `x * w`.
    Plain,
    /// `x * (1 + w)` (Gemma): 1 is added at load, so every norm multiplies by what it holds.
    /// llama.cpp's converter adds it already, so GGUF files take it as `Plain`.
    OffsetByOne,
}

/// An RMSNorm weight vector on the backend.
pub fn norm<B: Backend>(
    b: &B,
    w: &mut WeightSource,
    name: &str,
    kind: NormWeights,
) -> Result<B::Vector> {
    let mut v = w.vector(name)?;
    if kind == NormWeights::OffsetByOne && !w.is_gguf() {
        v.iter_mut().for_each(|x| *x += 1.0);
    }
    b.vector(v)
}

pub struct Attention<B: Backend> {
    /// Q|K|V.
    pub qkv: B::Linear,
    pub bias: Option<B::Vector>,
    /// Per-head RMSNorm of Q and K (Qwen3, Gemma 3), `[head_dim]`.
    pub q_norm: Option<B::Vector>,
    pub k_norm: Option<B::Vector>,
    pub o: B::Linear,
    pub spec: AttentionSpec,
}

impl<B: Backend> Attention<B> {
    /// Layer `prefix` (`model.layers.N`); biases and Q/K norms where the checkpoint has them.
    pub fn load(
        b: &B,
        w: &mut WeightSource,
        prefix: &str,
        spec: AttentionSpec,
        norms: NormWeights,
    ) -> Result<Self> {
        let p = |n: &str| format!("{prefix}.self_attn.{n}");
        let qkv = ["q_proj", "k_proj", "v_proj"]
            .iter()
            .map(|n| w.tensor(&p(&format!("{n}.weight"))))
            .collect::<Result<Vec<_>>>()?;
        let bias = match w.opt_vector(&p("q_proj.bias"))? {
            Some(mut q) => {
                q.extend(w.vector(&p("k_proj.bias"))?);
                q.extend(w.vector(&p("v_proj.bias"))?);
                Some(b.vector(q)?)
            }
            None => None,
        };
        let qk_norm = |w: &mut WeightSource, n: &str| -> Result<Option<B::Vector>> {
            let name = p(&format!("{n}.weight"));
            if w.has(&name) {
                norm(b, w, &name, norms).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(Self {
            q_norm: qk_norm(w, "q_norm")?,
            k_norm: qk_norm(w, "k_norm")?,
            qkv: b.linear(qkv, Stack::Concat)?,
            bias,
            o: b.linear(vec![w.tensor(&p("o_proj.weight"))?], Stack::Concat)?,
            spec,
        })
    }

    /// Q/K/V of `input`, K/V into `cache`, attention into `ws.attn` (the input of `o`).
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        b: &mut B,
        s: &Step<B>,
        input: LinearIn<B>,
        rope: &B::Rope,
        eps: f32,
        cache: &mut B::LayerCache,
        ws: &mut Scratch<B>,
    ) -> Result<()> {
        b.matmul(input, &self.qkv, Epilogue::Store(&mut ws.qkv))?;
        let prep = QkvPrep {
            bias: self.bias.as_ref(),
            q_norm: self.q_norm.as_ref(),
            k_norm: self.k_norm.as_ref(),
            eps,
            rope,
        };
        b.prepare_qkv(s, &ws.qkv, &prep, &self.spec, cache, &mut ws.q)?;
        b.attention(s, &ws.q, cache, &self.spec, &mut ws.attn)
    }

    pub fn bytes(&self, b: &B) -> usize {
        b.linear_bytes(&self.qkv) + b.linear_bytes(&self.o)
    }
}

pub struct Mlp<B: Backend> {
    pub gate_up: B::Linear,
    pub down: B::Linear,
}

impl<B: Backend> Mlp<B> {
    pub fn load(b: &B, w: &mut WeightSource, prefix: &str) -> Result<Self> {
        let p = |n: &str| format!("{prefix}.mlp.{n}.weight");
        let gate_up = vec![w.tensor(&p("gate_proj"))?, w.tensor(&p("up_proj"))?];
        Ok(Self {
            gate_up: b.linear(gate_up, Stack::GateUp)?,
            down: b.linear(vec![w.tensor(&p("down_proj"))?], Stack::Concat)?,
        })
    }

    pub fn bytes(&self, b: &B) -> usize {
        b.linear_bytes(&self.gate_up) + b.linear_bytes(&self.down)
    }
}

/// The LM head: its own matrix, or the embedding's when tied.
pub fn lm_head<B: Backend>(b: &B, w: &mut WeightSource) -> Result<B::Linear> {
    let t = match w.opt_tensor("lm_head.weight")? {
        Some(t) => t,
        None => w.tensor("model.embed_tokens.weight")?,
    };
    b.linear(vec![t], Stack::Concat)
}
