//! Mixture-of-experts layers on the GPU: every expert's weights in two bf16 tensors (GGUF
//! blocks are widened: candle has no grouped quantized matmul), the router through the
//! ordinary matmuls, then ferrite's routing, grouping and grouped matmul kernels ([`super::kernels::moe`]); the
//! shared expert is an ordinary gated MLP.

use super::kernels::matmul::MatIn;
use super::kernels::moe::GEMV_MAX_ASSIGNMENTS;
use super::kernels::Kernels;
use super::linear::{self, Linear};
use crate::backend::{ExpertMatrices, MoeBytes, MoeMatrices, MoeSpec, Stack};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};

pub struct Moe {
    /// `[E (+ the shared expert's gate), hidden]`.
    router: Linear,
    /// `[E, 2I, hidden]`: each expert's gate rows, then its up rows.
    gate_up: Tensor,
    /// `[E, hidden, I]`.
    down: Tensor,
    /// Gate|up (interleaved, as the dense matmuls take it) and down.
    shared: Option<(Linear, Linear)>,
    gated_shared: bool,
    spec: MoeSpec,
}

/// Expert matrices stacked on a new leading axis, bf16 on `dev`.
fn stacked(parts: impl Iterator<Item = Result<Tensor>>, dev: &Device) -> Result<Tensor> {
    let parts = parts.collect::<Result<Vec<_>>>()?;
    Ok(Tensor::stack(&parts, 0)?.to_device(dev)?)
}

fn host_bf16(t: &candle_core::quantized::QTensor) -> Result<Tensor> {
    Ok(t.dequantize(&Device::Cpu)?.to_dtype(DType::BF16)?)
}

impl Moe {
    pub fn new(m: MoeMatrices, spec: MoeSpec, dev: &Device) -> Result<Self> {
        ensure!(
            m.experts.len() == spec.num_experts
                && spec.num_experts <= super::kernels::moe::MAX_EXPERTS,
            "{} experts loaded, {} configured (at most {})",
            m.experts.len(),
            spec.num_experts,
            super::kernels::moe::MAX_EXPERTS
        );
        let gated_shared = m.shared_gate.is_some();
        let mut router = vec![m.router];
        router.extend(m.shared_gate);
        let gate_up = stacked(
            m.experts
                .iter()
                .map(|e| Ok(Tensor::cat(&[host_bf16(&e.gate)?, host_bf16(&e.up)?], 0)?)),
            dev,
        )?;
        let down = stacked(m.experts.iter().map(|e| host_bf16(&e.down)), dev)?;
        let shared = m.shared.map(|s| shared_mlp(s, dev)).transpose()?;
        Ok(Self {
            router: linear::upload(&router, Stack::Concat, false, dev)?,
            gate_up,
            down,
            shared,
            gated_shared,
            spec,
        })
    }

    /// Random weights drawn on the device (`--load-format dummy`).
    pub fn random(
        spec: MoeSpec,
        inter: usize,
        shared_inter: Option<usize>,
        hidden: usize,
        dev: &Device,
    ) -> Result<Self> {
        let e = spec.num_experts;
        let gated = shared_inter.is_some();
        let router = Linear::Dense(linear::random(e + gated as usize, hidden, dev)?);
        let shared = shared_inter
            .map(|i| -> Result<_> {
                Ok((
                    Linear::Dense(linear::random(2 * i, hidden, dev)?),
                    Linear::Dense(linear::random(hidden, i, dev)?),
                ))
            })
            .transpose()?;
        Ok(Self {
            router,
            gate_up: linear::random(e * 2 * inter, hidden, dev)?.reshape((e, 2 * inter, hidden))?,
            down: linear::random(e * hidden, inter, dev)?.reshape((e, hidden, inter))?,
            shared,
            gated_shared: gated,
            spec,
        })
    }

    pub fn bytes(&self) -> MoeBytes {
        let shared = self
            .shared
            .as_ref()
            .map_or(0, |(g, d)| g.bytes() + d.bytes());
        MoeBytes {
            routed: (self.gate_up.elem_count() + self.down.elem_count()) * 2,
            always: self.router.bytes() + shared,
            num_experts: self.spec.num_experts,
            top_k: self.spec.top_k,
        }
    }
}

fn shared_mlp(s: ExpertMatrices, dev: &Device) -> Result<(Linear, Linear)> {
    Ok((
        linear::upload(&[s.gate, s.up], Stack::GateUp, false, dev)?,
        linear::upload(&[s.down], Stack::Concat, false, dev)?,
    ))
}

/// The mixture's output added into the residual stream `x` (its RMSNorm `norm` first).
pub(super) fn mixture(k: &Kernels, x: &Tensor, norm: &Tensor, eps: f32, m: &Moe) -> Result<()> {
    if x.dim(0)? == 0 {
        return Ok(());
    }
    let xn = k.rms_norm(x, None, norm, eps, DType::BF16)?;
    let logits = k.matmul(MatIn::Bf16(&xn), &m.router, DType::F32)?;
    let s = &m.spec;
    let routes = k.moe_route(
        &logits,
        s.num_experts,
        s.top_k,
        s.norm_topk,
        m.shared.is_some(),
        m.gated_shared,
    )?;
    // The kernel is chosen by the step's size: one warp per (assignment, column) for a
    // few decodes, tiles of the grouped assignments (16 or 64 rows) beyond. With
    // `--batch-invariant` every step takes the tiles, always 16 rows high: a row's sums
    // then run the same tensor-core sequence wherever it sits in whatever tile.
    let invariant = k.batch_invariant();
    let small = !invariant && x.dim(0)? * s.top_k <= GEMV_MAX_ASSIGNMENTS;
    let groups = match small {
        true => None,
        false => Some(k.moe_align(&routes, s.num_experts, invariant)?),
    };
    let act = k.moe_gate_up(&xn, groups.as_ref(), &routes, &m.gate_up, s.act)?;
    let y = k.moe_down(&act, groups.as_ref(), &routes, &m.down)?;
    let ys = match &m.shared {
        Some((gate_up, down)) => {
            let a = k.matmul_gated(MatIn::Bf16(&xn), gate_up, s.act)?;
            Some(k.matmul(MatIn::Bf16(&a), down, DType::F32)?)
        }
        None => None,
    };
    k.moe_combine(x, &y, &routes, ys.as_ref())
}
