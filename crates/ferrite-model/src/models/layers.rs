//! The pieces the decoder families share: the attention block from its input to the output
//! projection's input, the gated MLP's weights, norms, and the weights' byte count.

use super::Scratch;
use crate::backend::{AttentionSpec, Backend, Epilogue, LinearIn, QkvPrep, Rounding, Stack, Step};
use crate::weights::WeightSource;
use anyhow::Result;
use candle_core::quantized::QTensor;

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
    len: usize,
    kind: NormWeights,
) -> Result<B::Vector> {
    if w.is_dummy() {
        return b.vector(vec![1.0; len]);
    }
    let mut v = w.vector(name)?;
    if v.len() != len {
        anyhow::bail!(
            "norm `{name}` has {} weights, the config implies {len}",
            v.len()
        );
    }
    if kind == NormWeights::OffsetByOne && !w.is_gguf() {
        v.iter_mut().for_each(|x| *x += 1.0);
    }
    b.vector(v)
}

/// The matrices `parts` (name, rows), each `cols` wide, as one weight stacked as `stack`
/// reading an input rounded as `input`; random ones of those shapes for `--load-format dummy`.
pub fn matrix<B: Backend>(
    b: &B,
    w: &mut WeightSource,
    parts: &[(String, usize)],
    cols: usize,
    stack: Stack,
    input: Rounding,
) -> Result<B::Linear> {
    if w.is_dummy() {
        let rows: Vec<usize> = parts.iter().map(|p| p.1).collect();
        return b.random_linear(&rows, cols, stack, input);
    }
    let parts = parts
        .iter()
        .map(|(name, rows)| w.shaped(name, &[*rows, cols]));
    b.linear(parts.collect::<Result<_>>()?, stack, input)
}

pub struct Attention<B: Backend> {
    /// Q|K|V.
    pub qkv: B::Linear,
    pub bias: Option<B::Vector>,
    /// Per-head RMSNorm of Q and K (Qwen3, Gemma 3), `[head_dim]`.
    pub q_norm: Option<B::Vector>,
    pub k_norm: Option<B::Vector>,
    /// Attention sinks, `[num_heads]` (gpt-oss).
    pub sinks: Option<B::Vector>,
    pub o: B::Linear,
    pub spec: AttentionSpec,
}

impl<B: Backend> Attention<B> {
    /// Layer `prefix` (`model.layers.N`); biases and Q/K norms where the checkpoint has them.
    /// `hidden`: the residual stream's width.
    pub fn load(
        b: &B,
        w: &mut WeightSource,
        prefix: &str,
        hidden: usize,
        spec: AttentionSpec,
        norms: NormWeights,
    ) -> Result<Self> {
        Self::load_with_q(b, w, prefix, hidden, spec, norms, None)
    }

