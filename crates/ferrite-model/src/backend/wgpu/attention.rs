//! The paged K/V cache of one layer and the launches that write it (Q/K/V preparation) and
//! read it (attention).

use super::device::Gpu;
use super::kernels::{launch, Kernel, Kernels};
use super::tensors::zeros;
use crate::backend::AttentionSpec;
use crate::kv_dtype::KvCacheDtype;
use anyhow::{bail, Result};
use std::sync::Arc;

/// Most dimensions of a head the kernels hold in workgroup memory.
pub const MAX_HEAD_DIM: usize = 512;

/// How K/V values are stored (`format` in qkv.wgsl and attention.wgsl).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvFormat {
    F32 = 0,
    F16 = 1,
    /// int8 codes, four to a word, and an f32 scale per token and KV head (amax / 127, as
    /// the CPU backend stores them) after all of K's and V's codes.
    Int8 = 2,
}

/// One layer's K pages, then its V pages: `[num_blocks * block_size, kv_heads, head_dim]`
/// each, f32, f16 packed two to a word, or int8 codes four to a word with their scales
/// after both (K's rows, then V's).
pub struct KvPages {
    pub buf: wgpu::Buffer,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Elements of K before V's first.
    pub v_at: usize,
    pub format: KvFormat,
    /// Attention specialized for these pages' head size.
    reader: Arc<Kernel>,
}

impl KvPages {
    pub fn zeros(
        (gpu, k): (&Gpu, &Kernels),
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: KvCacheDtype,
    ) -> Result<Self> {
        let format = match dtype {
            KvCacheDtype::Fp16 => KvFormat::F16,
            KvCacheDtype::Fp32 => KvFormat::F32,
            KvCacheDtype::Int8 => KvFormat::Int8,
            other => bail!(
                "--kv-cache-dtype {}: the wgpu backend stores K/V as fp16, fp32 or int8 (WGSL has no bf16 or fp8)",
                other.name()
            ),
        };
        if head_dim > MAX_HEAD_DIM || !head_dim.is_multiple_of(4) {
            bail!("heads of {head_dim}: the wgpu kernels take multiples of 4 up to {MAX_HEAD_DIM}");
        }
        let rows = num_blocks * block_size * kv_heads;
        let v_at = rows * head_dim;
        let bytes = match format {
            KvFormat::F32 => 8 * v_at,
            KvFormat::F16 => 4 * v_at,
            KvFormat::Int8 => 2 * v_at + 8 * rows,
        };
        Ok(Self {
            buf: zeros(gpu, "K/V pages", bytes as u64)?,
            block_size,
            kv_heads,
            head_dim,
            v_at,
            format,
            reader: k.attention(&gpu.device, head_dim),
        })
    }

    /// The word where the int8 scales start (K's rows, then V's).
    fn scales(&self) -> u32 {
        (self.v_at / 2) as u32
    }
}

/// Q/K/V preparation's inputs beside the projection.
pub struct QkvArgs<'a> {
    pub qkv: &'a wgpu::Buffer,
    pub bias: Option<&'a wgpu::Buffer>,
    pub q_norm: Option<&'a wgpu::Buffer>,
    pub k_norm: Option<&'a wgpu::Buffer>,
    pub eps: f32,
    /// cos then sin, `[positions, half]` each, the offset of sin, and whether halves pair
    /// (NeoX) rather than neighbours.
    pub rope: Option<(&'a wgpu::Buffer, usize, usize, bool)>,
    pub step: &'a wgpu::Buffer,
    pub positions: u32,
    pub slots: u32,
    pub tokens: usize,
}

