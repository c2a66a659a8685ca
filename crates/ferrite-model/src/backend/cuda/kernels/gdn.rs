//! Launches of the gated delta-net kernels (`kernels/gdn.cuh`): the causal convolution, its
//! window's slide, and the delta rule with the output's gated norm.

use super::{cfg, opt, ptr, Arg, Kernels};
use crate::backend::GdnSpec;
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Tensor};

/// Key head sizes the delta rule is built for (a lane keeps a column of the state in
/// registers: `gdn_rule_k*_f32`).
pub const RULE_KEY_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Tokens per chunk and state columns per block of `gdn_chunked_k*_f32`.
const CHUNK: usize = 64;
const COLS: usize = 32;

/// Shared memory of `gdn_chunked_k*_f32`: q and k rows padded by one, the state's tile, A and
/// the intra-chunk attention padded by one, the values, and three per-token scalars.
pub fn chunk_shared_bytes(k_dim: usize) -> usize {
    4 * (2 * CHUNK * (k_dim + 1)
        + k_dim * COLS
        + 2 * CHUNK * (CHUNK + 1)
        + CHUNK * COLS
        + 3 * CHUNK)
}

/// A step's view for the delta-net kernels.
pub struct GdnStep<'a> {
    pub cu_seqlens: &'a Tensor,
    pub positions: &'a Tensor,
    pub slots: &'a Tensor,
    /// Per request, when some request restores or checkpoints its state this step.
    pub restores: Option<&'a Tensor>,
    pub saves: Option<&'a Tensor>,
    /// Per request, when some request verifies drafts: `[n, first]` (see `kernels/gdn.cuh`).
    pub drafts: Option<&'a Tensor>,
    pub num_seqs: usize,
    /// Some request has more than one token: the rule's chunk-parallel form (unless some
    /// request verifies drafts: only the recurrent form keeps the state after each token; nor
    /// in batch-invariant mode).
    pub prefill: bool,
}

