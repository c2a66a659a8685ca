//! The paged varlen attention op against a naive reference (contiguous K/V, f64 math) on
//! random ragged steps mixing long prefill chunks and single-token decodes, for every KV
//! cache dtype; and the caches' stored values bit for bit against a scalar reference.

use ferrite_model::backend::cpu::attention::{paged_attention_isa, AttentionMeta, AttentionParams};
use ferrite_model::backend::cpu::kv_cache::{CacheShape, LayerCache, Pages};
use ferrite_model::backend::cpu::quant::Isa;
use ferrite_model::kv_dtype::KvCacheDtype;
use float8::F8E4M3;
use half::{bf16, f16};
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
    kv: KvCacheDtype,
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

/// One token's K or V row as a cache of `kv` holds it, written independently of the
/// cache's code: f16/bf16 rounding, or per head a scale (`amax / 127`, `amax / 448`) and
/// codes rounded to nearest (fp8 through the `float8` crate).
fn as_stored(x: &[f32], d: usize, kv: KvCacheDtype) -> Vec<f32> {
    x.chunks(d)
        .flat_map(|h| {
            let amax = h.iter().fold(0f32, |m, v| m.max(v.abs()));
            h.iter()
                .map(|&v| match kv {
                    KvCacheDtype::Fp32 => v,
                    KvCacheDtype::Auto | KvCacheDtype::Fp16 => f16::from_f32(v).to_f32(),
                    KvCacheDtype::Bf16 => bf16::from_f32(v).to_f32(),
                    _ if amax == 0.0 => 0.0,
                    KvCacheDtype::Int8 => {
                        let s = amax / 127.0;
                        // An int8 code has no -0.
                        (v / s).round_ties_even() as i8 as f32 * s
                    }
                    KvCacheDtype::Fp8 => {
                        let s = amax / 448.0;
                        F8E4M3::from_f32(v / s).to_f32() * s
                    }
                })
                .collect::<Vec<f32>>()
        })
        .collect()
}

/// A cache whose unwritten values read as NaN (f16/bf16 values, 8-bit scales), so a
/// kernel that reads a slot it should not poisons its output.
fn poisoned_cache(shape: CacheShape, kv: KvCacheDtype) -> LayerCache {
    let n = shape.num_blocks * shape.block_size * shape.row();
    let pages = || match kv {
        KvCacheDtype::Fp32 => Pages::F32(vec![f32::NAN; n]),
        KvCacheDtype::Auto | KvCacheDtype::Fp16 => Pages::F16(vec![f16::NAN; n]),
        KvCacheDtype::Bf16 => Pages::Bf16(vec![bf16::NAN; n]),
        KvCacheDtype::Fp8 => Pages::Fp8 {
            codes: vec![0; n],
            scales: vec![f32::NAN; n / shape.head_dim],
        },
        KvCacheDtype::Int8 => Pages::Int8 {
            codes: vec![0; n],
            scales: vec![f32::NAN; n / shape.head_dim],
        },
    };
    LayerCache {
        k: pages(),
        v: pages(),
        shape,
    }
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
    let mut cache = poisoned_cache(shape, c.kv);
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
        let k: Vec<Vec<f32>> = (0..total).map(|_| rand_vec(row, rng)).collect();
        let v: Vec<Vec<f32>> = (0..total).map(|_| rand_vec(row, rng)).collect();
        // Every position goes in through the slot-mapping write op.
        let slots: Vec<u32> = (0..total)
            .map(|p| table[p / c.block_size] * c.block_size as u32 + (p % c.block_size) as u32)
            .collect();
        cache.write(&k.concat(), &v.concat(), &slots);
        // The reference sees K/V as the cache holds them.
        let k: Vec<Vec<f32>> = k.iter().map(|r| as_stored(r, c.d, c.kv)).collect();
        let v: Vec<Vec<f32>> = v.iter().map(|r| as_stored(r, c.d, c.kv)).collect();
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
    let full = (
        vec![1, 4, 16, 32],
        vec![(4, 4), (8, 2), (9, 3), (6, 1)],
        vec![32, 64, 128, 256],
    );
    let some = (vec![4, 16], vec![(8, 2), (6, 1)], vec![64, 128]);
    for isa in Isa::available() {
        for kv in [
            KvCacheDtype::Fp32,
            KvCacheDtype::Fp16,
            KvCacheDtype::Bf16,
            KvCacheDtype::Fp8,
            KvCacheDtype::Int8,
        ] {
            // Every shape for f16; the others share its kernels past the widening.
            let (sizes, heads_list, dims) = if kv == KvCacheDtype::Fp16 {
                &full
            } else {
                &some
            };
            for &block_size in sizes {
                for &(heads, kv_heads) in heads_list {
                    for &d in dims {
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
                                kv,
                            };
                            let err = run_case(&mut rng, &c, isa);
                            assert!(
                                err < 2e-5,
                                "max abs error {err} ({} kernels, KV {}, block {block_size}, \
                                 {heads}/{kv_heads} heads, d {d}, window {window:?}, softcap \
                                 {softcap:?}, sinks {:?}, causal {causal})",
                                isa.name(),
                                kv.name(),
                                c.sinks.is_some()
                            );
                            worst = worst.max(err);
                            n += 1;
                        }
                    }
                }
            }
        }
    }
    let isas: Vec<_> = Isa::available().iter().map(|i| i.name()).collect();
    println!("{n} random ragged steps ({isas:?}), worst max abs error {worst:e}");
}

