//! The pieces the decoder families share: the attention block from its input to the output
//! projection's input, the gated MLP's weights, norms, and the weights' byte count.

use super::family::Scratch;
use crate::backend::{AttentionSpec, Backend, Epilogue, LinearIn, QkvPrep, Rounding, Stack, Step};
use crate::weights::shard::Take;
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use candle_core::quantized::QTensor;
use std::ops::Range;

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
    let whole: Vec<_> = parts
        .iter()
        .map(|(n, r)| (n.clone(), *r, Take::All))
        .collect();
    matrix_parts(b, w, &whole, cols, stack, input)
}

/// [`matrix`] with each part `(name, rows, take)` cut to what this rank holds.
pub fn matrix_parts<B: Backend>(
    b: &B,
    w: &mut WeightSource,
    parts: &[(String, usize, Take)],
    cols: usize,
    stack: Stack,
    input: Rounding,
) -> Result<B::Linear> {
    if w.is_dummy() {
        let dims: Vec<_> = parts.iter().map(|(_, r, t)| t.dims(*r, cols)).collect();
        let rows: Vec<usize> = dims.iter().map(|d| d.0).collect();
        return b.random_linear(&rows, dims[0].1, stack, input);
    }
    let parts = parts
        .iter()
        .map(|(name, rows, take)| take.apply(w.shaped(name, &[*rows, cols])?));
    b.linear(parts.collect::<Result<_>>()?, stack, input)
}

/// Rows `heads` of a matrix of heads `d` rows each.
fn head_rows(heads: &Range<usize>, d: usize) -> Range<usize> {
    heads.start * d..heads.end * d
}

/// The embedding of the step's tokens into `x`, summed over the vocabulary shards of a
/// tensor-parallel group.
pub fn embed<B: Backend>(
    b: &mut B,
    s: &Step<B>,
    table: &B::Embedding,
    scale: Option<f32>,
    x: &mut B::Act,
) -> Result<()> {
    b.embed(s, table, scale, x)?;
    match b.tensor_parallel().is_split() {
        true => b.all_reduce(x),
        false => Ok(()),
    }
}

