//! Decode attention alone, as the CPU model runs it: one query row (or a few) of
//! SmolLM2-135M's shape (9 heads, 3 KV heads, head 64, 16-token blocks) against CTX keys, in
//! 30 layers of their own, with 100 MB streamed between steps as the weights would be.
//! Prints the time of one step's attention with the caches cold and right after (hot), for
//! each KV cache dtype.
//! Usage: cargo run --release -p ferrite-model --example attn_speed -- [CTX] [ROWS] [THREADS]

use ferrite_model::backend::cpu::attention::{paged_attention, AttentionMeta, AttentionParams};
use ferrite_model::backend::cpu::kv_cache::{CacheShape, LayerCache};
use ferrite_model::kv_dtype::KvCacheDtype;
use std::time::Instant;

fn main() {
    let arg = |i: usize, d: usize| std::env::args().nth(i).map_or(d, |s| s.parse().unwrap());
    let (ctx, rows, threads) = (arg(1, 931), arg(2, 1), arg(3, 2));
    let (nh, nkv, d, bs, layers) = (9, 3, 64, 16, 30);
    let nblocks = 4340;
    let shape = CacheShape {
        num_blocks: nblocks,
        block_size: bs,
        num_kv_heads: nkv,
        head_dim: d,
    };
    let rows_kv: Vec<f32> = (0..nblocks * bs * nkv * d)
        .map(|i| ((i * 31) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let slots: Vec<u32> = (0..(nblocks * bs) as u32).collect();
    for kv in [
        KvCacheDtype::Fp16,
        KvCacheDtype::Bf16,
        KvCacheDtype::Fp8,
        KvCacheDtype::Int8,
    ] {
        let caches: Vec<LayerCache> = (0..layers)
            .map(|l| {
                let mut c = LayerCache::new(shape, kv);
                let x = &rows_kv[l..];
                let n = x.len() / (nkv * d) * (nkv * d);
                c.write(&x[..n], &x[..n], &slots[..n / (nkv * d)]);
                c
            })
            .collect();
        let q: Vec<f32> = (0..rows * nh * d)
            .map(|i| ((i * 31) % 100) as f32 / 100.0 - 0.5)
            .collect();
        let max_blocks = ctx.div_ceil(bs);
        let table: Vec<u32> = (0..max_blocks as u32).map(|i| 1000 + i).collect();
        let cu = [0u32, rows as u32];
        let lens = [ctx as u32];
        let meta = AttentionMeta {
            cu_seqlens_q: &cu,
            seq_lens_k: &lens,
            block_tables: &table,
            max_blocks,
            block_size: bs,
        };
        let p = AttentionParams {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
            scale: 0.125,
            sliding_window: None,
            softcap: None,
            causal: true,
            sinks: None,
        };
        let mut out = vec![0f32; rows * nh * d];
        let mut evict = vec![1u8; 100 << 20];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let (mut hot, mut cold) = (0.0, 0.0);
        let steps: usize = std::env::var("STEPS").map_or(200, |s| s.parse().unwrap());
        pool.install(|| {
            for s in 0..steps {
                // Weights stream through the caches between steps.
                evict
                    .iter_mut()
                    .step_by(64)
                    .for_each(|x| *x = x.wrapping_add(1));
                let t = Instant::now();
                for c in &caches {
                    paged_attention(&q, &c.k, &c.v, &meta, &p, &mut out);
                }
                if s > 0 {
                    cold += t.elapsed().as_secs_f64();
                }
                let t = Instant::now();
                for c in &caches {
                    paged_attention(&q, &c.k, &c.v, &meta, &p, &mut out);
                }
                if s > 0 {
                    hot += t.elapsed().as_secs_f64();
                }
            }
        });
        let n = (steps - 1) as f64;
        println!("KV {} ctx {ctx} rows {rows} threads {threads}: per step of {layers} layers: cold {:.2} ms, hot {:.2} ms", kv.name(), cold / n * 1e3, hot / n * 1e3);
    }
}