/// What each cache dtype stores, read back through every kernel set's widening, is bit for
/// bit the scalar reference's value, for every (block, head) slice, K and V; with outliers
/// and an all-zero head among the rows.
#[test]
fn stored_values_match_the_scalar_reference_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(11);
    for kv in [
        KvCacheDtype::Fp32,
        KvCacheDtype::Fp16,
        KvCacheDtype::Bf16,
        KvCacheDtype::Fp8,
        KvCacheDtype::Int8,
    ] {
        for (block_size, d) in [(16, 64), (5, 32), (16, 256)] {
            let shape = CacheShape {
                num_blocks: 6,
                block_size,
                num_kv_heads: 3,
                head_dim: d,
            };
            let (row, tokens) = (shape.row(), 6 * block_size);
            let mut x: Vec<f32> = (0..2 * tokens * row)
                .map(|i| {
                    let v: f32 = rng.random_range(-1.0..1.0);
                    if i % 41 == 0 {
                        v * 300.0
                    } else {
                        v * 1e-3f32.max((i % 7) as f32)
                    }
                })
                .collect();
            x[row..row + d].fill(0.0); // token 1, head 0 of K: all zero
            let (k, v) = x.split_at(tokens * row);
            let mut cache = LayerCache::new(shape, kv);
            let slots: Vec<u32> = (0..tokens as u32).rev().collect();
            cache.write(k, v, &slots);
            for isa in Isa::available() {
                let (mut kt, mut vb) = (vec![0f32; d * block_size], vec![0f32; d * block_size]);
                for blk in 0..shape.num_blocks {
                    for h in 0..shape.num_kv_heads {
                        let head = blk * shape.num_kv_heads + h;
                        cache.k.widen_k(head, d, block_size, &mut kt, isa);
                        cache.v.widen_v(head, d, block_size, &mut vb, isa);
                        for j in 0..block_size {
                            let t = tokens - 1 - (blk * block_size + j);
                            let at = t * row + h * d;
                            let (want_k, want_v) = (
                                as_stored(&k[at..][..d], d, kv),
                                as_stored(&v[at..][..d], d, kv),
                            );
                            for i in 0..d {
                                assert_eq!(
                                    kt[i * block_size + j].to_bits(),
                                    want_k[i].to_bits(),
                                    "{} K {} token {t} head {h} dim {i}",
                                    kv.name(),
                                    isa.name()
                                );
                                assert_eq!(
                                    vb[j * d + i].to_bits(),
                                    want_v[i].to_bits(),
                                    "{} V {} token {t} head {h} dim {i}",
                                    kv.name(),
                                    isa.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
