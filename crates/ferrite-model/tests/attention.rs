//! The paged varlen attention op against a naive reference (contiguous K/V, f64 math) on
//! random ragged steps mixing long prefill chunks and single-token decodes.

use ferrite_model::backend::cpu::attention::{paged_attention_isa, AttentionMeta, AttentionParams};
use ferrite_model::backend::cpu::kv_cache::{write_kv, CacheShape, LayerCache};
use ferrite_model::backend::cpu::quant::Isa;
use half::f16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

struct Case {
    block_size: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    /// Per query head, a logit in the softmax with no value (attention sinks).
    sinks: Option<Vec<f32>>,
    /// False: every row sees all of its request's keys (encoders).
    causal: bool,
}

/// Naive attention of one query row over contiguous keys (causal, or all of them), in f64.
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f32],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    pos: usize,
    h: usize,
    kvh: usize,
    c: &Case,
) -> Vec<f64> {
    let d = c.d;
    let (first, last) = match c.causal {
        true => (c.window.map_or(0, |w| (pos + 1).saturating_sub(w)), pos),
        false => (0, k.len() - 1),
    };
    let scale = 1.0 / (d as f64).sqrt();
    let scores: Vec<f64> = (first..=last)
        .map(|j| {
            let s: f64 = (0..d)
                .map(|i| q[h * d + i] as f64 * k[j][kvh * d + i] as f64)
                .sum::<f64>()
                * scale;
            c.softcap
                .map_or(s, |cap| cap as f64 * (s / cap as f64).tanh())
        })
        .collect();
    let sink = c.sinks.as_ref().map(|s| s[h] as f64);
    let m = scores
        .iter()
        .cloned()
        .fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = w.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
    (0..d)
        .map(|i| {
            (first..=last)
                .zip(&w)
                .map(|(j, w)| w * v[j][kvh * d + i] as f64)
                .sum::<f64>()
                / z
        })
        .collect()
}

fn as_f16(x: Vec<f32>) -> Vec<f32> {
    x.into_iter().map(|v| f16::from_f32(v).to_f32()).collect()
}

