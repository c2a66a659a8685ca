//! Gated delta-net layers (Qwen3.5, Qwen3-Next linear attention) on wgpu: each layer's
//! recurrent state for every slot in one buffer, and the launches of gdn.wgsl (a checkpoint
//! restored, the causal convolution, its window's slide) and gdn_rule.wgsl (the delta rule
//! in its recurrent form and the output's gated norm).

use super::device::Gpu;
use super::inputs::{StepInputs, NONE};
use super::kernels::{launch, Kernel, Kernels};
use super::tensors::zeros;
use crate::backend::GdnSpec;
use anyhow::{bail, Result};
use std::sync::Arc;

/// The largest key head the rule keeps in registers (`MAX_DK` in gdn_rule.wgsl).
const MAX_K_DIM: usize = 128;

/// One layer's state, `[slots, spec.state_elems()]` f32.
pub struct StateCache {
    buf: wgpu::Buffer,
    spec: GdnSpec,
    rule: Arc<Kernel>,
}

impl StateCache {
    pub fn zeros(gpu: &Gpu, k: &Kernels, slots: usize, spec: &GdnSpec) -> Result<Self> {
        let (dk, dv) = (spec.k_dim, spec.v_dim);
        let threads = gpu.limits.max_compute_invocations_per_workgroup as usize;
        if !dk.is_power_of_two() || dk > MAX_K_DIM || !dv.is_power_of_two() || dv > threads {
            bail!(
                "gated delta-net heads of {dk} keys and {dv} values: the wgpu kernels take powers of two, keys up to {MAX_K_DIM}, values up to {threads}"
            );
        }
        let bytes = (4 * slots * spec.state_elems()) as u64;
        let limit = gpu.limits.max_storage_buffer_binding_size;
        if bytes > limit {
            bail!(
                "the recurrent state of {slots} slots takes {} MiB a layer, past the {} MiB one storage binding of {} holds: lower --max-num-seqs to at most {} (prefix caching keeps as many checkpoints again)",
                bytes >> 20,
                limit >> 20,
                gpu.info.name,
                limit / (4 * spec.state_elems() as u64) / 2
            );
        }
        Ok(Self {
            buf: zeros(gpu, "recurrent state", bytes)?,
            spec: spec.clone(),
            rule: k.gdn_rule(&gpu.device, dk, dv),
        })
    }

    pub fn spec(&self) -> &GdnSpec {
        &self.spec
    }
}

/// The layer's buffers besides the state: the projection in, the convolution's output
/// (scratch), the small weights, the output.
pub struct Buffers<'a> {
    pub proj: &'a wgpu::Buffer,
    pub conv_out: &'a wgpu::Buffer,
    pub conv: &'a wgpu::Buffer,
    pub a_log: &'a wgpu::Buffer,
    pub dt_bias: &'a wgpu::Buffer,
    pub norm: &'a wgpu::Buffer,
    pub out: &'a wgpu::Buffer,
}

/// Restores (where the step has any), the convolution, the window's slide, the rule.
pub fn gated_delta(
    gpu: &Gpu,
    k: &Kernels,
    pass: &mut wgpu::ComputePass<'static>,
    s: &StepInputs,
    b: &Buffers,
    state: &StateCache,
) {
    let spec = &state.spec;
    let [slots, restores, saves, drafts] = s.state;
    let seqs = s.num_seqs as u32;
    let (conv_dim, elems) = (spec.conv_dim() as u32, spec.state_elems() as u32);
    let params = [
        s.cu_seqlens_q,
        s.positions,
        slots,
        restores,
        saves,
        drafts,
        seqs,
        spec.proj_dim() as u32,
        elems,
        conv_dim,
        spec.conv_kernel as u32,
    ];
    let channels = conv_dim.div_ceil(256);
    if restores != NONE {
        let buffers = [&s.buf, b.proj, &state.buf];
        let groups = [elems.div_ceil(256), seqs, 1];
        launch(gpu, pass, &k.gdn_restore, &buffers, &params, groups);
    }
    let buffers = [&s.buf, b.proj, &state.buf, b.conv, b.conv_out];
    let groups = [channels, s.num_tokens as u32, 1];
    launch(gpu, pass, &k.gdn_conv, &buffers, &params, groups);
    let buffers = [&s.buf, b.proj, &state.buf];
    launch(
        gpu,
        pass,
        &k.gdn_slide,
        &buffers,
        &params,
        [channels, seqs, 1],
    );
    let params = [
        s.cu_seqlens_q,
        s.positions,
        slots,
        saves,
        drafts,
        spec.proj_dim() as u32,
        elems,
        conv_dim,
        spec.conv_kernel as u32,
        spec.num_k_heads as u32,
        spec.num_v_heads as u32,
        spec.eps.to_bits(),
    ];
    let buffers = [
        &s.buf, b.conv_out, b.proj, b.a_log, b.dt_bias, b.norm, &state.buf, b.out,
    ];
    let groups = [seqs, spec.num_v_heads as u32, 1];
    launch(gpu, pass, &state.rule, &buffers, &params, groups);
}
