//! Mixture-of-experts layers on the CPU: the router in f32 (top-k picks are discrete: an
//! int8 router would flip near-ties), then each expert's two matmuls once over the rows
//! routed to it, gathered into one block. The matmuls work row by row and each row sums its
//! experts in expert order, so a row's result never depends on the rows it shares them with.

use super::linear::{project, Linear, LinearInput};
use super::mat::Mat;
use super::ops::{add_in_place, gated_mul, rms_norm};
use super::quant::activations::QuantizedActs;
use crate::backend::{Activation, ExpertMatrices, MoeBytes, MoeMatrices, MoeSpec, Rounding};
use crate::settings::WeightFormat;
use anyhow::{bail, Result};

pub struct Expert {
    /// `[gate; up]` stacked by rows, as [`gated_mul`] reads them.
    gate_up: Vec<Linear>,
    down: Vec<Linear>,
}

impl Expert {
    fn new(m: ExpertMatrices, format: WeightFormat) -> Result<Self> {
        Ok(Self {
            gate_up: Linear::projections(vec![m.gate, m.up], format, Rounding::Coarse)?,
            down: Linear::projections(vec![m.down], format, Rounding::Coarse)?,
        })
    }

    fn bytes(&self) -> usize {
        self.gate_up
            .iter()
            .chain(&self.down)
            .map(Linear::bytes)
            .sum()
    }
}

pub struct Moe {
    /// `[experts (+ the shared expert's gate), hidden]`, f32.
    router: Linear,
    experts: Vec<Expert>,
    shared: Option<Expert>,
    gated_shared: bool,
    spec: MoeSpec,
}

impl Moe {
    pub fn new(m: MoeMatrices, spec: MoeSpec, format: WeightFormat) -> Result<Self> {
        if m.experts.len() != spec.num_experts || spec.top_k == 0 || spec.top_k > m.experts.len() {
            bail!(
                "{} experts loaded, {} configured, {} per token",
                m.experts.len(),
                spec.num_experts,
                spec.top_k
            );
        }
        let gated_shared = m.shared_gate.is_some();
        let mut router = vec![m.router];
        router.extend(m.shared_gate);
        let router = Linear::projections(router, WeightFormat::F32, Rounding::Coarse)?;
        let [router] = <[Linear; 1]>::try_from(router).map_err(|_| anyhow::anyhow!("router"))?;
        Ok(Self {
            router,
            experts: m
                .experts
                .into_iter()
                .map(|e| Expert::new(e, format))
                .collect::<Result<_>>()?,
            shared: m.shared.map(|e| Expert::new(e, format)).transpose()?,
            gated_shared,
            spec,
        })
    }

    pub fn bytes(&self) -> MoeBytes {
        MoeBytes {
            routed: self.experts.iter().map(Expert::bytes).sum(),
            always: self.router.bytes() + self.shared.as_ref().map_or(0, Expert::bytes),
            num_experts: self.spec.num_experts,
            top_k: self.spec.top_k,
        }
    }
}

/// Each row's experts and weights from its router logits (`E` routed, then the shared
/// expert's gate if any): a softmax over the routed experts, the `top_k` largest (lower
/// index first on ties), rescaled to sum to 1 if `norm_topk`.
pub fn route(logits: &[f32], spec: &MoeSpec, picks: &mut Vec<(usize, f32)>) {
    let e = spec.num_experts;
    let l = &logits[..e];
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = l.iter().map(|v| (v - max).exp()).sum();
    picks.clear();
    picks.extend(
        l.iter()
            .enumerate()
            .map(|(i, v)| (i, (v - max).exp() / sum)),
    );
    picks.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    picks.truncate(spec.top_k);
    if spec.norm_topk {
        let s: f32 = picks.iter().map(|p| p.1).sum();
        picks.iter_mut().for_each(|p| p.1 /= s);
    }
}