pub fn prepare_qkv(
    gpu: &Gpu,
    k: &Kernels,
    pass: &mut wgpu::ComputePass<'static>,
    a: &QkvArgs,
    spec: &AttentionSpec,
    cache: &KvPages,
    q: &wgpu::Buffer,
) {
    let e = &k.empty;
    let flags = a.bias.is_some() as u32
        | (a.q_norm.is_some() as u32) << 1
        | (a.k_norm.is_some() as u32) << 2;
    let (rope, half, sin_at, neox) = a.rope.unwrap_or((e, 0, 0, false));
    let params = [
        spec.num_heads as u32,
        spec.num_kv_heads as u32,
        spec.head_dim as u32,
        half as u32,
        neox as u32,
        flags,
        a.eps.to_bits(),
        a.positions,
        a.slots,
        sin_at as u32,
        cache.v_at as u32,
        cache.format as u32,
        cache.scales(),
    ];
    let buffers = [
        a.qkv,
        a.bias.unwrap_or(e),
        a.q_norm.unwrap_or(e),
        a.k_norm.unwrap_or(e),
        rope,
        a.step,
        q,
        &cache.buf,
    ];
    let heads = spec.num_heads + 2 * spec.num_kv_heads;
    let groups = [heads as u32, a.tokens as u32, 1];
    launch(gpu, pass, &k.qkv, &buffers, &params, groups);
}

/// Attention's view of the step: offsets of its arrays in the step's words.
pub struct StepView<'a> {
    pub step: &'a wgpu::Buffer,
    pub cu_seqlens_q: u32,
    pub seq_lens_k: u32,
    pub tables: u32,
    pub max_blocks: u32,
    pub seqs: usize,
    pub tokens: usize,
}

/// Splits of each token's keys over workgroups: a decode's few (head, token) workgroups
/// each take a share of a long context, so that every core of the GPU has work (at least
/// one chunk of 64 keys a split, ~1024 workgroups in all, at most 32 splits); one where the
/// kernels are picked for a CPU adapter.
pub fn key_splits(cpu: bool, workgroups: usize, longest: usize) -> usize {
    match cpu {
        true => 1,
        false => (longest / 64).min(1024 / workgroups.max(1)).clamp(1, 32),
    }
}

/// `out` from `q` against `cache`, with `sinks` (one logit per query head) if given; with
/// `parts` (a buffer and a count of splits of the keys), through it and a launch that
/// combines the splits.
pub fn attention(
    gpu: &Gpu,
    k: &Kernels,
    pass: &mut wgpu::ComputePass<'static>,
    s: &StepView,
    (cache, spec): (&KvPages, &AttentionSpec),
    sinks: Option<&wgpu::Buffer>,
    (q, out, parts): (&wgpu::Buffer, &wgpu::Buffer, Option<(&wgpu::Buffer, usize)>),
) {
    let flags = spec.causal as u32 | (sinks.is_some() as u32) << 1 | (cache.format as u32) << 2;
    let params = [
        spec.num_heads as u32,
        spec.num_kv_heads as u32,
        cache.block_size as u32,
        spec.scale.to_bits(),
        spec.sliding_window.unwrap_or(0) as u32,
        spec.softcap.unwrap_or(0.0).to_bits(),
        flags,
        cache.v_at as u32,
        s.cu_seqlens_q,
        s.seq_lens_k,
        s.tables,
        s.max_blocks,
        s.seqs as u32,
        parts.map_or(1, |p| p.1) as u32,
        cache.scales(),
    ];
    let dest = parts.map_or(out, |p| p.0);
    let buffers = [q, &cache.buf, s.step, sinks.unwrap_or(&k.empty), dest];
    let (heads, tokens) = (spec.num_heads as u32, s.tokens as u32);
    let splits = parts.map_or(1, |p| p.1 as u32);
    launch(
        gpu,
        pass,
        &cache.reader,
        &buffers,
        &params,
        [heads, tokens, splits],
    );
    if let Some((parts, splits)) = parts {
        let params = [heads, spec.head_dim as u32, splits as u32];
        let combine = &k.attention_combine;
        launch(
            gpu,
            pass,
            combine,
            &[parts, out],
            &params,
            [heads, tokens, 1],
        );
    }
}
