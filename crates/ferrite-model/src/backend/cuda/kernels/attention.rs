//! Q/K/V preparation (bias, Q/K norm, rotary, the K/V write) and paged varlen attention.

use super::{cfg, opt, ptr, Arg, Kernels};
use anyhow::{bail, ensure, Result};
use candle_core::{DType, Tensor};

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
        k_cache: &Tensor,
        v_cache: &Tensor,
        shape: &AttentionShape,
        p: &QkvParams,
    ) -> Result<Tensor> {
        let (h, hkv, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let (t, width) = qkv.dims2()?;
        ensure!(width == (h + 2 * hkv) * d, "qkv is {width} wide");
        let q = self.output((t, h * d), DType::BF16)?;
        if t > 0 {
            const WARPS: u32 = 8;
            let groups = ((h + 2 * hkv) as u32).div_ceil(WARPS);
            self.launch_chained(
                &self.qkv_rope_write,
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
                    Arg::P(ptr(k_cache)?),
                    Arg::P(ptr(v_cache)?),
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
        k_cache: &Tensor,
        v_cache: &Tensor,
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
        let f = match d {
            32 => &self.attention_mma[0],
            64 => &self.attention_mma[1],
            128 => &self.attention_mma[2],
            256 => &self.attention_mma[3],
            _ => bail!("head_dim {d} (the CUDA attention kernels take 32, 64, 128, 256)"),
        };
        let t = meta.num_tokens;
        let out = self.output((t, h * d), DType::BF16)?;
        if t == 0 {
            return Ok(out);
        }
        let tiles = attention_tiles(t, meta.num_seqs, group);
        let splits = meta
            .splits
            .unwrap_or_else(|| self.splits(tiles * hkv, meta.max_seq_len));
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
                Arg::P(ptr(k_cache)?),
                Arg::P(ptr(v_cache)?),
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
