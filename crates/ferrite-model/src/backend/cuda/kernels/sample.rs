//! Drawing each row's token on the device.

use super::{cfg, ptr, Arg, Kernels};
pub use crate::step::{draw_params, mask_words, DRAW_PARAMS};
use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};

impl Kernels {
    /// One token per row of f32 `[R, n]` logits, as `params` (`[R * DRAW_PARAMS]` u32, see
    /// [`draw_params`]) say: greedy, or drawn on the device from the row's own key.
    /// With `masks` (`[R, words]` u32, see [`mask_words`]), the rows whose parameters say so
    /// are first masked to their grammar's tokens, in place.
    pub fn sample_rows(
        &self,
        logits: &Tensor,
        params: &Tensor,
        masks: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (r, n) = logits.dims2()?;
        ensure!(
            params.dim(0)? >= DRAW_PARAMS * r,
            "draw parameters for {r} rows"
        );
        if let (Some(m), true) = (masks, r > 0) {
            let words = mask_words(n);
            ensure!(m.dim(0)? >= r * words, "grammar masks for {r} rows");
            self.launch(
                &self.mask_rows,
                cfg(
                    (r as u32, n.div_ceil(MASK_TOKENS_PER_BLOCK) as u32, 1),
                    256,
                    0,
                ),
                &[
                    Arg::P(ptr(logits)?),
                    Arg::P(ptr(params)?),
                    Arg::P(ptr(m)?),
                    Arg::I(n as i32),
                    Arg::I(words as i32),
                ],
            )?;
        }
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

/// Tokens of a row each block of `mask_rows` covers (8 per thread).
const MASK_TOKENS_PER_BLOCK: usize = 2048;
