//! Running a step: every op recorded into one compute pass, submitted once; the logits (or
//! hidden rows) read back with the one wait.

use super::inputs::StepInputs;
use super::tensors::read_back;
use super::WgpuBackend;
use crate::backend::{Forward, Step};
use crate::step::{DeviceDraws, PackedStep};
use anyhow::{Context, Result};
use std::time::Instant;

impl WgpuBackend {
    /// Records the step (and the draws of its logits rows, with `draws`), submits it and
    /// waits for its logits or tokens.
    pub(super) fn run_step(
        &mut self,
        host: &PackedStep,
        draws: Option<DeviceDraws>,
        forward: Forward<Self>,
    ) -> Result<()> {
        let start = Instant::now();
        let inputs = StepInputs::upload(&self.gpu, host, &mut self.step_words)?;
        self.out.rows = 0;
        let done = forward(
            self,
            &Step {
                host,
                inputs: &inputs,
            },
        );
        let draws = draws.filter(|_| done.is_ok() && self.out.rows > 0);
        // Without masks the draws go in the step's pass.
        let done = match &draws {
            Some(d) if d.masks.is_none() => self.record_draws(d),
            _ => done,
        };
        let encoder = self.end_pass();
        self.gpu
            .binds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .end_step();
        done?;
        let Some(mut encoder) = encoder else {
            self.host_logits.clear();
            return Ok(());
        };
        // With masks: the forward pass runs while the host fills them, then the draws.
        if let Some(d) = draws.as_ref().filter(|d| d.masks.is_some()) {
            self.gpu.queue.submit([encoder.finish()]);
            self.fill_masks(d)?;
            let drawn = self.record_draws(d);
            let next = self.end_pass();
            drawn?;
            encoder = next.context("the draws recorded nothing")?;
        }
        let profiler = self.gpu.profiler.as_ref();
        let mut profiler = profiler.map(|p| p.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(p) = &profiler {
            p.resolve(&mut encoder);
        }
        let record = start.elapsed();
        // What comes back: a token per row, or the logits (or hidden rows).
        let back = match draws {
            Some(_) => &self.tokens,
            None => &self.out,
        };
        let bytes = 4 * back.len() as u64;
        let out = match back.len() {
            0 => {
                self.gpu.queue.submit([encoder.finish()]);
                self.gpu.take_error()?;
                Vec::new()
            }
            _ => read_back(&self.gpu, encoder, back.buf()?, bytes)?,
        };
        if let Some(p) = &mut profiler {
            p.finish(&self.gpu.device, host.num_tokens(), record, start.elapsed())?;
        }
        match draws {
            Some(_) => {
                self.drawn = bytemuck::cast_slice(&out).to_vec();
                self.drawn.truncate(self.tokens.len());
                self.host_logits.clear();
            }
            None => {
                self.host_logits = out;
                self.host_logits.truncate(self.out.len());
            }
        }
        Ok(())
    }

    /// Ends the pass being recorded (a pass ends before its encoder can finish); the
    /// encoder, if anything was recorded.
    fn end_pass(&mut self) -> Option<wgpu::CommandEncoder> {
        self.pass = None;
        self.encoder.take()
    }
}