impl Kernels {
    /// The layer from its input projection `proj [T, proj_dim]` bf16 to the output
    /// projection's input `[T, v_heads * v_dim]` bf16, through `state [slots, elems]` f32.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta(
        &self,
        s: &GdnStep,
        proj: &Tensor,
        spec: &GdnSpec,
        state: &Tensor,
        conv: &Tensor,
        a_log: &Tensor,
        dt_bias: &Tensor,
        norm: &Tensor,
    ) -> Result<Tensor> {
        let (t, p) = proj.dims2()?;
        ensure!(
            p == spec.proj_dim(),
            "gated delta-net input {:?}",
            proj.dims()
        );
        ensure!(
            proj.dtype() == DType::BF16,
            "gated delta-net input is {:?}, a matmul's bf16 output expected",
            proj.dtype()
        );
        let vd = spec.num_v_heads * spec.v_dim;
        let out = self.output((t, vd), DType::BF16)?;
        if t == 0 {
            return Ok(out);
        }
        let y = self.gdn_convolve(s, proj, spec, state, conv)?;
        let o = self.gdn_rule(s, &y, proj, spec, state, a_log, dt_bias)?;
        self.gdn_gated_norm(&o, proj, spec, norm, &out)?;
        Ok(out)
    }

    /// The state's restores, then the causal convolution of `proj`'s Q|K|V columns
    /// (`[T, conv_dim]` f32) and its window's slide into `state`.
    fn gdn_convolve(
        &self,
        s: &GdnStep,
        proj: &Tensor,
        spec: &GdnSpec,
        state: &Tensor,
        conv: &Tensor,
    ) -> Result<Tensor> {
        let (t, p) = proj.dims2()?;
        let (conv_dim, k) = (spec.conv_dim(), spec.conv_kernel);
        let elems = state.dim(1)?;
        if let Some(restores) = s.restores {
            self.launch_chained(
                &self.gdn_state_restore,
                cfg((s.num_seqs as u32, elems.div_ceil(1024) as u32, 1), 256, 0),
                &[
                    Arg::P(ptr(state)?),
                    Arg::I(elems as i32),
                    Arg::P(ptr(restores)?),
                    Arg::P(ptr(s.slots)?),
                ],
            )?;
        }
        let y = self.output((t, conv_dim), DType::F32)?;
        let blocks = conv_dim.div_ceil(256) as u32;
        self.launch_chained(
            &self.gdn_conv,
            cfg((t as u32, blocks, 1), 256, 0),
            &[
                Arg::P(ptr(proj)?),
                Arg::I(p as i32),
                Arg::P(ptr(state)?),
                Arg::I(elems as i32),
                Arg::P(ptr(conv)?),
                Arg::I(conv_dim as i32),
                Arg::I(k as i32),
                Arg::P(ptr(s.cu_seqlens)?),
                Arg::I(s.num_seqs as i32),
                Arg::P(ptr(s.positions)?),
                Arg::P(ptr(s.slots)?),
                Arg::P(ptr(&y)?),
            ],
        )?;
        self.launch_chained(
            &self.gdn_conv_window,
            cfg((s.num_seqs as u32, blocks, 1), 256, 0),
            &[
                Arg::P(ptr(proj)?),
                Arg::I(p as i32),
                Arg::P(ptr(state)?),
                Arg::I(elems as i32),
                Arg::I(conv_dim as i32),
                Arg::I(k as i32),
                Arg::P(ptr(s.cu_seqlens)?),
                Arg::P(ptr(s.positions)?),
                Arg::P(ptr(s.slots)?),
                opt(s.saves)?,
                opt(s.drafts)?,
            ],
        )?;
        Ok(y)
    }

    /// The delta rule over the convolved `y`: chunk-parallel for prefills, recurrent
    /// otherwise; `[T, v_heads * v_dim]` f32.
    #[allow(clippy::too_many_arguments)]
    fn gdn_rule(
        &self,
        s: &GdnStep,
        y: &Tensor,
        proj: &Tensor,
        spec: &GdnSpec,
        state: &Tensor,
        a_log: &Tensor,
        dt_bias: &Tensor,
    ) -> Result<Tensor> {
        let (t, p) = proj.dims2()?;
        let (conv_dim, k) = (spec.conv_dim(), spec.conv_kernel);
        let elems = state.dim(1)?;
        let vd = spec.num_v_heads * spec.v_dim;
        let rule = RULE_KEY_DIMS
            .iter()
            .position(|&d| d == spec.k_dim)
            .with_context(|| {
                format!(
                    "linear-attention key heads of {} (the CUDA kernels take {RULE_KEY_DIMS:?})",
                    spec.k_dim
                )
            })?;
        let o = self.output((t, vd), DType::F32)?;
        let grid = (
            s.num_seqs as u32,
            spec.num_v_heads as u32,
            spec.v_dim.div_ceil(COLS) as u32,
        );
        // Batch-invariant: the recurrent form for every step, so a request's tokens round
        // alike whether a prefill shares their step or not.
        let chunked = s.prefill && s.drafts.is_none() && !self.batch_invariant();
        let (rule, launch) = match chunked {
            true => (
                &self.gdn_chunked[rule],
                cfg(grid, 256, chunk_shared_bytes(spec.k_dim) as u32),
            ),
            false => (&self.gdn_rule[rule], cfg(grid, 32, 0)),
        };
        let mut args = vec![
            Arg::P(ptr(y)?),
            Arg::P(ptr(proj)?),
            Arg::I(p as i32),
            Arg::P(ptr(state)?),
            Arg::I(elems as i32),
            Arg::I((conv_dim * (k - 1)) as i32),
            Arg::P(ptr(a_log)?),
            Arg::P(ptr(dt_bias)?),
            Arg::I(spec.num_k_heads as i32),
            Arg::I(spec.num_v_heads as i32),
            Arg::I(spec.v_dim as i32),
            Arg::P(ptr(s.cu_seqlens)?),
            Arg::P(ptr(s.positions)?),
            Arg::P(ptr(s.slots)?),
            opt(s.saves)?,
        ];
        if !chunked {
            args.push(opt(s.drafts)?);
        }
        args.push(Arg::P(ptr(&o)?));
        self.launch_chained(rule, launch, &args)?;
        Ok(o)
    }

    /// The rule's output `o` RMS-normed per head and gated by `proj`'s z columns, into `out`.
    fn gdn_gated_norm(
        &self,
        o: &Tensor,
        proj: &Tensor,
        spec: &GdnSpec,
        norm: &Tensor,
        out: &Tensor,
    ) -> Result<()> {
        let (t, p) = proj.dims2()?;
        let conv_dim = spec.conv_dim();
        ensure!(
            spec.v_dim <= 1024,
            "linear-attention value heads of {}",
            spec.v_dim
        );
        self.launch_chained(
            &self.gdn_gated_norm,
            cfg(
                (t as u32, spec.num_v_heads as u32, 1),
                spec.v_dim.next_multiple_of(32) as u32,
                0,
            ),
            &[
                Arg::P(ptr(o)?),
                Arg::P(ptr(proj)?),
                Arg::I(p as i32),
                Arg::I(conv_dim as i32),
                Arg::P(ptr(norm)?),
                Arg::F(spec.eps),
                Arg::I(spec.num_v_heads as i32),
                Arg::I(spec.v_dim as i32),
                Arg::P(ptr(out)?),
            ],
        )?;
        Ok(())
    }

    /// `x *= sigmoid(gate)` in place, bf16 of one shape.
    pub fn gate_sigmoid(&self, x: &Tensor, gate: &Tensor) -> Result<()> {
        ensure!(
            x.dims() == gate.dims(),
            "gating {:?} by {:?}",
            x.dims(),
            gate.dims()
        );
        let n = x.elem_count();
        if n > 0 {
            self.launch_chained(
                &self.gate_sigmoid,
                cfg((n.div_ceil(256) as u32, 1, 1), 256, 0),
                &[Arg::P(ptr(x)?), Arg::P(ptr(gate)?), Arg::Z(n)],
            )?;
        }
        Ok(())
    }
}
