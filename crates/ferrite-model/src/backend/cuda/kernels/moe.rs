//! Launches of the mixture-of-experts kernels (`kernels/moe.cuh`): routing, grouping by
//! expert, the two grouped matmuls and the combine. Every size is known from the step's
//! shape, so a decode step's mixture is captured in its graph like any other layer.

use super::{act_code, cfg, opt, ptr, Arg, Kernels};
use crate::backend::Activation;
use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};

/// Columns of a grouped matmul's block (`MOE_BN`).
const TILE_COLS: usize = 64;
/// Rows of a grouped matmul's tile: 16, or 64 once experts average this many rows.
const TALL_TILE_FROM: usize = 32;
/// Steps of up to this many assignments (rows x experts per row: decodes of up to 8 rows of
/// top-8) take the one-warp-per-column kernels, which read each assignment's weights
/// straight from memory; larger ones are grouped by expert into tiles.
pub const GEMV_MAX_ASSIGNMENTS: usize = 64;
/// Threads of the one-warp-per-column kernels.
const GEMV_THREADS: u32 = 256;
/// Experts the router kernel holds per row (`32 * MOE_PER_LANE`).
pub const MAX_EXPERTS: usize = 512;

/// Each row's experts and their weights.
pub struct Routes {
    /// `[T * k]` u32.
    pub ids: Tensor,
    /// `[T * k]` f32.
    pub weights: Tensor,
    /// `[T]` f32: the shared expert's weight, when there is one.
    pub shared: Option<Tensor>,
    pub top_k: usize,
}

/// The assignments grouped by expert, in tiles of `tile_rows`.
pub struct Groups {
    pub order: Tensor,
    pub tile_expert: Tensor,
    pub tiles: usize,
    /// 16 or 64.
    tile_rows: usize,
}

impl Groups {
    /// Index of the tiled kernels for this tile height.
    fn kernel(&self) -> usize {
        (self.tile_rows == 64) as usize
    }
}

