//! Drawing each row's token on the device.

use super::{cfg, ptr, Arg, Kernels};
use crate::runner::RowDraw;
use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};

impl Kernels {
    /// One token per row of f32 `[R, n]` logits, as `params` (`[R * DRAW_PARAMS]` u32, see
    /// [`draw_params`]) say: greedy, or drawn on the device from the row's own key.
    pub fn sample_rows(&self, logits: &Tensor, params: &Tensor) -> Result<Tensor> {
        let (r, n) = logits.dims2()?;
        ensure!(
            params.dim(0)? >= DRAW_PARAMS * r,
            "draw parameters for {r} rows"
        );
        let out = self.output(r, DType::U32)?;
        if r > 0 {
            self.launch(
                &self.sample_rows,
                cfg((r as u32, 1, 1), 1024, 0),
                &[
                    Arg::P(ptr(logits)?),
                    Arg::P(ptr(params)?),
                    Arg::P(ptr(&out)?),
                    Arg::I(n as i32),
                ],
            )?;
        }
        Ok(out)
    }
}

/// u32 parameters per row of `sample_rows` (the kernel's `DRAW_PARAMS`).
pub const DRAW_PARAMS: usize = 6;

/// `sample_rows`' parameters: per row temperature, min-p and top-p as f32 bits, top-k and the
/// 64-bit key; greedy rows are all zeros. Padded with greedy rows up to `rows`.
pub fn draw_params(draws: &[RowDraw], rows: usize) -> Vec<u32> {
    let mut p = vec![0u32; DRAW_PARAMS * rows.max(draws.len())];
    for (d, out) in draws.iter().zip(p.chunks_mut(DRAW_PARAMS)) {
        if let RowDraw::Sample {
            temperature,
            top_k,
            top_p,
            min_p,
            key,
        } = *d
        {
            out.copy_from_slice(&[
                temperature.to_bits(),
                min_p.to_bits(),
                top_p.to_bits(),
                top_k,
                key as u32,
                (key >> 32) as u32,
            ]);
        }
    }
    p
}
