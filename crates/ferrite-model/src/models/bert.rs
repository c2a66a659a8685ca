//! BERT encoders (all-MiniLM, BGE, E5 and the sentence-transformers models built on them):
//! word + absolute position + token-type embeddings, post-LayerNorm blocks of bidirectional
//! attention and a GELU MLP, every linear with a bias. Prompts are computed in one step
//! (attention reads the keys after a token too); the step's output is hidden states for
//! pooling, never logits.

use super::layers::{matrix, norm, NormWeights};
use super::{Buffers, Family};
use crate::backend::{AttentionSpec, Backend, Epilogue, LinearIn, QkvPrep, Stack, Step};
use crate::config::ModelConfig;
use crate::weights::config_source::ConfigSource;
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use ferrite_core::kv_layout::KvLayout;

pub fn config(src: &ConfigSource) -> Result<ModelConfig> {
    let heads = src.get("architectures").and_then(|a| a.as_array()).cloned();
    if let Some(h) = heads
        .iter()
        .flatten()
        .find_map(|a| a.as_str().filter(|a| !a.ends_with("Model")))
    {
        bail!(
            "{}: `{h}` (a BERT with a task head) is not served; ferrite serves BERT encoders as \
             embedding models (`BertModel`)",
            src.path().display()
        );
    }
    let mut c = ModelConfig::common(src, false)?;
    c.rms_norm_eps = src.opt_f32("layer_norm_eps").unwrap_or(1e-12);
    if src
        .opt_usize("num_key_value_heads")
        .is_some_and(|k| k != c.num_heads)
    {
        bail!("{}: BERT attends with every head", src.path().display());
    }
    Ok(c)
}

/// A LayerNorm's weight and bias.
struct LayerNorm<B: Backend> {
    weight: B::Vector,
    bias: B::Vector,
}

struct Layer<B: Backend> {
    qkv: B::Linear,
    qkv_bias: B::Vector,
    spec: AttentionSpec,
    o: B::Linear,
    o_bias: B::Vector,
    attn_norm: LayerNorm<B>,
    up: B::Linear,
    up_bias: B::Vector,
    down: B::Linear,
    down_bias: B::Vector,
    out_norm: LayerNorm<B>,
}

pub struct Bert<B: Backend> {
    config: ModelConfig,
    words: B::Embedding,
    positions: B::Embedding,
    /// Token type 0's row (one segment: embedding inputs have no second sentence).
    token_type: B::Vector,
    emb_norm: LayerNorm<B>,
    layers: Vec<Layer<B>>,
}

fn vector<B: Backend>(b: &B, w: &mut WeightSource, name: &str, len: usize) -> Result<B::Vector> {
    norm(b, w, name, len, NormWeights::Plain)
}

fn layer_norm<B: Backend>(b: &B, w: &mut WeightSource, p: &str, h: usize) -> Result<LayerNorm<B>> {
    Ok(LayerNorm {
        weight: vector(b, w, &format!("{p}.weight"), h)?,
        bias: vector(b, w, &format!("{p}.bias"), h)?,
    })
}

