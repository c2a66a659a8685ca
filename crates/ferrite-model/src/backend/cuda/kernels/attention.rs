//! Q/K/V preparation (bias, Q/K norm, rotary, the K/V write) and paged varlen attention.

use super::{cfg, opt, ptr, Arg, Kernels};
use crate::kv_dtype::KvCacheDtype;
use anyhow::{bail, ensure, Result};
use candle_core::{DType, Device, Tensor};

const ATTENTION_THREADS: u32 = 128;
/// Query rows (tokens x heads of one KV head) per attention program (`MMA_ROWS`).
pub const ATTENTION_ROWS: usize = 64;
/// Query heads per KV head the kernel is tested for.
pub const MAX_GROUP: usize = 16;
/// Paged varlen attention inputs of one step, already on the device.
pub struct AttentionMeta<'a> {
    /// `[B + 1]` u32
    pub cu_seqlens_q: &'a Tensor,
    /// `[B]` u32
    pub seq_lens_k: &'a Tensor,
    /// `[B, max_blocks]` u32
    pub block_tables: &'a Tensor,
    pub max_blocks: usize,
    pub num_seqs: usize,
    pub num_tokens: usize,
    /// Longest K/V length in the step (sizes the split of long decodes).
    pub max_seq_len: usize,
    /// Splits of each key range, when fixed by the caller (a captured graph must not
    /// depend on the step's lengths); `None`: chosen from the shape.
    pub splits: Option<usize>,
}

pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub scale: f32,
    /// 0: none.
    pub sliding_window: usize,
    /// 0: none.
    pub softcap: f32,
}

/// One layer's K and V pages, `[num_blocks, kv_heads, block_size, head_dim]`: bf16, or 8-bit
/// codes (`u8`: e4m3 or int8) with an f32 scale per token and KV head, `[num_blocks, kv_heads,
/// block_size]`, written with the token (`amax / 448`, `amax / 127`, as on the CPU).
pub struct KvPages {
    pub k: Tensor,
    pub v: Tensor,
    /// K's and V's scales (8-bit types).
    pub scales: Option<(Tensor, Tensor)>,
    /// Bf16, Fp8 or Int8.
    pub dtype: KvCacheDtype,
    pub block_size: usize,
}

impl KvPages {
    /// Zeroed pages of `dtype` (one CUDA stores: bf16, fp8, int8).
    pub fn zeros(
        num_blocks: usize,
        kv_heads: usize,
        block_size: usize,
        head_dim: usize,
        dtype: KvCacheDtype,
        dev: &Device,
    ) -> Result<Self> {
        let shape = (num_blocks, kv_heads, block_size, head_dim);
        let scales = || Tensor::zeros((num_blocks, kv_heads, block_size), DType::F32, dev);
        let (values, scales) = match dtype {
            KvCacheDtype::Bf16 => (DType::BF16, None),
            KvCacheDtype::Fp8 | KvCacheDtype::Int8 => (DType::U8, Some((scales()?, scales()?))),
            d => bail!(
                "--kv-cache-dtype {} is not stored on CUDA (auto/bf16, fp8 and int8 are)",
                d.name()
            ),
        };
        Ok(Self {
            k: Tensor::zeros(shape, values, dev)?,
            v: Tensor::zeros(shape, values, dev)?,
            scales,
            dtype,
            block_size,
        })
    }

    /// Random values (benchmarks time attention on real-looking data).
    pub fn randomize(&mut self) -> Result<()> {
        for t in [&mut self.k, &mut self.v] {
            *t = match t.dtype() {
                // Codes 0..=254 but 127: no e4m3 NaN (0x7F, 0xFF).
                DType::U8 => {
                    let r = Tensor::rand(0f32, 254.0, t.shape(), t.device())?.floor()?;
                    (r.ge(127f32)?.to_dtype(DType::F32)? + r)?.to_dtype(DType::U8)?
                }
                _ => Tensor::randn(0f32, 1.0, t.shape(), t.device())?.to_dtype(DType::BF16)?,
            };
        }
        if let Some((ks, vs)) = &mut self.scales {
            for s in [ks, vs] {
                *s = Tensor::rand(0.001f32, 0.01, s.shape(), s.device())?;
            }
        }
        Ok(())
    }

