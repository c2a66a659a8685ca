//! Gated delta-net layers on the CPU (Qwen3-Next, Qwen3.5 linear attention): each request's
//! state in its slot, f32: the causal convolution's last inputs and the delta rule's
//! `[v_heads, k_dim, v_dim]` matrix. The rule runs token by token (its recurrent form): on
//! the CPU it costs what the chunked form costs and gives a prefill cut into any chunks the
//! state a whole prefill gives, bit for bit. Requests run in parallel, and within one its
//! value heads.

use super::disjoint::DisjointSlice;
use super::mat::Mat;
use crate::backend::GdnSpec;
use crate::step::NO_SLOT;
use anyhow::{bail, Result};
use rayon::prelude::*;

/// Every slot's state of one layer, `[slots, spec.state_elems()]`.
pub struct StateCache {
    data: Vec<f32>,
    spec: GdnSpec,
}

impl StateCache {
    pub fn new(slots: usize, spec: &GdnSpec) -> Self {
        Self {
            data: vec![0.0; slots * spec.state_elems()],
            spec: spec.clone(),
        }
    }

    fn slots(&self) -> usize {
        self.data.len() / self.spec.state_elems().max(1)
    }
}

/// The layer's weights as the CPU reads them.
pub struct Weights<'a> {
    pub conv: &'a [f32],
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
    pub norm: &'a [f32],
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// torch's softplus (linear past 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(sum x^2 + 1e-6)` (the FLA kernels' L2 norm).
fn l2_normalize(x: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Where a step's requests keep their state: slots, and the checkpoints of prefix caching.
pub struct Slots<'a> {
    pub state: &'a [u32],
    /// Per request, or empty: the checkpoint to start from ([`NO_SLOT`]: none).
    pub restores: &'a [u32],
    /// Per request, or empty: `[n, slot]`, the state after `n` tokens into checkpoint `slot`.
    pub saves: &'a [[u32; 2]],
    /// Per request, or empty: `[n, first]`, the state after `n`, `n + 1`, ... tokens (all
    /// but the last row) into `first`, `first + 1`, ... (a verify step's drafts).
    pub drafts: &'a [[u32; 2]],
}

impl Slots<'_> {
    /// Where request `i` (of `rows` rows) writes its state besides its own slot: `(n, slot)`,
    /// the state after `n` tokens.
    fn extra(&self, i: usize, rows: usize) -> Vec<(usize, u32)> {
        let save = self.saves.get(i).filter(|s| s[1] != NO_SLOT);
        let mut out: Vec<(usize, u32)> = save.map(|s| (s[0] as usize, s[1])).into_iter().collect();
        if let Some(&[n, first]) = self.drafts.get(i).filter(|d| d[1] != NO_SLOT) {
            let n = n as usize;
            out.extend((n..rows).map(|m| (m, first + (m - n) as u32)));
        }
        out
    }
}

