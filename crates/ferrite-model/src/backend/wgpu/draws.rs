//! Tokens drawn on the GPU (sample.wgsl): a step's logits stay on the device and a token
//! per row comes back. Grammar masks are filled on the host while the forward pass runs
//! (submitted first) and uploaded before the draws are.

use super::kernels::launch;
use super::tensors::write_kept;
use super::WgpuBackend;
use crate::step::{draw_params, mask_words, DeviceDraws};
use anyhow::{bail, Result};

impl WgpuBackend {
    /// Records the draw of every logits row into the step's pass (after [`Self::fill_masks`]
    /// where the step has masks).
    pub(super) fn record_draws(&mut self, d: &DeviceDraws) -> Result<()> {
        let (rows, n) = (self.out.rows, self.out.cols);
        if d.rows.len() != rows {
            bail!("{} draws for {rows} logits rows", d.rows.len());
        }
        let masked = d.masks.map_or(&[][..], |m| m.rows);
        let params = draw_params(d.rows, rows, masked);
        let gpu = self.gpu.clone();
        let k = self.kernels.clone();
        let params = write_kept(&gpu, "draw parameters", &mut self.draw_words, &params)?;
        let masks = match (d.masks.is_some(), &self.mask_words) {
            (true, Some(m)) => m.clone(),
            (true, None) => bail!("grammar masks drawn before they were filled"),
            (false, _) => k.empty.clone(),
        };
        let tokens = self.tokens.shape(&gpu, rows, 1)?.clone();
        let logits = self.out.buf()?.clone();
        let buffers = [&logits, &params, &masks, &tokens];
        let words = [n as u32, mask_words(n) as u32];
        launch(
            &gpu,
            self.pass(),
            &k.sample,
            &buffers,
            &words,
            [rows as u32, 1, 1],
        );
        Ok(())
    }

    /// The step's grammar masks, filled by the host and uploaded.
    pub(super) fn fill_masks(&mut self, d: &DeviceDraws) -> Result<()> {
        let Some(m) = d.masks else {
            return Ok(());
        };
        let words = mask_words(self.out.cols);
        let mut flat = vec![0u32; self.out.rows * words];
        (m.fill)(&mut flat, words);
        write_kept(&self.gpu, "grammar masks", &mut self.mask_words, &flat)?;
        Ok(())
    }
}
