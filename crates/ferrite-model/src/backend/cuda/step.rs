//! Running a step: replayed from a captured graph where one serves it, else launched
//! eagerly; tokens drawn on the device.

use super::inputs::{u32s, StepInputs};
use super::kernels::sample::{draw_params, mask_words};
use super::{cuda, kernels, CudaBackend};
use crate::backend::{Forward, Step};
use crate::step::{DeviceDraws, PackedStep};
use anyhow::{Context, Result};
use candle_core::Tensor;

impl CudaBackend {
    /// `Backend::step`: from a captured graph where one serves the step, else eagerly,
    /// each row's token drawn on the device when `draws` asks.
    pub(super) fn run_step(
        &mut self,
        host: &PackedStep,
        draws: Option<DeviceDraws>,
        mut forward: Forward<Self>,
    ) -> Result<()> {
        // Steps run on the engine's thread, not the loader's: the raw copies and graph
        // launches of a replay need the context current here.
        cuda(&self.device)?
            .cuda_stream()
            .context()
            .bind_to_thread()?;
        // Dropped here, before a capture could see them go.
        (self.logits, self.tokens) = (None, None);
        self.kernels.set_fused_rows(match host.num_seqs() {
            1 => kernels::matmul::GEMV_MAX_ROWS,
            _ => kernels::matmul::GEMV_BATCH_ROWS,
        });
        let none = DeviceDraws {
            rows: &[],
            masks: None,
        };
        if self.replay(host, draws.unwrap_or(none), &mut forward)? {
            return Ok(());
        }
        let inputs = StepInputs::upload(host, &self.device)?;
        forward(
            self,
            &Step {
                host,
                inputs: &inputs,
            },
        )?;
        if let Some(d) = draws {
            self.tokens = Some(self.draw(d)?);
        }
        Ok(())
    }

    /// Each row of the last logits drawn as `d` says, grammar masks made while the step's
    /// kernels still run.
    fn draw(&self, d: DeviceDraws) -> Result<Tensor> {
        let logits = self.device_logits()?;
        let words = mask_words(logits.dim(1)?);
        let masked = d.masks.map_or(&[][..], |m| m.rows);
        let params = u32s(&draw_params(d.rows, d.rows.len(), masked), &self.device)?;
        // The kernels above are still running: the masks are made meanwhile.
        let masks = d
            .masks
            .map(|m| {
                let mut out = vec![0u32; d.rows.len() * words];
                (m.fill)(&mut out, words);
                u32s(&out, &self.device)
            })
            .transpose()?;
        self.kernels.sample_rows(logits, &params, masks.as_ref())
    }

    /// The step from its bucket's graph; false when no graph serves it.
    fn replay(
        &mut self,
        host: &PackedStep,
        draws: DeviceDraws,
        forward: &mut Forward<Self>,
    ) -> Result<bool> {
        let mut graphs = std::mem::take(&mut self.graphs);
        let (kernels, device) = (self.kernels.clone(), self.device.clone());
        // Taken, not cloned: a capture must not drop a tensor allocated outside it.
        let mut launch = |inputs: &StepInputs| -> Result<Tensor> {
            forward(self, &Step { host, inputs })?;
            self.logits
                .take()
                .context("the forward pass made no logits")
        };
        let out = graphs.replay(&kernels, &device, host, draws, &mut launch);
        self.graphs = graphs;
        Ok(match out? {
            Some((logits, tokens)) => {
                self.logits = Some(logits);
                self.tokens = Some(tokens);
                true
            }
            None => false,
        })
    }
}
