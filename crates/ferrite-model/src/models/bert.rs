//! BERT encoders (all-MiniLM, BGE, E5 and the sentence-transformers models built on them):
//! word + absolute position + token-type embeddings, post-LayerNorm blocks of bidirectional
//! attention and a GELU MLP, every linear with a bias. Prompts are computed in one step
//! (attention reads the keys after a token too); the step's output is hidden states for
//! pooling, never logits. A cross-encoder (`BertForSequenceClassification`, one label) adds
//! the pooler (dense + tanh) and the classifier: its output is a pair's relevance logit.

use super::family::{Buffers, Family};
use super::layers::{matrix, norm, NormWeights};
use crate::backend::{
    AttentionSpec, Backend, Epilogue, LinearIn, Pointwise, QkvPrep, Rounding, Stack, Step,
};
use crate::config::ModelConfig;
use crate::weights::config_source::ConfigSource;
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use ferrite_core::kv_layout::KvLayout;

/// Whether the checkpoint is a cross-encoder: BERT with a one-label classifier that scores a
/// pair of texts (`BertForSequenceClassification`).
pub fn is_cross_encoder(src: &ConfigSource) -> Result<bool> {
    let heads = src.get("architectures").and_then(|a| a.as_array()).cloned();
    let head = heads
        .iter()
        .flatten()
        .find_map(|a| a.as_str().filter(|a| !a.ends_with("Model")));
    match head {
        None => Ok(false),
        Some("BertForSequenceClassification") => {
            let labels = src
                .get("id2label")
                .and_then(|l| l.as_object())
                .map_or(1, |l| l.len());
            if labels != 1 {
                bail!(
                    "{}: a classifier of {labels} labels; ferrite serves cross-encoders of one \
                     (a relevance score)",
                    src.path().display()
                );
            }
            Ok(true)
        }
        Some(h) => bail!(
            "{}: `{h}` (a BERT with a task head) is not served; ferrite serves BERT encoders \
             (`BertModel`) and cross-encoders (`BertForSequenceClassification`)",
            src.path().display()
        ),
    }
}

pub fn config(src: &ConfigSource) -> Result<ModelConfig> {
    is_cross_encoder(src)?;
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

/// A cross-encoder's head: the pooler (dense + tanh) and the one-label classifier. It runs
/// on every row (a sliver of a layer's work); the `[CLS]` rows' scores are kept.
struct Classifier<B: Backend> {
    pooler: B::Linear,
    pooler_bias: B::Vector,
    out: B::Linear,
    out_bias: B::Vector,
}

pub struct Bert<B: Backend> {
    config: ModelConfig,
    words: B::Embedding,
    positions: B::Embedding,
    types: B::Embedding,
    /// Token type 0's row: steps without pair inputs add it to every token.
    type_0: B::Vector,
    emb_norm: LayerNorm<B>,
    layers: Vec<Layer<B>>,
    classifier: Option<Classifier<B>>,
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

impl<B: Backend> Layer<B> {
    /// Encoder layer `p` (`encoder.layer.N`, under the checkpoint's root).
    fn load(
        b: &B,
        c: &ModelConfig,
        w: &mut WeightSource,
        p: &str,
        spec: AttentionSpec,
    ) -> Result<Self> {
        let (h, inter) = (c.hidden_size, c.intermediate_size);
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
                Rounding::Coarse,
            )
        };
        Ok(Layer {
            qkv: matrix(b, w, &qkv, h, Stack::Concat, Rounding::Fine)?,
            qkv_bias: b.vector(qkv_bias)?,
            spec,
            o: linear(w, "attention.output.dense", h, h)?,
            o_bias: vector(b, w, &format!("{p}.attention.output.dense.bias"), h)?,
            attn_norm: layer_norm(b, w, &format!("{p}.attention.output.LayerNorm"), h)?,
            up: linear(w, "intermediate.dense", inter, h)?,
            up_bias: vector(b, w, &format!("{p}.intermediate.dense.bias"), inter)?,
            down: linear(w, "output.dense", h, inter)?,
            down_bias: vector(b, w, &format!("{p}.output.dense.bias"), h)?,
            out_norm: layer_norm(b, w, &format!("{p}.output.LayerNorm"), h)?,
        })
    }
}