    /// The same with the Q matrix given (`None`: read as `q_proj`).
    pub fn load_with_q(
        b: &B,
        w: &mut WeightSource,
        prefix: &str,
        hidden: usize,
        spec: AttentionSpec,
        norms: NormWeights,
        q: Option<QTensor>,
    ) -> Result<Self> {
        let p = |n: &str| format!("{prefix}.self_attn.{n}");
        let d = spec.head_dim;
        let (q_w, kv_w) = (spec.num_heads * d, spec.num_kv_heads * d);
        let qkv = [("q_proj", q_w), ("k_proj", kv_w), ("v_proj", kv_w)]
            .map(|(n, rows)| (p(&format!("{n}.weight")), rows));
        let qkv = match q {
            None => matrix(b, w, &qkv, hidden, Stack::Concat, Rounding::Fine)?,
            Some(q) => {
                let k = w.shaped(&qkv[1].0, &[kv_w, hidden])?;
                let v = w.shaped(&qkv[2].0, &[kv_w, hidden])?;
                b.linear(vec![q, k, v], Stack::Concat, Rounding::Fine)?
            }
        };
        let bias = match w.opt_vector(&p("q_proj.bias"))? {
            Some(mut q) => {
                q.extend(w.vector(&p("k_proj.bias"))?);
                q.extend(w.vector(&p("v_proj.bias"))?);
                if q.len() != q_w + 2 * kv_w {
                    anyhow::bail!("{prefix}: Q/K/V biases hold {} values", q.len());
                }
                Some(b.vector(q)?)
            }
            None => None,
        };
        let qk_norm = |w: &mut WeightSource, n: &str| -> Result<Option<B::Vector>> {
            let name = p(&format!("{n}.weight"));
            if w.has(&name) {
                norm(b, w, &name, d, norms).map(Some)
            } else {
                Ok(None)
            }
        };
        let sinks = match w.opt_vector(&p("sinks"))? {
            Some(v) if v.len() != spec.num_heads => {
                anyhow::bail!(
                    "{prefix}: {} attention sinks for {} heads",
                    v.len(),
                    spec.num_heads
                )
            }
            v => v.map(|v| b.vector(v)).transpose()?,
        };
        Ok(Self {
            sinks,
            q_norm: qk_norm(w, "q_norm")?,
            k_norm: qk_norm(w, "k_norm")?,
            qkv,
            bias,
            o: matrix(
                b,
                w,
                &[(p("o_proj.weight"), hidden)],
                q_w,
                Stack::Concat,
                Rounding::Coarse,
            )?,
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
            rope: Some(rope),
        };
        b.prepare_qkv(s, &ws.qkv, &prep, &self.spec, cache, &mut ws.q)?;
        b.attention(
            s,
            &ws.q,
            cache,
            &self.spec,
            self.sinks.as_ref(),
            &mut ws.attn,
        )
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
    pub fn load(
        b: &B,
        w: &mut WeightSource,
        prefix: &str,
        hidden: usize,
        inter: usize,
    ) -> Result<Self> {
        let p = |n: &str| format!("{prefix}.mlp.{n}.weight");
        let gate_up = [(p("gate_proj"), inter), (p("up_proj"), inter)];
        Ok(Self {
            gate_up: matrix(b, w, &gate_up, hidden, Stack::GateUp, Rounding::Coarse)?,
            down: matrix(
                b,
                w,
                &[(p("down_proj"), hidden)],
                inter,
                Stack::Concat,
                Rounding::Coarse,
            )?,
        })
    }

    pub fn bytes(&self, b: &B) -> usize {
        b.linear_bytes(&self.gate_up) + b.linear_bytes(&self.down)
    }
}

/// The embedding table, `[vocab, hidden]` for some vocabulary, and that vocabulary's size
/// (`vocab`, the config's, for random weights).
pub fn embedding<B: Backend>(
    b: &B,
    w: &mut WeightSource,
    vocab: usize,
    hidden: usize,
) -> Result<(B::Embedding, usize)> {
    if w.is_dummy() {
        return Ok((b.random_embedding(vocab, hidden)?, vocab));
    }
    let t = w.tensor("model.embed_tokens.weight")?;
    if t.shape().dims().get(1) != Some(&hidden) || t.shape().dims().len() != 2 {
        anyhow::bail!(
            "the embedding table is {:?}, the config implies [vocab, {hidden}]",
            t.shape().dims()
        );
    }
    let vocab = t.shape().dims()[0];
    Ok((b.embedding(t)?, vocab))
}

/// The LM head: its own matrix, or the embedding's when tied; `[vocab, hidden]`.
pub fn lm_head<B: Backend>(
    b: &B,
    w: &mut WeightSource,
    vocab: usize,
    hidden: usize,
) -> Result<B::Linear> {
    let name = match w.has("lm_head.weight") {
        true => "lm_head.weight",
        false => "model.embed_tokens.weight",
    };
    matrix(
        b,
        w,
        &[(name.to_string(), vocab)],
        hidden,
        Stack::Concat,
        Rounding::Fine,
    )
}

/// Bytes of a decoder's matrices on the device, given each layer's (norms and biases are
/// noise beside them).
pub fn weight_bytes<B: Backend>(
    b: &B,
    embedding: &B::Embedding,
    lm_head: &B::Linear,
    layers: impl Iterator<Item = usize>,
) -> usize {
    b.embedding_bytes(embedding) + b.linear_bytes(lm_head) + layers.sum::<usize>()
}

/// A decoder step's end: the logits of its sampled rows, or, in a pooling step (embedding
/// models), those rows' final-normed hidden states.
pub fn output<B: Backend>(
    b: &mut B,
    s: &Step<B>,
    x: &B::Act,
    norm: &B::Vector,
    eps: f32,
    head: &B::Linear,
    softcap: Option<f32>,
) -> Result<()> {
    match s.host.pooling {
        true => b.hidden(s, x, Some((norm, eps))),
        false => b.logits(s, x, norm, eps, head, softcap),
    }
}