/// The layer over every request of the step; see `Backend::gated_delta`.
pub fn gated_delta(
    proj: &Mat,
    cu_seqlens: &[u32],
    positions: &[u32],
    slots: &Slots,
    w: &Weights,
    state: &mut StateCache,
    out: &mut Mat,
) -> Result<()> {
    let spec = state.spec.clone();
    let s = &spec;
    let vd = s.num_v_heads * s.v_dim;
    if proj.cols != s.proj_dim() {
        bail!(
            "gated delta-net input is {} wide, expected {}",
            proj.cols,
            s.proj_dim()
        );
    }
    let seqs = cu_seqlens.len().saturating_sub(1);
    let per_request = |n: usize| n == seqs || n == 0;
    if slots.state.len() != seqs
        || !per_request(slots.restores.len())
        || !per_request(slots.saves.len())
        || !per_request(slots.drafts.len())
    {
        bail!("state slots for {} of {seqs} requests", slots.state.len());
    }
    let rows = |i: usize| (cu_seqlens[i + 1] - cu_seqlens[i]) as usize;
    let extra: Vec<Vec<(usize, u32)>> = (0..seqs).map(|i| slots.extra(i, rows(i))).collect();
    // Every slot this step writes, once: the requests' own, their checkpoints and drafts.
    let mut seen = vec![false; state.slots()];
    let written =
        (0..seqs).flat_map(|i| std::iter::once(slots.state[i]).chain(extra[i].iter().map(|e| e.1)));
    for slot in written {
        match seen.get_mut(slot as usize) {
            Some(s) if !*s => *s = true,
            Some(_) => bail!("state slot {slot} written twice in one step"),
            None => bail!("state slot {slot} of {}", state.slots()),
        }
    }
    let elems = s.state_elems();
    // Restores are copied before any request runs: a request may restore from a slot it
    // writes again this step (the draft slots of a rolled-back verify step).
    for (i, &from) in slots.restores.iter().enumerate() {
        if from != NO_SLOT {
            if from as usize >= state.slots() || from == slots.state[i] {
                bail!("state slot {from} restored into itself or out of range");
            }
            let to = slots.state[i] as usize * elems;
            state
                .data
                .copy_within(from as usize * elems..(from as usize + 1) * elems, to);
        }
    }
    let t = proj.data.len() / proj.cols.max(1);
    out.cols = vd;
    out.data.resize(t * vd, 0.0);
    let states = DisjointSlice::new(&mut state.data);
    let outs = DisjointSlice::new(&mut out.data);
    (0..seqs).into_par_iter().for_each(|i| {
        let (r0, r1) = (cu_seqlens[i] as usize, cu_seqlens[i + 1] as usize);
        // SAFETY: every slot written this step is written by one request only (checked
        // above), and each request writes only its own rows of `out`.
        let st = unsafe { states.range(slots.state[i] as usize * elems, elems) };
        let o = unsafe { outs.range(r0 * vd, (r1 - r0) * vd) };
        let saves = extra[i]
            .iter()
            .map(|&(n, slot)| (n, unsafe { states.range(slot as usize * elems, elems) }))
            .collect();
        if r0 < r1 && positions[r0] == 0 {
            st.fill(0.0);
        }
        let rows = &proj.data[r0 * proj.cols..r1 * proj.cols];
        request(rows, w, s, st, saves, o);
    });
    Ok(())
}