    /// Which kernel of each set reads these pages.
    fn variant(&self) -> usize {
        match self.dtype {
            KvCacheDtype::Fp8 => 1,
            KvCacheDtype::Int8 => 2,
            _ => 0,
        }
    }

    fn scale_args(&self) -> Result<[Arg; 2]> {
        let (k, v) = match &self.scales {
            Some((k, v)) => (Some(k), Some(v)),
            None => (None, None),
        };
        Ok([opt(k)?, opt(v)?])
    }
}

/// The rotary, bias and per-head norm options of [`Kernels::qkv_rope_write`].
pub struct QkvParams<'a> {
    pub bias: Option<&'a Tensor>,
    pub q_norm: Option<&'a Tensor>,
    pub k_norm: Option<&'a Tensor>,
    pub eps: f32,
    pub rope_cos: &'a Tensor,
    pub rope_sin: &'a Tensor,
    pub rope_dim: usize,
    pub neox: bool,
}

impl Kernels {
    /// Splits `[T, (H + 2 Hkv) D]` QKV rows: Q rotated into the returned `[T, H * D]`, K
    /// rotated and V into the caches at `slots`.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_rope_write(
        &self,
        qkv: &Tensor,
        positions: &Tensor,
        slots: &Tensor,
        pages: &KvPages,
        shape: &AttentionShape,
        p: &QkvParams,
    ) -> Result<Tensor> {
        let (h, hkv, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let (t, width) = qkv.dims2()?;
        ensure!(width == (h + 2 * hkv) * d, "qkv is {width} wide");
        ensure!(
            qkv.dtype() == DType::BF16,
            "qkv is {:?}, a matmul's bf16 output expected",
            qkv.dtype()
        );
        let q = self.output((t, h * d), DType::BF16)?;
        if t > 0 {
            const WARPS: u32 = 8;
            let groups = ((h + 2 * hkv) as u32).div_ceil(WARPS);
            let [ks, vs] = pages.scale_args()?;
            self.launch_chained(
                &self.qkv_rope_write[pages.variant()],
                cfg((t as u32, groups, 1), 32 * WARPS, WARPS * d as u32 * 4),
                &[
                    Arg::P(ptr(qkv)?),
                    opt(p.bias)?,
                    opt(p.q_norm)?,
                    opt(p.k_norm)?,
                    Arg::F(p.eps),
                    Arg::P(ptr(positions)?),
                    Arg::P(ptr(p.rope_cos)?),
                    Arg::P(ptr(p.rope_sin)?),
                    Arg::P(ptr(slots)?),
                    Arg::P(ptr(&q)?),
                    Arg::P(ptr(&pages.k)?),
                    Arg::P(ptr(&pages.v)?),
                    ks,
                    vs,
                    Arg::I(h as i32),
                    Arg::I(hkv as i32),
                    Arg::I(d as i32),
                    Arg::I(p.rope_dim as i32),
                    Arg::I(p.neox as i32),
                    Arg::I(shape.block_size as i32),
                ],
            )?;
        }
        Ok(q)
    }

    /// Attention of every query row of the step over its request's paged K/V; `[T, H * D]`.
    /// `sinks`: bf16 `[H]`, one more logit per head in every row's softmax.
    pub fn paged_attention(
        &self,
        q: &Tensor,
        pages: &KvPages,
        meta: &AttentionMeta,
        s: &AttentionShape,
        sinks: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (h, hkv, d) = (s.num_heads, s.num_kv_heads, s.head_dim);
        let group = h / hkv;
        ensure!(
            group <= MAX_GROUP,
            "{group} query heads per KV head (at most {MAX_GROUP})"
        );
        let by_dim = match d {
            32 => &self.attention_mma[0],
            64 => &self.attention_mma[1],
            128 => &self.attention_mma[2],
            256 => &self.attention_mma[3],
            _ => bail!("head_dim {d} (the CUDA attention kernels take 32, 64, 128, 256)"),
        };
        let f = &by_dim[pages.variant()];
        let [ks, vs] = pages.scale_args()?;
        let t = meta.num_tokens;
        let out = self.output((t, h * d), DType::BF16)?;
        if t == 0 {
            return Ok(out);
        }
        let tiles = attention_tiles(t, meta.num_seqs, group);
        let (splits, split_keys) = if self.batch_invariant() {
            // One program walks all of a row's keys in tiles from position 0, whatever rows
            // share the step. (Splits of a fixed width would keep long decodes parallel, but
            // their partials grow with prefill rows times the longest context.)
            (1, meta.max_seq_len.next_multiple_of(64))
        } else {
            let splits = meta
                .splits
                .unwrap_or_else(|| self.splits(tiles * hkv, meta.max_seq_len));
            // Splits of a fixed width (whole tiles of 64 keys) from the longest context, not
            // from each tile's range: a row's partial sums then cover the same keys whether
            // its request decodes or verifies drafts after it.
            (
                splits,
                meta.max_seq_len.div_ceil(splits).next_multiple_of(64),
            )
        };
        // Partials only when the key range is split.
        let (acc, ml) = if splits > 1 {
            (
                self.output((t * h * splits, d), DType::F32)?,
                self.output((t * h * splits, 2), DType::F32)?,
            )
        } else {
            (out.clone(), out.clone())
        };
        self.launch_chained(
            f,
            cfg(
                (tiles as u32, hkv as u32, splits as u32),
                ATTENTION_THREADS,
                0,
            ),
            &[
                Arg::P(ptr(q)?),
                Arg::P(ptr(&pages.k)?),
                Arg::P(ptr(&pages.v)?),
                ks,
                vs,
                Arg::P(ptr(meta.cu_seqlens_q)?),
                Arg::P(ptr(meta.seq_lens_k)?),
                Arg::P(ptr(meta.block_tables)?),
                Arg::I(meta.max_blocks as i32),
                Arg::I(meta.num_seqs as i32),
                Arg::I(h as i32),
                Arg::I(hkv as i32),
                Arg::I(s.block_size as i32),
                Arg::F(s.scale),
                Arg::I(s.sliding_window as i32),
                Arg::F(s.softcap),
                opt(sinks)?,
                Arg::I(splits as i32),
                Arg::I(split_keys as i32),
                Arg::P(ptr(&out)?),
                Arg::P(ptr(&acc)?),
                Arg::P(ptr(&ml)?),
            ],
        )?;
        if splits > 1 {
            self.launch_chained(
                &self.merge_splits,
                cfg(((t * h) as u32, 1, 1), d as u32, 0),
                &[
                    Arg::P(ptr(&acc)?),
                    Arg::P(ptr(&ml)?),
                    Arg::P(ptr(&out)?),
                    Arg::I(splits as i32),
                    Arg::I(d as i32),
                    opt(sinks)?,
                    Arg::I(h as i32),
                ],
            )?;
        }
        Ok(out)
    }

    /// Splits of each tile's key range: enough programs for four per multiprocessor (a
    /// program walks its keys serially, so decodes need many in flight), no split shorter
    /// than 128 keys.
    pub fn splits(&self, programs: usize, max_seq_len: usize) -> usize {
        let want = (4 * self.multiprocessors as usize).div_ceil(programs.max(1));
        want.min(max_seq_len.div_ceil(128)).max(1)
    }
}

/// Programs along the grid's x axis of the attention kernel: a tile holds
/// `rows / group` tokens of one request, and request i's tiles start at `cu_q[i] / TQ + i`.
pub fn attention_tiles(tokens: usize, seqs: usize, group: usize) -> usize {
    tokens / (ATTENTION_ROWS / group) + seqs
}
