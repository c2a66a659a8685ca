//! Gemma 2 and Gemma 3 (text): RMSNorms before and after both attention and MLP, a
//! GELU-tanh gated MLP, the embedding scaled by sqrt(hidden), local (sliding-window) layers
//! interleaved with global ones, each with its own rotary base; Gemma 2 soft-caps attention
//! scores and final logits, Gemma 3 normalizes Q and K per head instead.

use super::family::{Buffers, Family};
use super::layers::{embedding, lm_head, norm, output, weight_bytes, Attention, Mlp, NormWeights};
use crate::backend::{Activation, AttentionSpec, Backend, Epilogue, LinearIn, Step};
use crate::config::{rope_scaling, ModelConfig, RopeScaling};
use crate::rope::RopeSpec;
use crate::weights::config_source::ConfigSource;
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use ferrite_core::kv_layout::KvLayout;

pub struct GemmaConfig {
    pub common: ModelConfig,
    /// Per layer: attends within `window` keys (local) or to the whole context (global).
    pub local: Vec<bool>,
    pub window: usize,
    /// Rotary base of the local layers (the global ones use `common.rope_theta`).
    pub local_rope_theta: f32,
    /// Attention scores are scaled by `query_pre_attn_scalar ^ -0.5`.
    pub query_pre_attn_scalar: f32,
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
}

impl GemmaConfig {
    pub fn read(src: &ConfigSource) -> Result<Self> {
        let mut common = ModelConfig::common(src, false)?;
        let gemma2 = src.architecture() == "gemma2";
        let n = common.num_layers;
        let local: Vec<bool> = match src.get("layer_types").and_then(|v| v.as_array()) {
            Some(types) => types
                .iter()
                .map(|t| t.as_str() == Some("sliding_attention"))
                .collect(),
            // Gemma 2 alternates local and global from layer 0; Gemma 3 has five local
            // layers to a global one (llama.cpp's GGUFs store neither).
            None if gemma2 => (0..n).map(|i| i % 2 == 0).collect(),
            None => {
                let pattern = src.opt_usize("sliding_window_pattern").unwrap_or(6);
                (0..n).map(|i| (i + 1) % pattern != 0).collect()
            }
        };
        if local.len() != n {
            bail!("{} layer types for {n} layers", local.len());
        }
        let window = src
            .opt_usize("sliding_window")
            .ok_or_else(|| src.unsupported("Gemma without `sliding_window`"))?;
        let theta = |layer: &str| src.opt_f32(&format!("rope_parameters.{layer}.rope_theta"));
        if let Some(t) = theta("full_attention") {
            common.rope_theta = t;
            common.rope_scaling = rope_scaling(src, &["rope_parameters.full_attention"])?;
        }
        let local_rope_theta = theta("sliding_attention")
            .or_else(|| src.opt_f32("rope_local_base_freq"))
            .unwrap_or(if gemma2 { common.rope_theta } else { 10_000.0 });
        let cap = |k: &str| src.opt_f32(k).filter(|&c| c > 0.0);
        common.sliding_window = None;
        common.layer_windows = local.iter().map(|&l| l.then_some(window)).collect();
        Ok(Self {
            query_pre_attn_scalar: src
                .opt_f32("query_pre_attn_scalar")
                .unwrap_or(common.head_dim as f32),
            attn_softcap: cap("attn_logit_softcapping"),
            final_softcap: cap("final_logit_softcapping"),
            local,
            window,
            local_rope_theta,
            common,
        })
    }
}

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attn: Attention<B>,
    post_attn_norm: B::Vector,
    ffn_norm: B::Vector,
    mlp: Mlp<B>,
    post_ffn_norm: B::Vector,
    local: bool,
}

pub struct Gemma<B: Backend> {
    eps: f32,
    embed_scale: f32,
    final_softcap: Option<f32>,
    embedding: B::Embedding,
    layers: Vec<Layer<B>>,
    final_norm: B::Vector,
    lm_head: B::Linear,
    global_rope: B::Rope,
    local_rope: B::Rope,
}

