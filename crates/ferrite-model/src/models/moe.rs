//! The feed-forward block of a decoder layer: the gated MLP, or a mixture of experts
//! (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE) with its weights found
//! under whichever names the checkpoint uses.

use super::family::Scratch;
use super::layers::Mlp;
use crate::backend::{
    Activation, Backend, Epilogue, ExpertMatrices, LinearIn, MoeBytes, MoeMatrices, MoeSpec,
};
use crate::weights::config_source::ConfigSource;
use crate::weights::experts::ExpertPart;
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};

/// Which layers route through experts, and how.
#[derive(Clone, Debug)]
pub struct MoeConfig {
    pub spec: MoeSpec,
    /// Each routed expert's MLP width.
    pub inter: usize,
    /// The shared expert's width, if there is one.
    pub shared_inter: Option<usize>,
    /// Layers with a dense MLP instead (`mlp_only_layers`, `decoder_sparse_step`).
    dense: Vec<usize>,
    sparse_step: usize,
}

impl MoeConfig {
    /// `None` for a dense model.
    pub fn read(src: &ConfigSource) -> Result<Option<Self>> {
        let num_experts = src
            .opt_usize("num_experts")
            .or_else(|| src.opt_usize("num_local_experts"))
            .unwrap_or(0);
        if num_experts == 0 {
            return Ok(None);
        }
        let top_k = src.usize("num_experts_per_tok")?;
        if top_k == 0 || top_k > num_experts {
            bail!(
                "{}: {top_k} experts per token of {num_experts}",
                src.path().display()
            );
        }
        // Mixtral and Qwen3.5 always renormalize; llama.cpp does for Qwen3-MoE whatever the
        // key says.
        let arch = src.architecture();
        let always_norm = matches!(
            arch,
            "mixtral" | "llama" | "qwen3moe" | "qwen3_5_moe" | "qwen3_5_moe_text"
        );
        let norm_topk = always_norm || src.opt_bool("norm_topk_prob").unwrap_or(false);
        let inter = src
            .opt_usize("moe_intermediate_size")
            .unwrap_or(src.usize("intermediate_size")?);
        let shared_inter = src
            .opt_usize("shared_expert_intermediate_size")
            .filter(|&n| n > 0);
        let dense = match src.get("mlp_only_layers") {
            Some(v) => serde_json::from_value::<Vec<usize>>(v.clone())
                .map_err(|e| src.unsupported(&format!("`mlp_only_layers`: {e}")))?,
            None => Vec::new(),
        };
        Ok(Some(Self {
            spec: MoeSpec {
                num_experts,
                top_k,
                norm_topk,
                act: Activation::Silu,
            },
            inter,
            shared_inter,
            dense,
            sparse_step: src.opt_usize("decoder_sparse_step").unwrap_or(1).max(1),
        }))
    }

    fn is_sparse(&self, layer: usize) -> bool {
        !self.dense.contains(&layer) && (layer + 1).is_multiple_of(self.sparse_step)
    }
}

/// A layer's feed-forward block.
pub enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    Moe(B::Moe),
}

impl<B: Backend> Ffn<B> {
    /// Layer `prefix`'s block (`model.layers.N`): experts where `moe` routes layer `layer`.
    pub fn load(
        b: &B,
        w: &mut WeightSource,
        prefix: &str,
        layer: usize,
        hidden: usize,
        dense_inter: usize,
        moe: Option<&MoeConfig>,
    ) -> Result<Self> {
        let m = match moe.filter(|m| m.is_sparse(layer)) {
            None => return Ok(Self::Dense(Mlp::load(b, w, prefix, hidden, dense_inter)?)),
            Some(_) if b.tensor_parallel().is_split() => {
                bail!("{prefix}: mixture-of-experts layers are not split across tensor-parallel ranks yet")
            }
            Some(m) => m,
        };
        let spec = m.spec.clone();
        Ok(Self::Moe(match w.is_dummy() {
            true => b.random_moe(spec, m.inter, m.shared_inter, hidden)?,
            false => b.moe(load_moe(w, prefix, hidden, m)?, spec)?,
        }))
    }

    /// `x += ffn(rms_norm(x))`.
    pub fn forward(
        &self,
        b: &mut B,
        x: &mut B::Act,
        norm: &B::Vector,
        eps: f32,
        ws: &mut Scratch<B>,
    ) -> Result<()> {
        match self {
            Self::Dense(mlp) => {
                let input = LinearIn::RmsNorm { x, norm, eps };
                let act = Epilogue::Gated(&mut ws.act, Activation::Silu);
                b.matmul(input, &mlp.gate_up, act)?;
                super::layers::add_row_parallel(b, LinearIn::Plain(&ws.act), &mlp.down, x)
            }
            Self::Moe(m) => b.mixture(x, norm, eps, m),
        }
    }

    pub fn bytes(&self, b: &B) -> usize {
        match self {
            Self::Dense(mlp) => mlp.bytes(b),
            Self::Moe(m) => b.moe_bytes(m).total(),
        }
    }

    /// The experts' share of [`Ffn::bytes`].
    pub fn expert_bytes(&self, b: &B) -> MoeBytes {
        match self {
            Self::Dense(_) => MoeBytes::default(),
            Self::Moe(m) => b.moe_bytes(m),
        }
    }
}

/// The host weights of the mixture at `prefix`: Mixtral's `block_sparse_moe` or `mlp`.
fn load_moe(w: &mut WeightSource, prefix: &str, h: usize, m: &MoeConfig) -> Result<MoeMatrices> {
    let n = m.spec.num_experts;
    // GGUF names both `blk.N.ffn_*`.
    let mixtral = !w.is_gguf() && w.has(&format!("{prefix}.block_sparse_moe.gate.weight"));
    let block = match mixtral {
        true => format!("{prefix}.block_sparse_moe"),
        false => format!("{prefix}.mlp"),
    };
    let router = w.shaped(&format!("{block}.gate.weight"), &[n, h])?;
    let [gate, up, down] = [
        (ExpertPart::Gate, [m.inter, h]),
        (ExpertPart::Up, [m.inter, h]),
        (ExpertPart::Down, [h, m.inter]),
    ]
    .map(|(part, dims)| w.experts(&block, part, n, dims));
    let experts = gate?
        .into_iter()
        .zip(up?)
        .zip(down?)
        .map(|((gate, up), down)| ExpertMatrices { gate, up, down })
        .collect();
    let (shared, shared_gate) = match m.shared_inter {
        None => (None, None),
        Some(i) => {
            let p = |n: &str| format!("{block}.shared_expert.{n}.weight");
            let shared = ExpertMatrices {
                gate: w.shaped(&p("gate_proj"), &[i, h])?,
                up: w.shaped(&p("up_proj"), &[i, h])?,
                down: w.shaped(&p("down_proj"), &[h, i])?,
            };
            // GGUF keeps the gate as a vector.
            let gate = match w.opt_vector(&format!("{block}.shared_expert_gate.weight"))? {
                Some(v) if v.len() == h => {
                    let t = candle_core::Tensor::from_vec(v, (1, h), &candle_core::Device::Cpu)?;
                    Some(QTensor::quantize(&t, GgmlDType::F32)?)
                }
                Some(v) => bail!("{block}: a shared-expert gate of {} weights", v.len()),
                None => None,
            };
            (Some(shared), gate)
        }
    };
    Ok(MoeMatrices {
        router,
        experts,
        shared,
        shared_gate,
    })
}
