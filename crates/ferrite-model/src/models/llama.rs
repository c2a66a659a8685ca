//! The Llama family: Llama 2/3 (with `rope_scaling`), SmolLM, Mistral (sliding window),
//! Qwen2 (QKV bias) and Qwen3 (Q/K norm). Pre-norm blocks, SiLU-gated MLP; what a member
//! adds is found in its weights (biases, Q/K norms) and its config; Mixtral, Qwen2-MoE and
//! Qwen3-MoE are the same blocks with experts in place of the MLP.

use super::family::{Buffers, Family};
use super::layers::{
    add_row_parallel, embed, embedding, lm_head, norm, output, Attention, NormWeights,
};
use super::moe::{Ffn, MoeConfig};
use crate::backend::{AttentionSpec, Backend, LinearIn, MoeBytes, Step};
use crate::config::{ModelConfig, RopeScaling};
use crate::rope::RopeSpec;
use crate::weights::config_source::ConfigSource;
use crate::weights::WeightSource;
use anyhow::Result;
use ferrite_core::kv_layout::KvLayout;

pub fn config(src: &ConfigSource) -> Result<ModelConfig> {
    // llama.cpp permutes Llama's and Mistral's Q/K rows for adjacent-pair rotation; Qwen's
    // are kept as they are.
    let permuted = matches!(src.architecture(), "llama" | "mistral" | "mixtral");
    ModelConfig::common(src, permuted)
}

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attn: Attention<B>,
    ffn_norm: B::Vector,
    ffn: Ffn<B>,
}

pub struct Llama<B: Backend> {
    config: ModelConfig,
    /// The first pipeline stage's (every stage's when the model is not split).
    embedding: Option<B::Embedding>,
    /// This stage's layers.
    layers: Vec<Layer<B>>,
    /// The last stage's final norm and LM head.
    head: Option<(B::Vector, B::Linear)>,
    rope: B::Rope,
}

impl<B: Backend> Llama<B> {
    pub fn load(
        b: &B,
        config: ModelConfig,
        moe: Option<MoeConfig>,
        layout: &KvLayout,
        w: &mut WeightSource,
        max_positions: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let c = &config;
        let spec = AttentionSpec {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: c.sliding_window,
            softcap: None,
            causal: true,
            kv_group: 0,
            kv_slot: 0,
        };
        let h = c.hidden_size;
        let stage = b.pipeline_stage();
        let vocab = super::layers::embedding_rows(w)?.unwrap_or(c.vocab_size);
        let embedding = match stage.is_first() {
            true => Some(embedding(b, w, vocab, h)?.0),
            false => None,
        };
        let local = stage.layers(c.num_layers);
        let mut layers = Vec::with_capacity(local.len());
        for i in local {
            let p = format!("model.layers.{i}");
            let plain = NormWeights::Plain;
            layers.push(Layer {
                attn_norm: norm(b, w, &format!("{p}.input_layernorm.weight"), h, plain)?,
                attn: Attention::load(b, w, &p, h, spec.clone().at(layout, i), plain)?,
                ffn_norm: norm(
                    b,
                    w,
                    &format!("{p}.post_attention_layernorm.weight"),
                    h,
                    plain,
                )?,
                ffn: Ffn::load(b, w, &p, i, h, c.intermediate_size, moe.as_ref())?,
            });
            progress(i + 1, c.num_layers);
        }
        let mut rope = RopeSpec::of(c);
        // llama.cpp's converter writes Llama 3's scaling as per-pair divisors.
        if let Some(f) = w.opt_vector("rope_freqs")? {
            rope.scaling = RopeScaling::Factors(f);
        }
        let head = match stage.is_last() {
            true => Some((
                norm(b, w, "model.norm.weight", h, NormWeights::Plain)?,
                lm_head(b, w, vocab, h)?,
            )),
            false => None,
        };
        Ok(Self {
            embedding,
            layers,
            head,
            rope: b.rope(&rope, max_positions)?,
            config,
        })
    }
}

impl<B: Backend> Family<B> for Llama<B> {
    fn forward(
        &self,
        b: &mut B,
        s: &Step<B>,
        cache: &mut [B::LayerCache],
        _states: &mut [B::StateCache],
        ws: &mut Buffers<B>,
    ) -> Result<()> {
        let eps = self.config.rms_norm_eps;
        // A later pipeline stage continues the residual stream of the stage before it.
        match &self.embedding {
            Some(e) => embed(b, s, e, None, &mut ws.x)?,
            None => b.recv_prev(&mut ws.x, s.host.num_tokens(), self.config.hidden_size)?,
        }
        for l in &self.layers {
            let lc = &mut cache[l.attn.spec.kv_slot];
            let input = LinearIn::RmsNorm {
                x: &ws.x,
                norm: &l.attn_norm,
                eps,
            };
            l.attn
                .attend(b, s, input, &self.rope, eps, lc, &mut ws.tmp)?;
            let o_in = LinearIn::Plain(&ws.tmp.attn);
            add_row_parallel(b, o_in, &l.attn.o, &mut ws.x)?;
            l.ffn.forward(b, &mut ws.x, &l.ffn_norm, eps, &mut ws.tmp)?;
        }
        match &self.head {
            Some((norm, head)) => output(b, s, &ws.x, norm, eps, head, None),
            None => b.send_next(&ws.x),
        }
    }

    fn weight_bytes(&self, b: &B) -> usize {
        let layers = self.layers.iter().map(|l| l.attn.bytes(b) + l.ffn.bytes(b));
        let embedding = self.embedding.as_ref().map_or(0, |e| b.embedding_bytes(e));
        let head = self.head.as_ref().map_or(0, |h| b.linear_bytes(&h.1));
        embedding + head + layers.sum::<usize>()
    }

    fn expert_bytes(&self, b: &B) -> MoeBytes {
        let layers = self.layers.iter().map(|l| l.ffn.expert_bytes(b));
        layers.fold(MoeBytes::default(), |a, l| a + l)
    }
}