/// `x += input · w` for a row-parallel `w` (each rank holds some of its input columns):
/// one rank adds its part into `x`, the others store theirs, and the all-reduce sums them.
pub fn add_row_parallel<B: Backend>(
    b: &mut B,
    input: LinearIn<B>,
    w: &B::Linear,
    x: &mut B::Act,
) -> Result<()> {
    let tp = b.tensor_parallel();
    if !tp.is_split() {
        return b.matmul(input, w, Epilogue::AddInto(x));
    }
    match tp.rank {
        0 => b.matmul(input, w, Epilogue::AddInto(x))?,
        _ => b.matmul(input, w, Epilogue::StoreResidual(x))?,
    }
    b.all_reduce(x)
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
        // A tensor-parallel rank holds its heads' rows of Q/K/V and columns of O.
        let tp = b.tensor_parallel();
        let (heads, kv_heads) = (tp.heads(spec.num_heads)?, tp.kv_heads(spec.num_kv_heads)?);
        let (q_rows, kv_rows) = (head_rows(&heads, d), head_rows(&kv_heads, d));
        let qkv = [
            ("q_proj", q_w, &q_rows),
            ("k_proj", kv_w, &kv_rows),
            ("v_proj", kv_w, &kv_rows),
        ]
        .map(|(n, rows, take)| (p(&format!("{n}.weight")), rows, Take::Rows(take.clone())));
        let qkv = match q {
            None => matrix_parts(b, w, &qkv, hidden, Stack::Concat, Rounding::Fine)?,
            Some(_) if tp.is_split() => {
                bail!("{prefix}: a gated query is not split across ranks yet")
            }
            Some(q) => {
                let k = w.shaped(&qkv[1].0, &[kv_w, hidden])?;
                let v = w.shaped(&qkv[2].0, &[kv_w, hidden])?;
                b.linear(vec![q, k, v], Stack::Concat, Rounding::Fine)?
            }
        };
        let bias = match w.opt_vector(&p("q_proj.bias"))? {
            Some(q) => {
                let (k, v) = (w.vector(&p("k_proj.bias"))?, w.vector(&p("v_proj.bias"))?);
                if q.len() + k.len() + v.len() != q_w + 2 * kv_w {
                    bail!(
                        "{prefix}: Q/K/V biases hold {} values",
                        q.len() + k.len() + v.len()
                    );
                }
                let mut all = q[q_rows.clone()].to_vec();
                all.extend(&k[kv_rows.clone()]);
                all.extend(&v[kv_rows]);
                Some(b.vector(all)?)
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
                bail!(
                    "{prefix}: {} attention sinks for {} heads",
                    v.len(),
                    spec.num_heads
                )
            }
            v => v.map(|v| b.vector(v[heads.clone()].to_vec())).transpose()?,
        };
        Ok(Self {
            sinks,
            q_norm: qk_norm(w, "q_norm")?,
            k_norm: qk_norm(w, "k_norm")?,
            qkv,
            bias,
            o: matrix_parts(
                b,
                w,
                &[(p("o_proj.weight"), hidden, Take::Cols(q_rows))],
                q_w,
                Stack::Concat,
                Rounding::Coarse,
            )?,
            spec: AttentionSpec {
                num_heads: heads.len(),
                num_kv_heads: kv_heads.len(),
                ..spec
            },
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
        // A tensor-parallel rank holds its span of the width: gate/up rows, down columns.
        let span = b.tensor_parallel().span(inter, "MLP columns")?;
        let gate_up = ["gate_proj", "up_proj"].map(|n| (p(n), inter, Take::Rows(span.clone())));
        Ok(Self {
            gate_up: matrix_parts(b, w, &gate_up, hidden, Stack::GateUp, Rounding::Coarse)?,
            down: matrix_parts(
                b,
                w,
                &[(p("down_proj"), hidden, Take::Cols(span))],
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

/// The embedding table, `[vocab, hidden]` for some vocabulary (a tensor-parallel rank's
/// shard of its rows), and that vocabulary's size (`vocab`, the config's, for random
/// weights).
pub fn embedding<B: Backend>(
    b: &B,
    w: &mut WeightSource,
    vocab: usize,
    hidden: usize,
) -> Result<(B::Embedding, usize)> {
    let tp = b.tensor_parallel();
    if w.is_dummy() && !tp.is_split() {
        return Ok((b.random_embedding(vocab, hidden)?, vocab));
    }
    if w.is_dummy() {
        let rows = tp.vocab_rows(vocab);
        let table = crate::backend::random_matrix(rows, hidden)?;
        return Ok((b.vocab_embedding(table, tp.vocab(vocab).start)?, vocab));
    }
    let t = w.tensor("model.embed_tokens.weight")?;
    if t.shape().dims().get(1) != Some(&hidden) || t.shape().dims().len() != 2 {
        bail!(
            "the embedding table is {:?}, the config implies [vocab, {hidden}]",
            t.shape().dims()
        );
    }
    let vocab = t.shape().dims()[0];
    let rows = tp.vocab(vocab);
    let first = rows.start;
    Ok((b.vocab_embedding(Take::Rows(rows).apply(t)?, first)?, vocab))
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
    let rows = Take::Rows(b.tensor_parallel().vocab(vocab));
    matrix_parts(
        b,
        w,
        &[(name.to_string(), vocab, rows)],
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
    match s.host.pooling.on {
        true => b.hidden(s, x, Some((norm, eps))),
        false => b.logits(s, x, norm, eps, head, softcap),
    }
}

/// The vocabulary as the embedding table counts it.
pub(crate) fn embedding_rows(w: &WeightSource) -> Result<Option<usize>> {
    Ok(match w {
        WeightSource::Gguf { file, .. } => file
            .content
            .tensor_infos
            .get("token_embd.weight")
            .map(|t| t.shape.dims()[0]),
        WeightSource::Safetensors { files, .. } => files
            .get(&w.stored_name("model.embed_tokens.weight"))
            .ok()
            .map(|t| t.shape()[0]),
        WeightSource::Dummy => None,
    })
}
