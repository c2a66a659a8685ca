//! Mixture-of-experts layers on wgpu, with no host round trip: the router's logits through
//! a matmul, each token's experts chosen on the GPU (moe_route.wgsl), then the matrix-vector
//! kernel in its expert mode over (token, expert) pairs, each pair reading only its expert's
//! rows: gate and up, the gated activation, down; the pairs' outputs weighted into the
//! residual stream with the shared expert's (moe_combine.wgsl). A prefill's pairs each read
//! their expert's rows too (no grouping of a step's tokens by expert yet).

use super::device::Gpu;
use super::kernels::{groups_for, launch, spread, Kernels};
use super::linear::Linear;
use super::tensors::Act;
use crate::backend::{Activation, MoeBytes, MoeMatrices, MoeSpec};
use anyhow::{bail, Result};

/// A layer's weights: every routed expert's `[gate; up]` rows in turn in one binding, and
/// their down rows likewise; the router with the shared expert's gate as its last row.
pub struct Moe {
    router: Linear,
    gate_up: Linear,
    down: Linear,
    shared: Option<[Linear; 2]>,
    gated_shared: bool,
    spec: MoeSpec,
    inter: usize,
}

/// The layer's scratch activations, kept across layers and steps.
#[derive(Default)]
pub struct Scratch {
    logits: Act,
    /// Each token's experts, then their weights (moe_route.wgsl).
    route: Act,
    gate_up: Act,
    act: Act,
    down: Act,
    /// The shared expert's activation and output.
    shared_act: Act,
    shared: Act,
}

impl Moe {
    pub fn upload(gpu: &Gpu, m: MoeMatrices, spec: MoeSpec) -> Result<Self> {
        let n = m.experts.len();
        if n != spec.num_experts || spec.top_k == 0 || spec.top_k > n.min(64) {
            bail!(
                "{} experts, {} a token: the wgpu kernels take 1 to 64 a token, at most all",
                m.experts.len(),
                spec.top_k
            );
        }
        let inter = m.experts[0].gate.shape().dims2()?.0;
        let gated_shared = m.shared_gate.is_some();
        let mut router = vec![m.router];
        router.extend(m.shared_gate);
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in m.experts {
            gate_up.extend([e.gate, e.up]);
            down.push(e.down);
        }
        let shared = match m.shared {
            Some(s) => Some([
                Linear::upload(gpu, &[s.gate, s.up])?,
                Linear::upload(gpu, &[s.down])?,
            ]),
            None => None,
        };
        Ok(Self {
            router: Linear::upload(gpu, &router)?,
            gate_up: one_binding(gpu, &gate_up, "gate and up")?,
            down: one_binding(gpu, &down, "down")?,
            shared,
            gated_shared,
            spec,
            inter,
        })
    }

    pub fn bytes(&self) -> MoeBytes {
        let shared = self.shared.as_ref();
        MoeBytes {
            routed: self.gate_up.bytes() + self.down.bytes(),
            always: self.router.bytes() + shared.map_or(0, |[a, b]| a.bytes() + b.bytes()),
            num_experts: self.spec.num_experts,
            top_k: self.spec.top_k,
        }
    }

    pub fn spec(&self) -> &MoeSpec {
        &self.spec
    }

    pub fn router(&self) -> &Linear {
        &self.router
    }

    pub fn shared(&self) -> Option<&[Linear; 2]> {
        self.shared.as_ref()
    }
}

/// The experts' matrices as one part: the expert kernels index them by expert.
fn one_binding(gpu: &Gpu, parts: &[candle_core::quantized::QTensor], what: &str) -> Result<Linear> {
    let w = Linear::upload(gpu, parts)?;
    if w.parts.len() != 1 {
        bail!(
            "the experts' {what} matrices of a layer take more than one storage binding of {} ({} MiB) or mix weight types: not on the wgpu backend",
            gpu.info.name,
            gpu.limits.max_storage_buffer_binding_size >> 20
        );
    }
    Ok(w)
}

impl Scratch {
    /// The router's logits `[tokens, width]`, for [`route_and_run`] (the router's matmul is
    /// the caller's).
    pub fn logits(&mut self) -> &mut Act {
        &mut self.logits
    }