fn run_case(rng: &mut StdRng, c: &Case, isa: Isa) -> f64 {
    let row = c.kv_heads * c.d;
    let nreq = rng.random_range(1..7);
    // (context already cached, new tokens this step): decodes, short and long chunks.
    let shapes: Vec<(usize, usize)> = (0..nreq)
        .map(|_| match rng.random_range(0..3) {
            0 => (rng.random_range(0..1200), 1),
            1 => (rng.random_range(0..600), rng.random_range(1..40)),
            _ => (rng.random_range(0..20), rng.random_range(100..300)),
        })
        .collect();
    let blocks_needed: usize = shapes
        .iter()
        .map(|&(c0, n)| (c0 + n).div_ceil(c.block_size))
        .sum();
    let num_blocks = blocks_needed + 7;
    let mut free: Vec<u32> = (0..num_blocks as u32).collect();
    free.shuffle(rng);
    let shape = CacheShape {
        num_blocks,
        block_size: c.block_size,
        num_kv_heads: c.kv_heads,
        head_dim: c.d,
    };
    let mut cache = LayerCache {
        k: vec![f16::NAN; num_blocks * c.block_size * row],
        v: vec![f16::NAN; num_blocks * c.block_size * row],
        shape,
    };
    let max_blocks = shapes
        .iter()
        .map(|&(c0, n)| (c0 + n).div_ceil(c.block_size))
        .max()
        .unwrap();
    let mut tables = vec![0u32; nreq * max_blocks];
    let mut cu = vec![0u32];
    let mut seq_lens = Vec::new();
    let (mut q, mut all_k, mut all_v, mut positions) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let rand_vec = |n: usize, rng: &mut StdRng| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
    };
    for (b, &(ctx, n)) in shapes.iter().enumerate() {
        let total = ctx + n;
        let table: Vec<u32> = (0..total.div_ceil(c.block_size))
            .map(|_| free.pop().unwrap())
            .collect();
        tables[b * max_blocks..b * max_blocks + table.len()].copy_from_slice(&table);
        // K/V as the f16 cache holds them, so the reference sees the same inputs.
        let k: Vec<Vec<f32>> = (0..total).map(|_| as_f16(rand_vec(row, rng))).collect();
        let v: Vec<Vec<f32>> = (0..total).map(|_| as_f16(rand_vec(row, rng))).collect();
        // Every position goes in through the slot-mapping write op.
        let slots: Vec<u32> = (0..total)
            .map(|p| table[p / c.block_size] * c.block_size as u32 + (p % c.block_size) as u32)
            .collect();
        write_kv(&mut cache, &k.concat(), &v.concat(), &slots, &shape);
        for p in ctx..total {
            q.extend(rand_vec(c.heads * c.d, rng));
            positions.push((b, p));
        }
        all_k.push(k);
        all_v.push(v);
        cu.push(cu.last().unwrap() + n as u32);
        seq_lens.push(total as u32);
    }
    let meta = AttentionMeta {
        cu_seqlens_q: &cu,
        seq_lens_k: &seq_lens,
        block_tables: &tables,
        max_blocks,
        block_size: c.block_size,
    };
    let params = AttentionParams {
        num_heads: c.heads,
        num_kv_heads: c.kv_heads,
        head_dim: c.d,
        scale: 1.0 / (c.d as f32).sqrt(),
        sliding_window: c.window,
        softcap: c.softcap,
        causal: c.causal,
        sinks: c.sinks.as_deref(),
    };
    let mut out = vec![0f32; q.len()];
    paged_attention_isa(isa, &q, &cache.k, &cache.v, &meta, &params, &mut out);
    // A row alone in its step gets the same bits as inside its packed tile.
    let width = c.heads * c.d;
    for (t, &(b, pos)) in positions.iter().enumerate().step_by(7) {
        let alone = AttentionMeta {
            cu_seqlens_q: &[0, 1],
            seq_lens_k: &[match c.causal {
                true => pos as u32 + 1,
                false => all_k[b].len() as u32,
            }],
            block_tables: &tables[b * max_blocks..(b + 1) * max_blocks],
            max_blocks,
            block_size: c.block_size,
        };
        let mut o = vec![0f32; width];
        paged_attention_isa(
            isa,
            &q[t * width..][..width],
            &cache.k,
            &cache.v,
            &alone,
            &params,
            &mut o,
        );
        assert!(
            o.iter()
                .zip(&out[t * width..][..width])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "row {t} (request {b}, position {pos}) differs alone and packed"
        );
    }
    let group = c.heads / c.kv_heads;
    let mut max_err = 0f64;
    for (t, &(b, pos)) in positions.iter().enumerate() {
        let qt = &q[t * c.heads * c.d..(t + 1) * c.heads * c.d];
        for h in 0..c.heads {
            let want = reference(qt, &all_k[b], &all_v[b], pos, h, h / group, c);
            for (i, w) in want.iter().enumerate() {
                let got = out[(t * c.heads + h) * c.d + i] as f64;
                max_err = max_err.max((got - w).abs());
            }
        }
    }
    max_err
}

#[test]
fn paged_attention_matches_naive_reference() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut worst = 0f64;
    let mut n = 0;
    for isa in Isa::available() {
        for block_size in [1, 4, 16, 32] {
            for (heads, kv_heads) in [(4, 4), (8, 2), (9, 3), (6, 1)] {
                for d in [32, 64, 128, 256] {
                    for (window, softcap, sinks, causal) in [
                        (None, None, false, true),
                        (Some(37), None, false, true),
                        (None, Some(30.0), false, true),
                        (Some(37), None, true, true),
                        (None, None, false, false),
                    ] {
                        // Sinks around the scores' scale, so they weigh as much as keys do.
                        let sinks = sinks
                            .then(|| (0..heads).map(|_| rng.random_range(-2.0..3.0)).collect());
                        let c = Case {
                            block_size,
                            heads,
                            kv_heads,
                            d,
                            window,
                            softcap,
                            sinks,
                            causal,
                        };
                        let err = run_case(&mut rng, &c, isa);
                        assert!(
                        err < 2e-5,
                        "max abs error {err} ({} kernels, block {block_size}, {heads}/{kv_heads} heads, d {d}, window {window:?}, softcap {softcap:?}, sinks {:?}, causal {causal})",
                        isa.name(),
                        c.sinks.is_some()
                    );
                        worst = worst.max(err);
                        n += 1;
                    }
                }
            }
        }
    }
    let isas: Vec<_> = Isa::available().iter().map(|i| i.name()).collect();
    println!("{n} random ragged steps ({isas:?}), worst max abs error {worst:e}");
}