impl Kernels {
    /// Routes each row of the router's f32 logits `[T, width]` (E experts, then the shared
    /// expert's gate when `gated`).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route(
        &self,
        logits: &Tensor,
        experts: usize,
        top_k: usize,
        norm: bool,
        shared: bool,
        gated: bool,
    ) -> Result<Routes> {
        let (t, width) = logits.dims2()?;
        ensure!(
            experts <= MAX_EXPERTS && top_k <= experts && width >= experts + gated as usize,
            "routing {top_k} of {experts} experts from {width} logits"
        );
        let ids = self.output(t * top_k, DType::U32)?;
        let weights = self.output(t * top_k, DType::F32)?;
        let shared = shared.then(|| self.output(t, DType::F32)).transpose()?;
        self.launch_chained(
            &self.moe_route,
            cfg((t.div_ceil(4) as u32, 1, 1), 128, 0),
            &[
                Arg::P(ptr(logits)?),
                Arg::I(t as i32),
                Arg::I(width as i32),
                Arg::I(experts as i32),
                Arg::I(top_k as i32),
                Arg::I(norm as i32),
                Arg::I(gated as i32),
                Arg::P(ptr(&ids)?),
                Arg::P(ptr(&weights)?),
                opt(shared.as_ref())?,
            ],
        )?;
        Ok(Routes {
            ids,
            weights,
            shared,
            top_k,
        })
    }

    /// Groups the routes' assignments by expert, in tiles of 16 rows (`short`), or 64 when
    /// experts average enough assignments.
    pub fn moe_align(&self, r: &Routes, experts: usize, short: bool) -> Result<Groups> {
        let n = r.ids.dim(0)?;
        let tile_rows = if !short && n / experts >= TALL_TILE_FROM {
            64
        } else {
            16
        };
        // Each expert's run rounds up to whole tiles: at most one partial tile per expert used.
        let tiles = n.div_ceil(tile_rows) + experts.min(n);
        let order = self.output(tiles * tile_rows, DType::U32)?;
        let tile_expert = self.output(tiles, DType::U32)?;
        self.launch_chained(
            &self.moe_align,
            cfg((1, 1, 1), 1024, (2 * experts * 4) as u32),
            &[
                Arg::P(ptr(&r.ids)?),
                Arg::I(n as i32),
                Arg::I(experts as i32),
                Arg::I(tiles as i32),
                Arg::I(tile_rows as i32),
                Arg::P(ptr(&order)?),
                Arg::P(ptr(&tile_expert)?),
            ],
        )?;
        Ok(Groups {
            order,
            tile_expert,
            tiles,
            tile_rows,
        })
    }

    /// `act(gate) * up` of every assignment's row of `x [T, H]` bf16 through its expert's
    /// `gate_up [E, 2I, H]`: `[T * k, I]` bf16; grouped by `g`, or one warp per column.
    pub fn moe_gate_up(
        &self,
        x: &Tensor,
        g: Option<&Groups>,
        r: &Routes,
        gate_up: &Tensor,
        act: Activation,
    ) -> Result<Tensor> {
        let (t, h) = x.dims2()?;
        let (_, two_i, h2) = gate_up.dims3()?;
        ensure!(
            h == h2 && h % 8 == 0,
            "experts [_, {two_i}, {h2}] for rows of {h}"
        );
        let i = two_i / 2;
        let out = self.output((t * r.top_k, i), DType::BF16)?;
        let Some(g) = g else {
            let warps = GEMV_THREADS as usize / 32;
            self.launch_chained(
                &self.moe_gemv_gate_up,
                cfg(
                    ((t * r.top_k) as u32, i.div_ceil(warps) as u32, 1),
                    GEMV_THREADS,
                    (h * 2) as u32,
                ),
                &[
                    Arg::P(ptr(x)?),
                    Arg::I(r.top_k as i32),
                    Arg::P(ptr(&r.ids)?),
                    Arg::P(ptr(gate_up)?),
                    Arg::I(i as i32),
                    Arg::I(h as i32),
                    Arg::I(act_code(act)),
                    Arg::P(ptr(&out)?),
                ],
            )?;
            return Ok(out);
        };
        self.launch_chained(
            &self.moe_gate_up[g.kernel()],
            cfg((g.tiles as u32, i.div_ceil(TILE_COLS) as u32, 1), 128, 0),
            &[
                Arg::P(ptr(x)?),
                Arg::P(ptr(&g.order)?),
                Arg::P(ptr(&g.tile_expert)?),
                Arg::P(ptr(gate_up)?),
                Arg::I(h as i32),
                Arg::I(i as i32),
                Arg::I(r.top_k as i32),
                Arg::I(act_code(act)),
                Arg::P(ptr(&out)?),
            ],
        )?;
        Ok(out)
    }

    /// Every assignment's `act [T * k, I]` through its expert's `down [E, H, I]`, times its
    /// weight: `[T * k, H]` f32; grouped by `g`, or one warp per column.
    pub fn moe_down(
        &self,
        act: &Tensor,
        g: Option<&Groups>,
        r: &Routes,
        down: &Tensor,
    ) -> Result<Tensor> {
        let (n, i) = act.dims2()?;
        let (_, h, i2) = down.dims3()?;
        ensure!(
            i == i2 && i % 8 == 0,
            "experts [_, {h}, {i2}] for rows of {i}"
        );
        let y = self.output((n, h), DType::F32)?;
        let Some(g) = g else {
            let warps = GEMV_THREADS as usize / 32;
            self.launch_chained(
                &self.moe_gemv_down,
                cfg(
                    (n as u32, h.div_ceil(warps) as u32, 1),
                    GEMV_THREADS,
                    (i * 2) as u32,
                ),
                &[
                    Arg::P(ptr(act)?),
                    Arg::P(ptr(&r.ids)?),
                    Arg::P(ptr(down)?),
                    Arg::P(ptr(&r.weights)?),
                    Arg::I(h as i32),
                    Arg::I(i as i32),
                    Arg::P(ptr(&y)?),
                ],
            )?;
            return Ok(y);
        };
        self.launch_chained(
            &self.moe_down[g.kernel()],
            cfg((g.tiles as u32, h.div_ceil(TILE_COLS) as u32, 1), 128, 0),
            &[
                Arg::P(ptr(act)?),
                Arg::P(ptr(&g.order)?),
                Arg::P(ptr(&g.tile_expert)?),
                Arg::P(ptr(down)?),
                Arg::P(ptr(&r.weights)?),
                Arg::I(h as i32),
                Arg::I(i as i32),
                Arg::P(ptr(&y)?),
            ],
        )?;
        Ok(y)
    }

    /// `x += ` each row's `k` expert results (in pick order) and the shared expert's `ys`
    /// times its weight.
    pub fn moe_combine(
        &self,
        x: &Tensor,
        y: &Tensor,
        r: &Routes,
        shared: Option<&Tensor>,
    ) -> Result<()> {
        let (t, h) = x.dims2()?;
        ensure!(
            y.dims2()? == (t * r.top_k, h),
            "expert results {:?}",
            y.dims()
        );
        self.launch_chained(
            &self.moe_combine,
            cfg((t as u32, 1, 1), 256, 0),
            &[
                Arg::P(ptr(x)?),
                Arg::P(ptr(y)?),
                opt(shared)?,
                opt(r.shared.as_ref())?,
                Arg::I(h as i32),
                Arg::I(r.top_k as i32),
            ],
        )?;
        Ok(())
    }
}
