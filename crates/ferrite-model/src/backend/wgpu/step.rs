//! Running a step: every op recorded into one compute pass, submitted once; the logits (or
//! hidden rows) read back with the one wait.

use super::inputs::StepInputs;
use super::tensors::read_back;
use super::WgpuBackend;
use crate::backend::{Forward, Step};
use crate::step::PackedStep;
use anyhow::Result;
use std::time::Instant;

impl WgpuBackend {
    pub(super) fn run_step(&mut self, host: &PackedStep, forward: Forward<Self>) -> Result<()> {
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
        // The pass ends before its encoder can finish; a failed step's commands are dropped.
        self.pass = None;
        self.gpu
            .binds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .end_step();
        let encoder = self.encoder.take();
        done?;
        let Some(mut encoder) = encoder else {
            self.host_logits.clear();
            return Ok(());
        };
        let profiler = self.gpu.profiler.as_ref();
        let mut profiler = profiler.map(|p| p.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(p) = &profiler {
            p.resolve(&mut encoder);
        }
        let record = start.elapsed();
        let bytes = 4 * self.out.len() as u64;
        let out = match self.out.len() {
            0 => {
                self.gpu.queue.submit([encoder.finish()]);
                self.gpu.take_error()?;
                Vec::new()
            }
            _ => read_back(&self.gpu, encoder, self.out.buf()?, bytes)?,
        };
        if let Some(p) = &mut profiler {
            p.finish(&self.gpu.device, host.num_tokens(), record, start.elapsed())?;
        }
        self.host_logits = out;
        self.host_logits.truncate(self.out.len());
        Ok(())
    }
}