impl<B: Backend> Classifier<B> {
    /// The pooler and classification head of a cross-encoder checkpoint, if it has them.
    fn load(b: &B, w: &mut WeightSource, root: &str, h: usize) -> Result<Option<Self>> {
        Ok(match w.has("classifier.weight") {
            false => None,
            true => {
                let m = |w: &mut WeightSource, name: &str, rows: usize| {
                    matrix(
                        b,
                        w,
                        &[(format!("{name}.weight"), rows)],
                        h,
                        Stack::Concat,
                        Rounding::Coarse,
                    )
                };
                Some(Classifier {
                    pooler: m(w, &format!("{root}pooler.dense"), h)?,
                    pooler_bias: vector(b, w, &format!("{root}pooler.dense.bias"), h)?,
                    out: m(w, "classifier", 1)?,
                    out_bias: vector(b, w, "classifier.bias", 1)?,
                })
            }
        })
    }
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
        let h = c.hidden_size;
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
        let name = format!("{e}.token_type_embeddings.weight");
        let type_rows = w.tensor(&name)?.shape().dims()[0];
        let types = table(w, "token_type_embeddings", type_rows)?;
        let type_0 = w.vector(&name)?[..h].to_vec();
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
            layers.push(Layer::load(b, c, w, &p, spec.clone().at(layout, i))?);
            progress(i + 1, c.num_layers);
        }
        let classifier = Classifier::load(b, w, root, h)?;
        Ok(Self {
            words,
            positions,
            types,
            type_0: b.vector(type_0)?,
            emb_norm: layer_norm(b, w, &format!("{e}.LayerNorm"), h)?,
            layers,
            classifier,
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
        b.add_rows(&self.positions, &s.host.positions, x)?;
        match s.host.pooling.token_types.is_empty() {
            true => b.add_bias(x, &self.type_0, None)?,
            false => b.add_rows(&self.types, &s.host.pooling.token_types, x)?,
        }
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
            b.add_bias(x, &l.o_bias, None)?;
            b.layer_norm(x, &l.attn_norm.weight, &l.attn_norm.bias, eps)?;
            b.matmul(LinearIn::Plain(x), &l.up, Epilogue::Store(&mut t.act))?;
            b.add_bias(&mut t.act, &l.up_bias, Some(Pointwise::Gelu))?;
            b.matmul(LinearIn::Plain(&t.act), &l.down, Epilogue::AddInto(x))?;
            b.add_bias(x, &l.down_bias, None)?;
            b.layer_norm(x, &l.out_norm.weight, &l.out_norm.bias, eps)?;
        }
        let Some(c) = &self.classifier else {
            return b.hidden(s, x, None);
        };
        b.matmul(LinearIn::Plain(x), &c.pooler, Epilogue::Store(&mut t.act))?;
        b.add_bias(&mut t.act, &c.pooler_bias, Some(Pointwise::Tanh))?;
        b.matmul(
            LinearIn::Plain(&t.act),
            &c.out,
            Epilogue::Store(&mut t.attn),
        )?;
        b.add_bias(&mut t.attn, &c.out_bias, None)?;
        b.hidden(s, &t.attn, None)
    }

    fn weight_bytes(&self, b: &B) -> usize {
        let layers = self.layers.iter().map(|l| {
            [&l.qkv, &l.o, &l.up, &l.down]
                .iter()
                .map(|m| b.linear_bytes(m))
                .sum::<usize>()
        });
        let head = self
            .classifier
            .as_ref()
            .map_or(0, |c| b.linear_bytes(&c.pooler) + b.linear_bytes(&c.out));
        b.embedding_bytes(&self.words)
            + b.embedding_bytes(&self.positions)
            + b.embedding_bytes(&self.types)
            + layers.sum::<usize>()
            + head
    }
}
