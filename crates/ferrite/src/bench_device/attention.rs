//! The attention kernel alone on decode batches, against the K/V bytes it reads.

use super::args::DeviceBenchArgs;
use super::measure::{median, step, sync, BLOCK};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use ferrite_model::backend::cuda::kernels::attention::{AttentionMeta, AttentionShape};
use ferrite_model::backend::cuda::kernels::Kernels;
use ferrite_model::backend::cuda::KvPages;
use ferrite_model::config::ModelConfig;
use ferrite_model::kv_dtype::KvCacheDtype;

/// The attention kernel by itself on decode batches: time against the K/V bytes it must read.
pub(super) fn attention_alone(
    cuda: &candle_core::CudaDevice,
    c: &ModelConfig,
    a: &DeviceBenchArgs,
    copy_bw: f64,
) -> Result<()> {
    let dev = Device::Cuda(cuda.clone());
    let kernels = Kernels::load(cuda)?;
    println!("| attention (one layer) | KV | key splits | step ms | K/V bytes read | floor ms | time / floor |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    // A batch-1 decode at 1K context as the bench's step graph splits it (8), as the engine's
    // graph for 8K-token requests does (64), and unsplit.
    for (batch, qlen, ctx, splits) in [
        (1, 1, 1024, Some(1)),
        (1, 1, 1024, Some(8)),
        (1, 1, 1024, Some(64)),
        (1, 1, 32768, None),
        (32, 1, 4096, None),
        (128, 1, 1024, None),
        (1, a.prompt_tokens, a.prompt_tokens, None),
    ] {
        let s = step(batch, qlen, ctx);
        let blocks = batch * ctx.div_ceil(BLOCK);
        let t = s.num_tokens();
        let q =
            Tensor::randn(0f32, 1.0, (t, c.num_heads * c.head_dim), &dev)?.to_dtype(DType::BF16)?;
        let u = |v: &[u32]| Tensor::from_slice(v, v.len(), &dev);
        let (cu, sk, bt) = (
            u(&s.cu_seqlens_q)?,
            u(&s.seq_lens_k)?,
            u(&s.kv[0].block_tables)?,
        );
        let meta = AttentionMeta {
            cu_seqlens_q: &cu,
            seq_lens_k: &sk,
            block_tables: &bt,
            max_blocks: s.kv[0].max_blocks,
            num_seqs: batch,
            num_tokens: t,
            max_seq_len: ctx,
            splits,
        };
        let ashape = AttentionShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: BLOCK,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: 0,
            softcap: 0.0,
        };
        for kv in [KvCacheDtype::Bf16, KvCacheDtype::Fp8, KvCacheDtype::Int8] {
            let mut pages = KvPages::zeros(blocks, c.num_kv_heads, BLOCK, c.head_dim, kv, &dev)?;
            pages.randomize()?;
            // Launches back to back, as in a step: a sync per launch would time the host.
            const LAUNCHES: usize = 20;
            let time = median(a.repeats, || {
                for _ in 0..LAUNCHES {
                    kernels.paged_attention(&q, &pages, &meta, &ashape, None)?;
                }
                sync(&dev)
            })? / LAUNCHES as f64;
            let bytes = (batch * ctx * 2 * c.num_kv_heads * kv.head_bytes(c.head_dim)) as f64;
            println!(
                "| batch {batch} x {qlen} tokens at {ctx} | {} | {} | {:.3} | {:.1} MB | {:.3} | {:.2} |",
                kv.name(),
                splits.map_or("auto".into(), |s| s.to_string()),
                time * 1e3,
                bytes / 1e6,
                bytes / copy_bw * 1e3,
                time / (bytes / copy_bw)
            );
        }
    }
    Ok(())
}