/// Buffers of one mixture, reused across layers and steps.
#[derive(Default)]
pub struct Scratch {
    x: Vec<f32>,
    logits: Vec<f32>,
    picks: Vec<(usize, f32)>,
    /// Per expert: its rows and their weights.
    groups: Vec<Vec<(usize, f32)>>,
    rows: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    y: Vec<f32>,
    acc: Vec<f32>,
}

/// `residual += MoE(rms_norm(residual))`: the router, then each expert over the rows routed
/// to it, summed per row in expert order. `acts` and `part` are the backend's buffers for a
/// projection's quantized input and its unstacked parts.
pub fn mixture(
    m: &Moe,
    s: &mut Scratch,
    acts: &mut QuantizedActs,
    part: &mut Vec<f32>,
    residual: &mut Mat,
    norm: &[f32],
    eps: f32,
) -> Result<()> {
    let h = residual.cols;
    s.x.resize(residual.data.len(), 0.0);
    rms_norm(&residual.data, norm, eps, &mut s.x);
    let t = s.x.len() / h.max(1);
    let input = LinearInput::new(&s.x, t, h, Rounding::Coarse, acts);
    m.router.forward(&input, &mut s.logits)?;
    let width = m.router.out_features();
    s.groups.resize_with(m.experts.len(), Vec::new);
    s.groups.iter_mut().for_each(Vec::clear);
    for (row, logits) in s.logits.chunks(width).enumerate() {
        route(logits, &m.spec, &mut s.picks);
        for &(e, w) in &s.picks {
            s.groups[e].push((row, w));
        }
    }
    s.acc.clear();
    s.acc.resize(t * h, 0.0);
    let groups = std::mem::take(&mut s.groups);
    for (e, group) in m.experts.iter().zip(&groups) {
        if group.is_empty() {
            continue;
        }
        s.rows.clear();
        for &(row, _) in group {
            s.rows.extend_from_slice(&s.x[row * h..][..h]);
        }
        let rows = std::mem::take(&mut s.rows);
        expert(e, &rows, group.len(), h, m.spec.act, s, acts, part)?;
        s.rows = rows;
        for (&(row, w), y) in group.iter().zip(s.y.chunks(h)) {
            let acc = &mut s.acc[row * h..][..h];
            acc.iter_mut().zip(y).for_each(|(a, y)| *a += w * y);
        }
    }
    s.groups = groups;
    if let Some(shared) = &m.shared {
        let x = std::mem::take(&mut s.x);
        expert(shared, &x, t, h, m.spec.act, s, acts, part)?;
        s.x = x;
        for (row, (acc, y)) in s.acc.chunks_mut(h).zip(s.y.chunks(h)).enumerate() {
            let w = match m.gated_shared {
                true => 1.0 / (1.0 + (-s.logits[row * width + width - 1]).exp()),
                false => 1.0,
            };
            acc.iter_mut().zip(y).for_each(|(a, y)| *a += w * y);
        }
    }
    add_in_place(&mut residual.data, &s.acc);
    Ok(())
}

/// Expert `e`'s MLP of `x` (`[rows, h]`) into `s.y`.
#[allow(clippy::too_many_arguments)]
fn expert(
    e: &Expert,
    x: &[f32],
    rows: usize,
    h: usize,
    act: Activation,
    s: &mut Scratch,
    acts: &mut QuantizedActs,
    part: &mut Vec<f32>,
) -> Result<()> {
    let input = LinearInput::new(x, rows, h, Rounding::Coarse, acts);
    project(&e.gate_up, &input, &mut s.gate_up, part)?;
    let inter = s.gate_up.len() / rows / 2;
    s.act.resize(rows * inter, 0.0);
    gated_mul(&s.gate_up, inter, act, &mut s.act);
    let input = LinearInput::new(&s.act, rows, inter, Rounding::Coarse, acts);
    project(&e.down, &input, &mut s.y, part)
}
