//! What the runner drives each step: a model with its KV cache on some device.

use super::draws::DeviceDraws;
use super::packed::PackedStep;
use crate::sampler::argmax;
use anyhow::Result;

/// A model with its KV cache on some device: what the runner drives each step.
pub trait StepModel: Send {
    /// Runs the packed step; returns `[logits_indices.len(), vocab]` logits on the host.
    fn forward(&mut self, step: &PackedStep) -> Result<&mut [f32]>;

    /// Runs the step and returns the argmax of each logits row. A device overrides this to
    /// send token ids to the host instead of whole logits rows.
    fn forward_argmax(&mut self, step: &PackedStep) -> Result<Vec<u32>> {
        let vocab = self.vocab_size();
        Ok(self.forward(step)?.chunks(vocab).map(argmax).collect())
    }

    /// Whether [`StepModel::forward_draw`] works: the device samples in place.
    fn draws_on_device(&self) -> bool {
        false
    }

    /// Runs the step and draws each logits row's token on the device.
    fn forward_draw(&mut self, _step: &PackedStep, _draws: DeviceDraws) -> Result<Vec<u32>> {
        anyhow::bail!("this backend samples on the host")
    }

    /// The model's multi-token-prediction head over `step` (see `Model::forward_mtp`).
    fn forward_mtp(&mut self, _step: &PackedStep, _chained: bool) -> Result<&mut [f32]> {
        anyhow::bail!("this model has no multi-token-prediction head")
    }

    fn vocab_size(&self) -> usize;

    /// Backend, threads and weight format, for the start-up log line.
    fn describe(&self) -> String;
}