    /// The shared expert's activation and output `[tokens, h]` (its matmuls are the
    /// caller's).
    pub fn shared(&mut self) -> (&mut Act, &mut Act) {
        (&mut self.shared_act, &mut self.shared)
    }
}

/// After the router's matmul into `s.logits` (and the shared expert's into `s.shared`):
/// the routing, every (token, expert) pair through its expert, and the sum into `x`
/// (`[tokens, h]`) from `normed`, the layer's input.
pub fn route_and_run(
    gpu: &Gpu,
    k: &Kernels,
    pass: &mut wgpu::ComputePass<'static>,
    m: &Moe,
    s: &mut Scratch,
    (normed, x): (&wgpu::Buffer, &Act),
) -> Result<()> {
    let (tokens, h) = (x.rows, x.cols);
    let top_k = m.spec.top_k;
    let pairs = tokens * top_k;
    let width = m.router.rows;
    let logits = s.logits.buf()?.clone();
    let route = s.route.shape(gpu, 2 * pairs, 1)?.clone();
    let params = [
        m.spec.num_experts as u32,
        width as u32,
        top_k as u32,
        m.spec.norm_topk as u32,
        tokens as u32,
    ];
    launch(
        gpu,
        pass,
        &k.moe_route,
        &[&logits, &route],
        &params,
        [tokens as u32, 1, 1],
    );
    let gate_up = s.gate_up.shape(gpu, pairs, 2 * m.inter)?.clone();
    experts(
        gpu,
        k,
        pass,
        (normed, top_k),
        (&m.gate_up, 2 * m.inter),
        &route,
        (&gate_up, pairs),
    );
    let act = s.act.shape(gpu, pairs, m.inter)?.clone();
    let op = match m.spec.act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
    };
    let n = (pairs * m.inter) as u32;
    let params = [n, m.inter as u32, op, 0];
    launch(
        gpu,
        pass,
        &k.gated,
        &[&gate_up, &act],
        &params,
        groups_for(n as usize),
    );
    let down = s.down.shape(gpu, pairs, h)?.clone();
    experts(
        gpu,
        k,
        pass,
        (&act, 1),
        (&m.down, h),
        &route,
        (&down, pairs),
    );
    let shared = match m.shared {
        Some(_) => s.shared.buf()?.clone(),
        None => k.empty.clone(),
    };
    let kind = match (&m.shared, m.gated_shared) {
        (None, _) => 0,
        (Some(_), false) => 1,
        (Some(_), true) => 2,
    };
    let params = [h as u32, top_k as u32, tokens as u32, width as u32, kind];
    let buffers = [&down, &route, &shared, &logits, x.buf()?];
    launch(
        gpu,
        pass,
        &k.moe_combine,
        &buffers,
        &params,
        groups_for(tokens * h),
    );
    Ok(())
}

/// `y[pair] = w_e x[pair / div]` for each pair's expert e, whose rows are `n` from `e * n` on
/// (the matrix-vector kernel's expert mode), at most 65,535 pairs a launch.
fn experts(
    gpu: &Gpu,
    k: &Kernels,
    pass: &mut wgpu::ComputePass<'static>,
    (x, div): (&wgpu::Buffer, usize),
    (w, n): (&Linear, usize),
    route: &wgpu::Buffer,
    (y, pairs): (&wgpu::Buffer, usize),
) {
    let part = &w.parts[0];
    let [gx, gy, _] = spread(n.div_ceil(k.gemv_shape(1).1));
    for first in (0..pairs).step_by(65535) {
        let count = 65535.min(pairs - first);
        let params = [
            1,
            n as u32,
            w.cols as u32,
            n as u32,
            0,
            0,
            first as u32,
            part.scales as u32,
            div as u32,
            0,
            0,
            0,
        ];
        let buffers = [x, &part.buf, y, route, &k.empty];
        let kernel = &k.gemv[part.format as usize][0];
        launch(gpu, pass, kernel, &buffers, &params, [gx, gy, count as u32]);
    }
}