impl<B: Backend> Bert<B> {
    pub fn load(
        b: &B,
        config: ModelConfig,
        layout: &KvLayout,
        w: &mut WeightSource,
        max_positions: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        if w.is_dummy() {
            bail!("BERT loads from its checkpoint only (no --load-format dummy)");
        }
        let c = &config;
        if max_positions > c.context_length {
            bail!(
                "BERT's position embeddings end at {}: --max-model-len {max_positions} is past \
                 them",
                c.context_length
            );
        }
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        // BertModel checkpoints name tensors from `embeddings.`; task heads' from `bert.`.
        let root = match w.has("bert.embeddings.word_embeddings.weight") {
            true => "bert.",
            false => "",
        };
        let e = format!("{root}embeddings");
        let table = |w: &mut WeightSource, name: &str, rows: usize| -> Result<B::Embedding> {
            b.embedding(w.shaped(&format!("{e}.{name}.weight"), &[rows, h])?)
        };
        let words = table(w, "word_embeddings", c.vocab_size)?;
        let positions = table(w, "position_embeddings", c.context_length)?;
        let types = w.vector(&format!("{e}.token_type_embeddings.weight"))?;
        if types.len() < h {
            bail!("{}: no token type embedding", w.location());
        }
        let spec = AttentionSpec {
            num_heads: c.num_heads,
            num_kv_heads: c.num_heads,
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: None,
            softcap: None,
            causal: false,
            kv_group: 0,
            kv_slot: 0,
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("{root}encoder.layer.{i}");
            let a = format!("{p}.attention.self");
            let qkv: Vec<(String, usize)> = ["query", "key", "value"]
                .iter()
                .map(|n| (format!("{a}.{n}.weight"), h))
                .collect();
            let mut qkv_bias = Vec::with_capacity(3 * h);
            for n in ["query", "key", "value"] {
                qkv_bias.extend(w.vector(&format!("{a}.{n}.bias"))?);
            }
            let linear = |w: &mut WeightSource, name: &str, rows: usize, cols: usize| {
                matrix(
                    b,
                    w,
                    &[(format!("{p}.{name}.weight"), rows)],
                    cols,
                    Stack::Concat,
                )
            };
            layers.push(Layer {
                qkv: matrix(b, w, &qkv, h, Stack::Concat)?,
                qkv_bias: b.vector(qkv_bias)?,
                spec: spec.clone().at(layout, i),
                o: linear(w, "attention.output.dense", h, h)?,
                o_bias: vector(b, w, &format!("{p}.attention.output.dense.bias"), h)?,
                attn_norm: layer_norm(b, w, &format!("{p}.attention.output.LayerNorm"), h)?,
                up: linear(w, "intermediate.dense", inter, h)?,
                up_bias: vector(b, w, &format!("{p}.intermediate.dense.bias"), inter)?,
                down: linear(w, "output.dense", h, inter)?,
                down_bias: vector(b, w, &format!("{p}.output.dense.bias"), h)?,
                out_norm: layer_norm(b, w, &format!("{p}.output.LayerNorm"), h)?,
            });
            progress(i + 1, c.num_layers);
        }
        Ok(Self {
            words,
            positions,
            token_type: b.vector(types[..h].to_vec())?,
            emb_norm: layer_norm(b, w, &format!("{e}.LayerNorm"), h)?,
            layers,
            config,
        })
    }
}

impl<B: Backend> Family<B> for Bert<B> {
    fn forward(
        &self,
        b: &mut B,
        s: &Step<B>,
        cache: &mut [B::LayerCache],
        _states: &mut [B::StateCache],
        ws: &mut Buffers<B>,
    ) -> Result<()> {
        let eps = self.config.rms_norm_eps;
        let x = &mut ws.x;
        b.embed(s, &self.words, None, x)?;
        b.add_positions(s, &self.positions, x)?;
        b.add_bias(x, &self.token_type, false)?;
        b.layer_norm(x, &self.emb_norm.weight, &self.emb_norm.bias, eps)?;
        let t = &mut ws.tmp;
        for l in &self.layers {
            let lc = &mut cache[l.spec.kv_slot];
            b.matmul(LinearIn::Plain(x), &l.qkv, Epilogue::Store(&mut t.qkv))?;
            let prep = QkvPrep {
                bias: Some(&l.qkv_bias),
                q_norm: None,
                k_norm: None,
                eps,
                rope: None,
            };
            b.prepare_qkv(s, &t.qkv, &prep, &l.spec, lc, &mut t.q)?;
            b.attention(s, &t.q, lc, &l.spec, None, &mut t.attn)?;
            b.matmul(LinearIn::Plain(&t.attn), &l.o, Epilogue::AddInto(x))?;
            b.add_bias(x, &l.o_bias, false)?;
            b.layer_norm(x, &l.attn_norm.weight, &l.attn_norm.bias, eps)?;
            b.matmul(LinearIn::Plain(x), &l.up, Epilogue::Store(&mut t.act))?;
            b.add_bias(&mut t.act, &l.up_bias, true)?;
            b.matmul(LinearIn::Plain(&t.act), &l.down, Epilogue::AddInto(x))?;
            b.add_bias(x, &l.down_bias, false)?;
            b.layer_norm(x, &l.out_norm.weight, &l.out_norm.bias, eps)?;
        }
        b.hidden(s, x, None)
    }

    fn weight_bytes(&self, b: &B) -> usize {
        let layers = self.layers.iter().map(|l| {
            [&l.qkv, &l.o, &l.up, &l.down]
                .iter()
                .map(|m| b.linear_bytes(m))
                .sum::<usize>()
        });
        b.embedding_bytes(&self.words) + b.embedding_bytes(&self.positions) + layers.sum::<usize>()
    }
}