impl<B: Backend> Gemma<B> {
    pub fn load(
        b: &B,
        gc: GemmaConfig,
        layout: &KvLayout,
        w: &mut WeightSource,
        max_positions: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let c = &gc.common;
        let spec = |local: bool| AttentionSpec {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            scale: 1.0 / gc.query_pre_attn_scalar.sqrt(),
            sliding_window: local.then_some(gc.window),
            softcap: gc.attn_softcap,
            causal: true,
            kv_group: 0,
            kv_slot: 0,
        };
        let by_one = NormWeights::OffsetByOne;
        let h = c.hidden_size;
        let (embedding, vocab) = embedding(b, w, c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for (i, &local) in gc.local.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let n = |w: &mut WeightSource, name: &str| {
                norm(b, w, &format!("{p}.{name}.weight"), h, by_one)
            };
            layers.push(Layer {
                attn_norm: n(w, "input_layernorm")?,
                attn: Attention::load(b, w, &p, h, spec(local).at(layout, i), by_one)?,
                post_attn_norm: n(w, "post_attention_layernorm")?,
                ffn_norm: n(w, "pre_feedforward_layernorm")?,
                mlp: Mlp::load(b, w, &p, h, c.intermediate_size)?,
                post_ffn_norm: n(w, "post_feedforward_layernorm")?,
                local,
            });
            progress(i + 1, c.num_layers);
        }
        let global = RopeSpec::of(c);
        // Local layers rotate with their own base and no long-context scaling.
        let local = RopeSpec {
            theta: gc.local_rope_theta,
            scaling: RopeScaling::None,
            ..global.clone()
        };
        Ok(Self {
            eps: c.rms_norm_eps,
            // transformers rounds the scale to the activations' dtype (f32 here).
            embed_scale: (c.hidden_size as f32).sqrt(),
            final_softcap: gc.final_softcap,
            embedding,
            layers,
            final_norm: norm(b, w, "model.norm.weight", h, by_one)?,
            lm_head: lm_head(b, w, vocab, h)?,
            global_rope: b.rope(&global, max_positions)?,
            local_rope: b.rope(&local, max_positions)?,
        })
    }
}

impl<B: Backend> Family<B> for Gemma<B> {
    fn forward(
        &self,
        b: &mut B,
        s: &Step<B>,
        cache: &mut [B::LayerCache],
        _states: &mut [B::StateCache],
        ws: &mut Buffers<B>,
    ) -> Result<()> {
        let eps = self.eps;
        b.embed(s, &self.embedding, Some(self.embed_scale), &mut ws.x)?;
        for l in &self.layers {
            let lc = &mut cache[l.attn.spec.kv_slot];
            let rope = if l.local {
                &self.local_rope
            } else {
                &self.global_rope
            };
            let input = LinearIn::RmsNorm {
                x: &ws.x,
                norm: &l.attn_norm,
                eps,
            };
            l.attn.attend(b, s, input, rope, eps, lc, &mut ws.tmp)?;
            let post = Epilogue::AddNormedInto {
                residual: &mut ws.x,
                norm: &l.post_attn_norm,
                eps,
            };
            b.matmul(LinearIn::Plain(&ws.tmp.attn), &l.attn.o, post)?;
            let input = LinearIn::RmsNorm {
                x: &ws.x,
                norm: &l.ffn_norm,
                eps,
            };
            let act = Epilogue::Gated(&mut ws.tmp.act, Activation::GeluTanh);
            b.matmul(input, &l.mlp.gate_up, act)?;
            let post = Epilogue::AddNormedInto {
                residual: &mut ws.x,
                norm: &l.post_ffn_norm,
                eps,
            };
            b.matmul(LinearIn::Plain(&ws.tmp.act), &l.mlp.down, post)?;
        }
        let (norm, head) = (&self.final_norm, &self.lm_head);
        output(b, s, &ws.x, norm, eps, head, self.final_softcap)
    }

    fn weight_bytes(&self, b: &B) -> usize {
        let layers = self.layers.iter().map(|l| l.attn.bytes(b) + l.mlp.bytes(b));
        weight_bytes(b, &self.embedding, &self.lm_head, layers)
    }
}