/// One request's rows (`proj` rows in, `out` rows out) through its state `st`; each of
/// `saves`, `(n, buffer)`, also receives the state after its first `n` rows.
fn request(
    proj: &[f32],
    w: &Weights,
    s: &GdnSpec,
    st: &mut [f32],
    saves: Vec<(usize, &mut [f32])>,
    out: &mut [f32],
) {
    let (conv_dim, kd, vd) = (
        s.conv_dim(),
        s.num_k_heads * s.k_dim,
        s.num_v_heads * s.v_dim,
    );
    let taps = s.conv_kernel;
    let (window, rule) = st.split_at_mut(conv_dim * (taps - 1));
    // Each save's convolution window and delta-rule matrices, by the row after which it
    // is taken (n = 0 saves nothing: the state before the chunk is not asked for).
    let mut save_windows = Vec::new();
    let mut save_rules = Vec::new();
    for (n, buf) in saves.into_iter().filter(|s| s.0 > 0) {
        let (sw, sr) = buf.split_at_mut(conv_dim * (taps - 1));
        save_windows.push((n, sw));
        save_rules.push((n, DisjointSlice::new(sr)));
    }
    let rows = proj.len() / s.proj_dim();
    // The convolution (SiLU) of every row, sliding the window: `[rows, conv_dim]`.
    let mut qkv = vec![0f32; rows * conv_dim];
    for (r, y) in qkv.chunks_mut(conv_dim).enumerate() {
        let x = &proj[r * s.proj_dim()..][..conv_dim];
        for c in 0..conv_dim {
            let tap = &w.conv[c * taps..][..taps];
            let mut acc = tap[taps - 1] * x[c];
            for j in 0..taps - 1 {
                acc += tap[j] * window[j * conv_dim + c];
            }
            y[c] = silu(acc);
        }
        window.copy_within(conv_dim.., 0);
        window[(taps - 2) * conv_dim..].copy_from_slice(x);
        for (_, sw) in save_windows.iter_mut().filter(|s| s.0 == r + 1) {
            sw.copy_from_slice(window);
        }
    }
    for y in qkv.chunks_mut(conv_dim) {
        for h in y[..2 * kd].chunks_mut(s.k_dim) {
            l2_normalize(h);
        }
        let scale = 1.0 / (s.k_dim as f32).sqrt();
        y[..kd].iter_mut().for_each(|q| *q *= scale);
    }
    let per_k = s.num_v_heads / s.num_k_heads;
    let mat = s.k_dim * s.v_dim;
    let heads = DisjointSlice::new(out);
    rule.par_chunks_mut(mat).enumerate().for_each(|(h, m)| {
        let kh = h / per_k;
        let mut kv = vec![0f32; s.v_dim];
        let mut o = vec![0f32; s.v_dim];
        for r in 0..rows {
            let y = &qkv[r * conv_dim..][..conv_dim];
            let (q, k) = (
                &y[kh * s.k_dim..][..s.k_dim],
                &y[kd + kh * s.k_dim..][..s.k_dim],
            );
            let v = &y[2 * kd + h * s.v_dim..][..s.v_dim];
            let p = &proj[r * s.proj_dim() + conv_dim..];
            let z = &p[h * s.v_dim..][..s.v_dim];
            let (b, a) = (p[vd + h], p[vd + s.num_v_heads + h]);
            let beta = 1.0 / (1.0 + (-b).exp());
            let decay = (-w.a_log[h].exp() * softplus(a + w.dt_bias[h])).exp();
            m.iter_mut().for_each(|x| *x *= decay);
            kv.fill(0.0);
            for (ki, row) in k.iter().zip(m.chunks(s.v_dim)) {
                kv.iter_mut().zip(row).for_each(|(acc, x)| *acc += x * ki);
            }
            for (ki, row) in k.iter().zip(m.chunks_mut(s.v_dim)) {
                for ((x, vj), kvj) in row.iter_mut().zip(v).zip(&kv) {
                    *x += ki * (vj - kvj) * beta;
                }
            }
            for (_, saved) in save_rules.iter().filter(|s| s.0 == r + 1) {
                // SAFETY: head h's part of each save is written by this task only.
                unsafe { saved.range(h * mat, mat) }.copy_from_slice(m);
            }
            o.fill(0.0);
            for (qi, row) in q.iter().zip(m.chunks(s.v_dim)) {
                o.iter_mut().zip(row).for_each(|(acc, x)| *acc += x * qi);
            }
            let inv = 1.0 / (o.iter().map(|x| x * x).sum::<f32>() / s.v_dim as f32 + s.eps).sqrt();
            // SAFETY: head h of row r is written by this task only.
            let dst = unsafe { heads.range(r * vd + h * s.v_dim, s.v_dim) };
            for (((d, x), g), nw) in dst.iter_mut().zip(&o).zip(z).zip(w.norm) {
                *d = x * inv * nw * silu(*g);
            }
        }
    });
}

/// `x *= sigmoid(gate)`.
pub fn gate_sigmoid(x: &mut Mat, gate: &Mat) -> Result<()> {
    if x.data.len() != gate.data.len() {
        bail!("gating {} values by {}", x.data.len(), gate.data.len());
    }
    x.data
        .par_chunks_mut(4096)
        .zip(gate.data.par_chunks(4096))
        .for_each(|(x, g)| {
            x.iter_mut()
                .zip(g)
                .for_each(|(x, g)| *x *= 1.0 / (1.0 + (-g).exp()))
        });
    Ok(())
}
