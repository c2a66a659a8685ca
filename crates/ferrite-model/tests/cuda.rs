//! ferrite's CUDA kernels and CUDA model against independent references, on the device
//! (built only with `--features cuda`; run on a GPU host by `scripts/cuda/check.sh`).
//! Attention: a naive f64 host computation over the same bf16 K/V, random ragged steps with
//! prefill chunks up to 8K tokens and decodes at contexts up to 32K, several GQA ratios, head
//! sizes and block sizes. Model: the CPU backend (f32 weights) on the same GGUF, teacher-forced.
#![cfg(feature = "cuda")]

mod common;
mod suite;

use candle_core::{DType, Device, Tensor};
use ferrite_model::backend::cuda::graph::GraphShape;
use ferrite_model::backend::cuda::kernels::attention::{AttentionMeta, AttentionShape};
use ferrite_model::backend::cuda::kernels::matmul::MatIn;
use ferrite_model::backend::cuda::kernels::Kernels;
use ferrite_model::backend::cuda::linear::Linear;
use ferrite_model::backend::cuda::{CudaBackend, KvPages};
use ferrite_model::backend::Activation;
use ferrite_model::checkpoint::open_weights;
use ferrite_model::config::RopeStyle;
use ferrite_model::kv_dtype::KvCacheDtype;
use ferrite_model::loader::{load_cpu_decoder, LoadFormat, WeightFormat};
use ferrite_model::models::{self, Model};
use ferrite_model::sampler::argmax;
use ferrite_model::step::{PackedStep, StepModel};
use ferrite_model::tokenizer::ModelTokenizer;
use ferrite_model::weights::gguf::GgufFile;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

fn device() -> Device {
    ferrite_model::backend::cuda::open_device(0)
        .expect("a CUDA GPU (these tests run on the GPU host)")
}

/// A checkpoint (GGUF or Hugging Face folder) on the GPU, weights bf16 or, with `quantized`,
/// the GGUF's blocks as they are; KV cache not yet allocated.
fn gpu_model(path: &std::path::Path, quantized: bool, max_pos: usize) -> Model<CudaBackend> {
    let backend = CudaBackend::new(device(), quantized, "cuda:0".into()).unwrap();
    let (src, mut w) = open_weights(path, LoadFormat::Auto).unwrap();
    models::load(backend, &src, &mut w, max_pos, &mut |_, _| {}).unwrap()
}

fn test_model() -> String {
    std::env::var("FERRITE_CUDA_TEST_MODEL")
        .expect("FERRITE_CUDA_TEST_MODEL: a Llama-family GGUF (scripts/cuda/check.sh sets it)")
}

/// Decode graphs as the loader sets them up, padding into block `scratch` (and, with
/// linear-attention layers, state slot 5: the one after the tests' five requests').
fn enable_graphs(m: &mut Model<CudaBackend>, max_batch: usize, scratch: usize, bs: usize) {
    enable_graphs_with_slot(m, max_batch, scratch, bs, 5);
}

fn enable_graphs_with_slot(
    m: &mut Model<CudaBackend>,
    max_batch: usize,
    scratch: usize,
    bs: usize,
    state_scratch: u32,
) {
    let c = m.config.clone();
    let shape = GraphShape {
        max_batch,
        scratch_block: scratch as u32,
        state_scratch: (m.state_bytes_per_slot() > 0).then_some(state_scratch),
        block_size: bs,
        max_seq_len: m.max_positions(),
        heads: (c.num_heads, c.num_kv_heads, c.head_dim),
        kv_groups: m.layout.groups.len(),
    };
    m.backend.enable_decode_graphs(shape).unwrap();
}

fn kernels(dev: &Device) -> Kernels {
    let Device::Cuda(d) = dev else { unreachable!() };
    Kernels::load(d).unwrap()
}

fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn u32s(v: &[u32], dev: &Device) -> Tensor {
    Tensor::from_slice(v, v.len(), dev).unwrap()
}

/// Heads `(query, KV, size)` in pages of `bs` tokens, scaled by 1 / sqrt(size).
fn attention_shape(
    (h, hkv, d): (usize, usize, usize),
    bs: usize,
    window: usize,
    softcap: f32,
) -> AttentionShape {
    AttentionShape {
        num_heads: h,
        num_kv_heads: hkv,
        head_dim: d,
        block_size: bs,
        scale: 1.0 / (d as f32).sqrt(),
        sliding_window: window,
        softcap,
    }
}

/// Paged attention of `q`'s rows over the requests of `step` (its first KV group's tables).
fn attend(
    k: &Kernels,
    q: &Tensor,
    cache: &KvPages,
    step: &PackedStep,
    shape: &AttentionShape,
    sinks: Option<&Tensor>,
) -> Vec<f32> {
    let dev = q.device();
    let (cu, sk) = (u32s(&step.cu_seqlens_q, dev), u32s(&step.seq_lens_k, dev));
    let bt = u32s(&step.kv[0].block_tables, dev);
    let meta = AttentionMeta {
        cu_seqlens_q: &cu,
        seq_lens_k: &sk,
        block_tables: &bt,
        max_blocks: step.kv[0].max_blocks,
        num_seqs: step.num_seqs(),
        num_tokens: step.num_tokens(),
        max_seq_len: *step.seq_lens_k.iter().max().unwrap() as usize,
        splits: None,
    };
    host(&k.paged_attention(q, cache, &meta, shape, sinks).unwrap())
}

struct Case {
    name: &'static str,
    heads: usize,
    kv_heads: usize,
    d: usize,
    block_size: usize,
    /// (new query tokens, K/V length after the step) per request.
    seqs: Vec<(usize, usize)>,
    window: usize,
    softcap: f32,
    /// Attention sinks, one per query head (bf16 values).
    sinks: Option<Vec<f32>>,
    /// Check every `stride`-th query token (the reference is slow on 8K prefills).
    stride: usize,
}

/// One query row, naive softmax attention in f64 over the request's keys.
#[allow(clippy::too_many_arguments)]
fn reference_row(
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    table: &[u32],
    pos: usize,
    kvh: usize,
    head: usize,
    c: &Case,
) -> Vec<f64> {
    let (d, bs) = (c.d, c.block_size);
    let at = |k: usize| ((table[k / bs] as usize * c.kv_heads + kvh) * bs + k % bs) * d;
    let first = if c.window > 0 {
        (pos + 1).saturating_sub(c.window)
    } else {
        0
    };
    let scale = 1.0 / (d as f64).sqrt();
    let scores: Vec<f64> = (first..=pos)
        .map(|k| {
            let s = (0..d)
                .map(|i| q[i] as f64 * kc[at(k) + i] as f64)
                .sum::<f64>()
                * scale;
            if c.softcap > 0.0 {
                c.softcap as f64 * (s / c.softcap as f64).tanh()
            } else {
                s
            }
        })
        .collect();
    let sink = c.sinks.as_ref().map(|s| s[head] as f64);
    let m = scores
        .iter()
        .cloned()
        .fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = w.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
    (0..d)
        .map(|i| {
            (first..=pos)
                .zip(&w)
                .map(|(k, w)| w * vc[at(k) + i] as f64)
                .sum::<f64>()
                / z
        })
        .collect()
}

/// K and V of `pages` on the host as attention should read them: bf16 values, or each code's
/// value (fp8 through the `float8` crate) times its token's scale.
fn host_pages(pages: &KvPages) -> (Vec<f32>, Vec<f32>) {
    let Some((ks, vs)) = &pages.scales else {
        return (host(&pages.k), host(&pages.v));
    };
    let d = pages.k.dims()[3];
    let values = |codes: &Tensor, scales: &Tensor| -> Vec<f32> {
        let codes: Vec<u8> = codes.flatten_all().unwrap().to_vec1().unwrap();
        let scales = host(scales);
        codes
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let v = match pages.dtype {
                    KvCacheDtype::Fp8 => float8::F8E4M3::from_bits(c).to_f32(),
                    _ => c as i8 as f32,
                };
                v * scales[i / d]
            })
            .collect()
    };
    (values(&pages.k, ks), values(&pages.v, vs))
}

fn run_attention_case(c: &Case, seed: u64, kv: KvCacheDtype) {
    let dev = device();
    let k = kernels(&dev);
    let mut rng = StdRng::seed_from_u64(seed);
    let (h, hkv, d, bs) = (c.heads, c.kv_heads, c.d, c.block_size);
    let blocks_needed: usize = c.seqs.iter().map(|&(_, ctx)| ctx.div_ceil(bs)).sum();
    let num_blocks = blocks_needed + 3;
    let mut pages: Vec<u32> = (0..num_blocks as u32).collect();
    pages.shuffle(&mut rng);
    let mut step = PackedStep::default();
    let mut tables = Vec::new();
    let mut next = 0;
    for &(qlen, ctx) in &c.seqs {
        let n = ctx.div_ceil(bs);
        let table = pages[next..next + n].to_vec();
        next += n;
        let ids = vec![0u32; qlen];
        step.push(&ids, ctx - qlen, std::slice::from_ref(&table), bs);
        tables.push(table);
    }
    step.finish();
    let t = step.num_tokens();
    let mut cache = KvPages::zeros(num_blocks, hkv, bs, d, kv, &dev).unwrap();
    cache.randomize().unwrap();
    let q = Tensor::randn(0f32, 1.0, (t, h * d), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let shape = attention_shape((h, hkv, d), bs, c.window, c.softcap);
    let sinks = c.sinks.as_ref().map(|v| {
        Tensor::from_vec(v.clone(), v.len(), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    });
    let out = attend(&k, &q, &cache, &step, &shape, sinks.as_ref());
    let qh = host(&q);
    let (kh, vh) = host_pages(&cache);
    // (token row, request, position) of every checked query token.
    let mut rows = Vec::new();
    for (i, &(qlen, ctx)) in c.seqs.iter().enumerate() {
        let first = step.cu_seqlens_q[i] as usize;
        for j in (0..qlen).filter(|j| j % c.stride == 0 || *j == qlen - 1) {
            rows.push((first + j, i, ctx - qlen + j));
        }
    }
    let errs: Vec<(f64, f64, f64)> = rows
        .par_iter()
        .flat_map_iter(|&(row, seq, pos)| {
            let (qh, kh, vh, out, tables) = (&qh, &kh, &vh, &out, &tables);
            (0..h).map(move |head| {
                let r = reference_row(
                    &qh[(row * h + head) * d..][..d],
                    kh,
                    vh,
                    &tables[seq],
                    pos,
                    head / (h / hkv),
                    head,
                    c,
                );
                let got = &out[(row * h + head) * d..][..d];
                let mut worst = 0f64;
                let (mut e2, mut r2) = (0f64, 0f64);
                for (g, r) in got.iter().zip(&r) {
                    let e = (*g as f64 - r).abs();
                    assert!(e.is_finite(), "{}: non-finite output", c.name);
                    worst = worst.max(e / (1.0 + r.abs()));
                    e2 += e * e;
                    r2 += r * r;
                }
                (worst, e2, r2)
            })
        })
        .collect();
    let worst = errs.iter().map(|e| e.0).fold(0f64, f64::max);
    let rel_l2 =
        (errs.iter().map(|e| e.1).sum::<f64>() / errs.iter().map(|e| e.2).sum::<f64>()).sqrt();
    println!(
        "attention {:<28} KV {} T={t:<6} rows checked {:<7} max |err|/(1+|ref|) {worst:.2e}  rel L2 {rel_l2:.2e}",
        c.name,
        kv.name(),
        errs.len()
    );
    // bf16 output: half an ulp is 2^-9 of the value; f32 accumulation adds far less. 8-bit
    // pages are widened to bf16 (another 2^-9 on each K and V value).
    let slack = if kv.is_8bit() { 2.0 } else { 1.0 };
    assert!(worst < 8e-3 * slack, "{}: max error {worst}", c.name);
    assert!(
        rel_l2 < 4e-3 * slack,
        "{}: relative L2 error {rel_l2}",
        c.name
    );
}

#[test]
fn attention_ragged_steps() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut mixed = |n: usize, max_ctx: usize| -> Vec<(usize, usize)> {
        (0..n)
            .map(|_| {
                let ctx = rng.random_range(1..=max_ctx);
                let q = if rng.random_bool(0.5) {
                    1
                } else {
                    rng.random_range(1..=ctx.min(300))
                };
                (q, ctx)
            })
            .collect()
    };
    // Sinks around the scores' scale, rounded to bf16 as the kernels read them.
    let sinks = |n: usize, seed: u64| -> Option<Vec<f32>> {
        let mut r = StdRng::seed_from_u64(seed);
        Some(
            (0..n)
                .map(|_| half::bf16::from_f32(r.random_range(-2.0..3.0)).to_f32())
                .collect(),
        )
    };
    let cases = [
        Case {
            name: "sinks, gqa8 d64, window 128 (gpt-oss)",
            heads: 64,
            kv_heads: 8,
            d: 64,
            block_size: 16,
            seqs: mixed(6, 1500),
            window: 128,
            softcap: 0.0,
            sinks: sinks(64, 1),
            stride: 5,
        },
        Case {
            name: "sinks, d256",
            heads: 8,
            kv_heads: 2,
            d: 256,
            block_size: 16,
            seqs: mixed(6, 900),
            window: 0,
            softcap: 0.0,
            sinks: sinks(8, 2),
            stride: 3,
        },
        Case {
            name: "mha d64 bs16",
            heads: 4,
            kv_heads: 4,
            d: 64,
            block_size: 16,
            seqs: mixed(9, 700),
            window: 0,
            softcap: 0.0,
            sinks: None,
            stride: 1,
        },
        Case {
            name: "gqa4 d128 bs16",
            heads: 32,
            kv_heads: 8,
            d: 128,
            block_size: 16,
            seqs: mixed(12, 3000),
            window: 0,
            softcap: 0.0,
            sinks: None,
            stride: 3,
        },
        Case {
            name: "gqa3 d64 bs32 (SmolLM2)",
            heads: 9,
            kv_heads: 3,
            d: 64,
            block_size: 32,
            seqs: mixed(8, 1500),
            window: 0,
            softcap: 0.0,
            sinks: None,
            stride: 2,
        },
        Case {
            name: "gqa7 d128 bs16 (Qwen2)",
            heads: 28,
            kv_heads: 4,
            d: 128,
            block_size: 16,
            seqs: mixed(6, 2000),
            window: 0,
            softcap: 0.0,
            sinks: None,
            stride: 3,
        },
        Case {
            name: "gqa16 d256 bs64",
            heads: 16,
            kv_heads: 1,
            d: 256,
            block_size: 64,
            seqs: mixed(5, 1200),
            window: 0,
            softcap: 0.0,
            sinks: None,
            stride: 3,
        },
        Case {
            name: "window 256 + softcap 30",
            heads: 8,
            kv_heads: 2,
            d: 128,
            block_size: 16,
            seqs: mixed(7, 1500),
            window: 256,
            softcap: 30.0,
            sinks: None,
            stride: 2,
        },
    ];
    for (i, c) in cases.iter().enumerate() {
        for kv in [KvCacheDtype::Bf16, KvCacheDtype::Fp8, KvCacheDtype::Int8] {
            run_attention_case(c, i as u64, kv);
        }
    }
}

#[test]
fn attention_long_prefill_and_decodes() {
    let cases = [
        Case {
            name: "8K prefill chunk + decodes",
            heads: 8,
            kv_heads: 2,
            d: 128,
            block_size: 16,
            seqs: vec![(8192, 8192), (1, 100), (1, 5000), (512, 9000)],
            window: 0,
            softcap: 0.0,
            sinks: None,
            stride: 61,
        },
        Case {
            name: "decodes at 32K, gqa4",
            heads: 32,
            kv_heads: 8,
            d: 128,
            block_size: 16,
            seqs: vec![(1, 32768), (1, 32000), (1, 17), (1, 20000)],
            window: 0,
            softcap: 0.0,
            sinks: None,
            stride: 1,
        },
        Case {
            name: "decodes at 20K with sinks (split keys, merged)",
            heads: 64,
            kv_heads: 8,
            d: 64,
            block_size: 16,
            seqs: vec![(1, 20000), (1, 9000), (1, 33)],
            window: 0,
            softcap: 0.0,
            sinks: Some((0..64).map(|i| (i % 7) as f32 - 2.0).collect()),
            stride: 1,
        },
        Case {
            name: "lone decode at 32K, bs32",
            heads: 32,
            kv_heads: 8,
            d: 128,
            block_size: 32,
            seqs: vec![(1, 32768)],
            window: 0,
            softcap: 0.0,
            sinks: None,
            stride: 1,
        },
    ];
    for (i, c) in cases.iter().enumerate() {
        run_attention_case(c, 100 + i as u64, KvCacheDtype::Bf16);
    }
}

/// The fused split + bias + Q/K norm + rotary + cache write against a host computation.
/// The matmuls with the RMSNorm of residual rows before them folded in and the residual add or
/// the SiLU-mul of interleaved gate|up columns after, against the host on the same bf16
/// values (1 to 3 rows; the fused small-row kernels take up to 8). Then bf16 rows added into
/// the residual, 1 to 9 rows (9 through cuBLAS), and row 0 of 1 to 8 bit-identical: a row's
/// sum does not depend on how many rows share the kernel.
#[test]
fn folded_matmuls_match_host() {
    let dev = device();
    let kern = kernels(&dev);
    let round = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect()
    };
    let rand = |shape: (usize, usize), dtype: DType| {
        Tensor::randn(0f32, 1.0, shape, &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    // out[m, j] = sum_i a[m, i] w[j, i] in f64.
    let reference = |a: &[f32], w: &[f32], k: usize| -> Vec<f64> {
        a.chunks(k)
            .flat_map(|row| {
                w.chunks(k).map(move |col| {
                    row.iter()
                        .zip(col)
                        .map(|(&x, &y)| x as f64 * y as f64)
                        .sum::<f64>()
                })
            })
            .collect()
    };
    let worst = |got: &[f32], want: &[f64]| {
        assert_eq!(got.len(), want.len());
        got.iter()
            .zip(want)
            .map(|(&g, &w)| (g as f64 - w).abs() / (1.0 + w.abs()))
            .fold(0f64, f64::max)
    };
    let (n, k, eps) = (1000, 576, 1e-5f32);
    let wt = rand((n, k), DType::BF16);
    let wh = host(&wt);
    let w = Linear::Dense(wt);
    let norm = rand((1, k), DType::BF16).flatten_all().unwrap();
    let normh = host(&norm);
    let a9 = rand((9, k), DType::BF16);
    let alone = host(
        &kern
            .matmul(MatIn::Bf16(&a9.narrow(0, 0, 1).unwrap()), &w, DType::F32)
            .unwrap(),
    );
    for r in 1..=9 {
        let a = a9.narrow(0, 0, r).unwrap();
        let res = rand((r, n), DType::F32);
        let before = host(&res);
        kern.matmul_add(MatIn::Bf16(&a), &w, &res).unwrap();
        let added: Vec<f32> = host(&res).iter().zip(&before).map(|(x, y)| x - y).collect();
        let e_add = worst(&added, &reference(&host(&a), &wh, k));
        assert!(e_add < 1e-4, "{r} rows, add: {e_add}");
        if r <= 8 {
            let got = host(&kern.matmul(MatIn::Bf16(&a), &w, DType::F32).unwrap());
            let same = got[..n]
                .iter()
                .zip(&alone)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "row 0 of {r} rows rounds otherwise than alone");
        }
    }
    for r in 1..=3 {
        // RMSNorm of residual rows picked by `rows` (last first), bf16 out.
        let x = rand((4, k), DType::F32);
        let rows_v: Vec<u32> = (0..r as u32).rev().map(|i| i + 1).collect();
        let rows = u32s(&rows_v, &dev);
        let xh = host(&x);
        let normed: Vec<f32> = rows_v
            .iter()
            .flat_map(|&s| {
                let row = &xh[s as usize * k..][..k];
                let ss = row.iter().map(|v| v * v).sum::<f32>();
                let inv = 1.0 / (ss / k as f32 + eps).sqrt();
                round(
                    &row.iter()
                        .zip(&normh)
                        .map(|(v, g)| v * inv * g)
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        let input = MatIn::Rms {
            x: &x,
            rows: Some(&rows),
            norm: &norm,
            eps,
        };
        let got = host(&kern.matmul(input, &w, DType::BF16).unwrap());
        let e_norm = worst(&got, &reference(&normed, &wh, k));
        let input = MatIn::Rms {
            x: &x,
            rows: Some(&rows),
            norm: &norm,
            eps,
        };
        let got = host(&kern.matmul(input, &w, DType::F32).unwrap());
        let e_norm_f32 = worst(&got, &reference(&normed, &wh, k));
        // bf16 rows, added into the residual stream.
        let a = rand((r, k), DType::BF16);
        let res = rand((r, n), DType::F32);
        let before = host(&res);
        kern.matmul_add(MatIn::Bf16(&a), &w, &res).unwrap();
        let added: Vec<f32> = host(&res).iter().zip(&before).map(|(x, y)| x - y).collect();
        let e_add = worst(&added, &reference(&host(&a), &wh, k));
        // Interleaved gate|up rows, SiLU-mul of each pair.
        let input = MatIn::Rms {
            x: &x,
            rows: Some(&rows),
            norm: &norm,
            eps,
        };
        let got = host(&kern.matmul_gated(input, &w, Activation::Silu).unwrap());
        let act: Vec<f64> = reference(&normed, &wh, k)
            .chunks(2)
            .map(|p| {
                let (g, u) = (round(&[p[0] as f32])[0], round(&[p[1] as f32])[0]);
                (g / (1.0 + (-g).exp()) * u) as f64
            })
            .collect();
        let e_silu = worst(&got, &act);
        // The same pairs through GELU (tanh approximation), Gemma's activation.
        let input = MatIn::Rms {
            x: &x,
            rows: Some(&rows),
            norm: &norm,
            eps,
        };
        let got = host(&kern.matmul_gated(input, &w, Activation::GeluTanh).unwrap());
        let gelu: Vec<f64> = reference(&normed, &wh, k)
            .chunks(2)
            .map(|p| {
                let (g, u) = (
                    round(&[p[0] as f32])[0] as f64,
                    round(&[p[1] as f32])[0] as f64,
                );
                let c = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u
            })
            .collect();
        let e_gelu = worst(&got, &gelu);
        // The residual plus the RMSNorm of the product (Gemma's post-norms), f32 throughout.
        let res = rand((r, n), DType::F32);
        let before = host(&res);
        let y = kern.matmul(MatIn::Bf16(&a), &w, DType::F32).unwrap();
        let post = rand((1, n), DType::BF16).flatten_all().unwrap();
        kern.add_rms_norm(&res, &y, &post, eps).unwrap();
        let (yh, posth) = (host(&y), host(&post));
        let want: Vec<f64> = yh
            .chunks(n)
            .zip(before.chunks(n))
            .flat_map(|(y, b)| {
                let inv = 1.0
                    / (y.iter().map(|v| (v * v) as f64).sum::<f64>() / n as f64 + eps as f64)
                        .sqrt();
                y.iter()
                    .zip(b)
                    .zip(&posth)
                    .map(move |((y, b), w)| *b as f64 + *y as f64 * inv * *w as f64)
                    .collect::<Vec<_>>()
            })
            .collect();
        let e_post = worst(&host(&res), &want);
        println!("  norm->gelu-mul {e_gelu:.2e}, add rms_norm {e_post:.2e}");
        assert!(e_gelu < 1e-2, "{r} rows, norm -> gelu-mul: {e_gelu}");
        assert!(e_post < 1e-4, "{r} rows, add rms_norm: {e_post}");
        println!(
            "folded matmuls, {r} rows: norm->bf16 {e_norm:.2e}, norm->f32 {e_norm_f32:.2e}, \
             add {e_add:.2e}, norm->silu-mul {e_silu:.2e} (max |err|/(1+|ref|))"
        );
        // bf16 output: its rounding (2^-9 relative), for SiLU-mul also that of gate and up;
        // f32 outputs: summation order only.
        assert!(e_norm < 4e-3, "{r} rows, norm -> bf16: {e_norm}");
        assert!(e_silu < 1e-2, "{r} rows, norm -> silu-mul: {e_silu}");
        for (what, e) in [("norm -> f32", e_norm_f32), ("add", e_add)] {
            assert!(e < 1e-4, "{r} rows, {what}: {e}");
        }
    }
}

/// `--batch-invariant`: a row's matmul result is the same bits at every row count (tiles of
/// 16, 64 and 128 rows) and wherever it sits in its tile, for every output mode, and close to
/// an f64 reference; a depth not a multiple of the 32-wide chunk and an odd width included.
#[test]
fn batch_invariant_matmuls_round_a_row_alike_at_any_row_count() {
    let dev = device();
    let kern = kernels(&dev);
    kern.set_batch_invariant(true);
    let rand = |shape: (usize, usize), dtype: DType| {
        Tensor::randn(0f32, 1.0, shape, &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let total = 300;
    for (n, k) in [(1000, 576), (77, 584)] {
        let wt = rand((n, k), DType::BF16);
        let (wh, w) = (host(&wt), Linear::Dense(wt));
        let x = rand((total, k), DType::BF16);
        let xh = host(&x);
        let all = host(&kern.matmul(MatIn::Bf16(&x), &w, DType::F32).unwrap());
        let worst = all
            .iter()
            .enumerate()
            .map(|(i, &g)| {
                let (row, col) = (&xh[i / n * k..][..k], &wh[i % n * k..][..k]);
                let want: f64 = row
                    .iter()
                    .zip(col)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum();
                (g as f64 - want).abs() / (1.0 + want.abs())
            })
            .fold(0f64, f64::max);
        assert!(worst < 1e-4, "[{n}, {k}]: {worst} from the f64 reference");
        let gated = (n % 2 == 0).then(|| {
            host(
                &kern
                    .matmul_gated(MatIn::Bf16(&x), &w, Activation::Silu)
                    .unwrap(),
            )
        });
        for rows in [1, 2, 5, 16, 17, 40, 64, 65, 130, 299] {
            // Rows from an offset, so each sits elsewhere in its tile than in the whole.
            let from = (total - rows).min(7);
            let part = x.narrow(0, from, rows).unwrap();
            let want = &all[from * n..(from + rows) * n];
            let got = host(&kern.matmul(MatIn::Bf16(&part), &w, DType::F32).unwrap());
            assert_eq!(
                bits(&got),
                bits(want),
                "[{n}, {k}], {rows} rows from {from}: f32"
            );
            let got = host(&kern.matmul(MatIn::Bf16(&part), &w, DType::BF16).unwrap());
            let rounded: Vec<f32> = want
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            assert_eq!(bits(&got), bits(&rounded), "{rows} rows: bf16");
            let res = rand((rows, n), DType::F32);
            let sum: Vec<f32> = host(&res).iter().zip(want).map(|(a, b)| a + b).collect();
            kern.matmul_add(MatIn::Bf16(&part), &w, &res).unwrap();
            assert_eq!(bits(&host(&res)), bits(&sum), "{rows} rows: residual add");
            if let Some(gated) = &gated {
                let got = host(
                    &kern
                        .matmul_gated(MatIn::Bf16(&part), &w, Activation::Silu)
                        .unwrap(),
                );
                let want = &gated[from * n / 2..(from + rows) * n / 2];
                assert_eq!(bits(&got), bits(want), "{rows} rows: SiLU-mul");
                let act = want.iter().zip(all[from * n..].chunks(2)).map(|(&g, p)| {
                    let r = |v: f32| half::bf16::from_f32(v).to_f32();
                    let (a, b) = (r(p[0]), r(p[1]));
                    (g - a / (1.0 + (-a).exp()) * b).abs() / (1.0 + (a * b).abs())
                });
                let e = act.fold(0f32, f32::max);
                assert!(e < 1e-2, "{rows} rows: SiLU-mul {e} from the host's");
            }
        }
        println!("batch-invariant matmul [{n}, {k}]: every row count bit-identical, {worst:.1e} from f64");
    }
}

/// The whole CUDA model (GGUF dequantized to bf16) against the CPU backend (f32 weights) on a
/// real GGUF, teacher-forced: three requests packed together, prefilled in chunks, then
/// decoded token by token.
#[test]
fn model_agrees_with_cpu_backend() {
    let a = agreement_with_cpu(false, KvCacheDtype::Auto);
    // bf16 weights (8-bit mantissa) against f32 move logits by a few hundredths, so the two
    // backends may only disagree where the CPU's top two are that close.
    assert!(
        a.widest_flip < 0.1,
        "a disagreement where the CPU's margin is {}",
        a.widest_flip
    );
    assert!(a.top1 >= 0.99, "top-1 agreement {}", a.top1);
    // bf16 weights and activations against f32: about 2^-9 relative per value.
    assert!(a.mean_abs < 0.1, "mean |dlogit| {}", a.mean_abs);
}

/// The same with the GGUF's blocks kept quantized on the GPU (candle's MMVQ/MMQ kernels, which
/// round each input row to 8-bit blocks, Q8_1, before the dot products).
#[test]
fn quantized_gguf_agrees_with_cpu_backend() {
    let a = agreement_with_cpu(true, KvCacheDtype::Auto);
    // Q8_1 inputs: ~2^-8 relative per value on top of bf16 elsewhere.
    assert!(a.top1 >= 0.95, "top-1 agreement {}", a.top1);
    assert!(a.mean_abs < 0.3, "mean |dlogit| {}", a.mean_abs);
}

/// 8-bit K/V pages (codes and a scale per token and head, written by the QKV kernel, widened
/// as attention stages them) against the CPU backend storing the same type.
#[test]
fn eight_bit_kv_agrees_with_cpu_backend() {
    for kv in [KvCacheDtype::Fp8, KvCacheDtype::Int8] {
        let a = agreement_with_cpu(false, kv);
        println!(
            "KV {}: top-1 {:.4}, mean |dlogit| {:.4}",
            kv.name(),
            a.top1,
            a.mean_abs
        );
        // Each side rounds its own activations to 8-bit codes: a code may differ by a step.
        assert!(
            a.top1 >= 0.95,
            "KV {}: top-1 agreement {}",
            kv.name(),
            a.top1
        );
        assert!(
            a.mean_abs < 0.25,
            "KV {}: mean |dlogit| {}",
            kv.name(),
            a.mean_abs
        );
    }
}

struct Agreement {
    top1: f64,
    mean_abs: f64,
    /// The CPU's largest top-1 margin where the two picked different tokens.
    widest_flip: f32,
}

fn agreement_with_cpu(quantized: bool, kv: KvCacheDtype) -> Agreement {
    let path = test_model();
    let g = GgufFile::open(std::path::Path::new(&path)).unwrap();
    let tok = ModelTokenizer::load(&g).unwrap();
    let text = "The paged KV cache keeps each request's keys and values in fixed-size blocks. \
        A scheduler admits requests while blocks remain, and a packed step runs prefill chunks \
        and decodes together. fn main() { let v: Vec<u32> = (0..10).map(|i| i * i).collect(); \
        println!(\"{:?}\", v); } Paris is the capital of France; Berlin is the capital of \
        Germany. In 1969, Apollo 11 landed on the Moon, and Neil Armstrong walked on its \
        surface. The quick brown fox jumps over the lazy dog while the cat sleeps by the fire.";
    let seqs: Vec<Vec<u32>> = [
        text,
        "Once upon a time, in a small village by the sea, there lived an old fisherman who \
         told stories every night. The children gathered around the fire to listen, and the \
         stories were always about the sea, the storms and the fish that got away.",
        "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\
         for i in range(10):\n    print(i, fib(i))\n# The Fibonacci numbers grow \
         exponentially; memoization makes this linear.",
    ]
    .iter()
    .map(|t| tok.encode(t, true).unwrap())
    .collect();
    let max_pos = 1024;
    let bs = 16;
    let blocks = 64;
    let mut cpu = {
        let path = std::path::Path::new(&path);
        let mut m = load_cpu_decoder(
            path,
            LoadFormat::Auto,
            WeightFormat::F32,
            None,
            Some(max_pos),
            &mut |_, _| {},
        )
        .unwrap();
        m.set_kv_dtype(kv);
        m.allocate_cache(blocks, bs).unwrap();
        m
    };
    let mut gpu = gpu_model(std::path::Path::new(&path), quantized, max_pos);
    gpu.set_kv_dtype(kv);
    gpu.allocate_cache(blocks, bs).unwrap();
    let vocab = cpu.vocab_size();
    assert_eq!(vocab, gpu.vocab_size());
    let tables: Vec<Vec<u32>> = (0..3).map(|i| (i * 20..i * 20 + 20).collect()).collect();
    // Steps: prefill all in chunks of 24 tokens, the last 16 tokens of each as decodes: packed
    // with the others' chunks while there are any, then one request at a time (the small-row
    // matmuls), once all three only decode.
    let decode_from: Vec<usize> = seqs.iter().map(|s| s.len() - 16).collect();
    let mut done = [0usize; 3];
    let (mut rows, mut agree, mut sum_abs, mut max_abs) = (0usize, 0usize, 0f64, 0f64);
    let mut widest_flip = 0f32;
    while done.iter().zip(&seqs).any(|(d, s)| *d < s.len() - 1) {
        let mut step = PackedStep::default();
        let alone = done.iter().zip(&decode_from).all(|(d, f)| d >= f);
        for i in 0..seqs.len() {
            let end = seqs[i].len() - 1;
            if done[i] >= end || (alone && step.num_tokens() > 0) {
                continue;
            }
            let n = if done[i] < decode_from[i] {
                24.min(decode_from[i] - done[i])
            } else {
                1
            };
            let first = step.num_tokens();
            step.push(
                &seqs[i][done[i]..done[i] + n],
                done[i],
                std::slice::from_ref(&tables[i]),
                bs,
            );
            step.logits_indices
                .extend((first..first + n).map(|r| r as u32));
            done[i] += n;
        }
        step.finish();
        let a = cpu.forward(&step).unwrap().to_vec();
        let b = gpu.forward(&step).unwrap().to_vec();
        for (ra, rb) in a.chunks(vocab).zip(b.chunks(vocab)) {
            rows += 1;
            let (ia, ib) = (argmax(ra), argmax(rb));
            agree += (ia == ib) as usize;
            if ia != ib {
                widest_flip = widest_flip.max(ra[ia as usize] - ra[ib as usize]);
                println!(
                    "  disagreement: cpu top-1 {ia} ({:.3}) vs gpu {ib}; cpu logit of gpu's pick {:.3}",
                    ra[ia as usize], ra[ib as usize]
                );
            }
            for (x, y) in ra.iter().zip(rb) {
                let e = (x - y).abs() as f64;
                sum_abs += e;
                max_abs = max_abs.max(e);
            }
        }
    }
    let top1 = agree as f64 / rows as f64;
    let mean_abs = sum_abs / (rows * vocab) as f64;
    println!(
        "model {path} ({}): {rows} positions, top-1 agreement {:.2}%, mean |dlogit| {mean_abs:.4}, max |dlogit| {max_abs:.3}",
        if quantized { "GGUF blocks quantized on the GPU" } else { "bf16 on the GPU" },
        100.0 * top1
    );
    Agreement {
        top1,
        mean_abs,
        widest_flip,
    }
}

/// Decode steps replayed from CUDA graphs (padded to their bucket, stale table rows from a
/// larger batch left behind) give the logits an eager run gives.
#[test]
fn decode_graphs_match_eager_steps() {
    graphs_match_eager(std::path::Path::new(&test_model()), 1);
}

/// Verify steps (each request its last token and 0 to 4 drafts, every row's logits) replayed
/// from graphs of their (bucket, window), padded within each request's window, give the
/// logits and argmaxes an eager run gives.
#[test]
fn verify_graphs_match_eager_steps() {
    graphs_match_eager(std::path::Path::new(&test_model()), 5);
    graphs_match_eager(&common::repo_root().join("tests/oracle/tiny/qwen3_moe"), 5);
}

/// The same for mixtures of experts (the tiny Qwen2-MoE and Qwen3-MoE: routing over 8 and
/// 40 experts, the small-step expert matmuls and the shared expert inside the graphs) and
/// hybrids (Qwen3.5, Qwen3-Next: the delta rule's state slots, padding rows in a scratch slot).
#[test]
fn decode_graphs_match_eager_steps_with_experts_and_linear_attention() {
    for family in ["qwen2_moe", "qwen3_moe", "qwen3_5", "qwen3_next"] {
        graphs_match_eager(
            &common::repo_root().join(format!("tests/oracle/tiny/{family}")),
            1,
        );
    }
}

/// The most a logit of a graph step may differ from the eager step's.
const MAX_DLOGIT: f32 = 0.5;

/// Steps of requests with 1 to `window` rows each, every row's logits, eager against graphs.
fn graphs_match_eager(path: &std::path::Path, window: usize) {
    let (bs, blocks, max_pos) = (16, 64, 512);
    let mut models: Vec<Model<CudaBackend>> = (0..2)
        .map(|_| {
            let mut m = gpu_model(path, false, max_pos);
            m.allocate_cache(blocks + 1, bs).unwrap();
            // Five requests' slots and the graphs' scratch slot.
            m.allocate_state(6).unwrap();
            m
        })
        .collect();
    enable_graphs(&mut models[1], 8, blocks, bs);
    let stateful = models[0].state_bytes_per_slot() > 0;
    let vocab = models[0].vocab_size();
    let mut rng = StdRng::seed_from_u64(11);
    let tables: Vec<Vec<u32>> = (0..5).map(|i| (i * 12..i * 12 + 12).collect()).collect();
    let mut lens: Vec<usize> = (0..5).map(|i| 20 + 13 * i).collect();
    let mut prefill = PackedStep::default();
    for (t, &n) in tables.iter().zip(&lens) {
        let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
        prefill.push(&ids, 0, std::slice::from_ref(t), bs);
        prefill.logits_indices.push(prefill.num_tokens() as u32 - 1);
        prefill.state.slots.push(prefill.num_seqs() as u32 - 1);
    }
    prefill.finish();
    for m in &mut models {
        m.forward(&prefill).unwrap();
    }
    let (mut worst, mut sum, mut counted) = (0f32, 0f64, 0usize);
    // Five requests (bucket 8), three (bucket 4), then two and one (the small-row matmuls).
    let rounds = [5, 5, 5, 5, 5, 5, 3, 3, 3, 3, 2, 2, 2, 1, 1, 1];
    for (round, &active) in rounds.iter().enumerate() {
        let mut step = PackedStep::default();
        for i in 0..active {
            // The first request of a window round takes the whole window.
            let rows = match i {
                0 => window,
                _ => rng.random_range(1..=window),
            };
            let ids: Vec<u32> = (0..rows)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect();
            step.push(&ids, lens[i], std::slice::from_ref(&tables[i]), bs);
            step.state.slots.push(i as u32);
            lens[i] += rows;
        }
        step.logits_indices = (0..step.num_tokens() as u32).collect();
        step.finish();
        let eager = models[0].forward(&step).unwrap().to_vec();
        let graph = models[1].forward(&step).unwrap().to_vec();
        // Running a step again rewrites the same K/V, so the argmax paths see the same state;
        // a recurrent state would advance twice, so hybrids check the logits only.
        let ids = (!stateful).then(|| {
            let eager_ids = models[0].forward_argmax(&step).unwrap();
            (eager_ids, models[1].forward_argmax(&step).unwrap())
        });
        assert_eq!(eager.len(), graph.len());
        for (i, (e, g)) in eager.chunks(vocab).zip(graph.chunks(vocab)).enumerate() {
            // Within the bound below, only a near-tie can change the argmax.
            if argmax(e) != argmax(g) {
                let margin = e[argmax(e) as usize] - e[argmax(g) as usize];
                println!(
                    "round {round} row {i}: argmax {} vs {}, {margin} apart",
                    argmax(e),
                    argmax(g)
                );
                assert!(margin < 2.0 * MAX_DLOGIT, "round {round}: {margin} apart");
            }
            if let Some((eager_ids, graph_ids)) = &ids {
                assert_eq!(eager_ids[i], argmax(e), "device argmax, round {round}");
                assert_eq!(graph_ids[i], argmax(g), "replayed argmax, round {round}");
            }
            for (x, y) in e.iter().zip(g) {
                worst = worst.max((x - y).abs());
                sum += (x - y).abs() as f64;
            }
            counted += vocab;
        }
    }
    let mean = sum / counted as f64;
    println!(
        "{} graphs vs eager (window {window}): {} steps, mean |dlogit| {mean:.2e}, max {worst:.2e}",
        path.display(),
        rounds.len()
    );
    // Each bucket (8, 4, 2, 1) of this window was captured: no step fell back to eager.
    assert_eq!(models[1].backend.graphs_captured(window), 4);
    // A graph fixes the attention split for the longest context, eager sizes it to the step:
    // partial sums in another order move a bf16 attention output by an ulp now and then, which
    // ten layers fed random tokens carry to a few tenths of a logit at most.
    assert!(mean < 0.01, "mean |dlogit| {mean}");
    assert!(worst < MAX_DLOGIT, "max |dlogit| {worst}");
}

/// The test GGUF rewritten as a Hugging Face checkpoint (HF tensor names, Q/K rows back in
/// the halves order that GGUF's converter interleaves, tied embeddings, config.json) loads
/// through the safetensors path and computes what the GGUF path computes.
#[test]
fn safetensors_checkpoint_matches_gguf() {
    let path = test_model();
    let cpu = Device::Cpu;
    let mut g = GgufFile::open(std::path::Path::new(&path)).unwrap();
    let config = ferrite_model::checkpoint::read_config(std::path::Path::new(&path)).unwrap();
    let dir = std::env::temp_dir().join(format!("ferrite-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut tensors = std::collections::HashMap::new();
    let mut put = |g: &mut GgufFile, from: &str, to: String, heads: Option<usize>| {
        let w = g.tensor(from, &cpu).unwrap().dequantize(&cpu).unwrap();
        let w = match heads {
            // GGUF rows per head go (pair 0: x0 x1), (pair 1: ...); HF's go x0.., then x1...
            Some(n) => {
                let (out, inp) = w.dims2().unwrap();
                w.reshape((n, out / n / 2, 2, inp))
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap()
                    .contiguous()
                    .unwrap()
                    .reshape((out, inp))
                    .unwrap()
            }
            None => w,
        };
        tensors.insert(to, w.to_dtype(DType::BF16).unwrap());
    };
    put(
        &mut g,
        "token_embd.weight",
        "model.embed_tokens.weight".into(),
        None,
    );
    put(
        &mut g,
        "output_norm.weight",
        "model.norm.weight".into(),
        None,
    );
    for i in 0..config.num_layers {
        let (b, p) = (format!("blk.{i}"), format!("model.layers.{i}"));
        for (from, to, heads) in [
            ("attn_norm", "input_layernorm", None),
            ("attn_q", "self_attn.q_proj", Some(config.num_heads)),
            ("attn_k", "self_attn.k_proj", Some(config.num_kv_heads)),
            ("attn_v", "self_attn.v_proj", None),
            ("attn_output", "self_attn.o_proj", None),
            ("ffn_norm", "post_attention_layernorm", None),
            ("ffn_gate", "mlp.gate_proj", None),
            ("ffn_up", "mlp.up_proj", None),
            ("ffn_down", "mlp.down_proj", None),
        ] {
            put(
                &mut g,
                &format!("{b}.{from}.weight"),
                format!("{p}.{to}.weight"),
                heads,
            );
        }
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let c = &config;
    std::fs::write(
        dir.join("config.json"),
        format!(
            r#"{{"model_type": "llama", "hidden_size": {}, "intermediate_size": {},
                "num_hidden_layers": {}, "num_attention_heads": {}, "num_key_value_heads": {},
                "vocab_size": {}, "rms_norm_eps": {}, "rope_theta": {},
                "max_position_embeddings": 2048, "tie_word_embeddings": true}}"#,
            c.hidden_size,
            c.intermediate_size,
            c.num_layers,
            c.num_heads,
            c.num_kv_heads,
            tensors["model.embed_tokens.weight"].dim(0).unwrap(),
            c.rms_norm_eps,
            c.rope_theta
        ),
    )
    .unwrap();
    let hf = ferrite_model::checkpoint::read_config(&dir.join("config.json")).unwrap();
    assert_eq!(hf.rope_style, RopeStyle::Neox);
    let (bs, blocks, max_pos) = (16, 40, 512);
    let build = |path: &std::path::Path| {
        let mut m = gpu_model(path, false, max_pos);
        m.allocate_cache(blocks, bs).unwrap();
        m
    };
    let mut from_gguf = build(std::path::Path::new(&path));
    let mut from_st = build(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    let vocab = from_gguf.vocab_size();
    assert_eq!(vocab, from_st.vocab_size());
    let mut rng = StdRng::seed_from_u64(5);
    let table: Vec<u32> = (0..40).collect();
    let ids: Vec<u32> = (0..200)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    let (mut rows, mut agree, mut sum, mut worst) = (0usize, 0usize, 0f64, 0f32);
    let mut at = 0;
    while at < ids.len() {
        let n = if at < 180 { 60 } else { 1 };
        let mut step = PackedStep::default();
        step.push(&ids[at..at + n], at, std::slice::from_ref(&table), bs);
        step.logits_indices.extend(0..n as u32);
        step.finish();
        let a = from_gguf.forward(&step).unwrap().to_vec();
        let b = from_st.forward(&step).unwrap().to_vec();
        for (ra, rb) in a.chunks(vocab).zip(b.chunks(vocab)) {
            rows += 1;
            agree += (argmax(ra) == argmax(rb)) as usize;
            for (x, y) in ra.iter().zip(rb) {
                sum += (x - y).abs() as f64;
                worst = worst.max((x - y).abs());
            }
        }
        at += n;
    }
    let mean = sum / (rows * vocab) as f64;
    println!(
        "safetensors vs GGUF: {rows} positions, top-1 agreement {:.2}%, mean |dlogit| {mean:.2e}, max {worst:.3}",
        100.0 * agree as f64 / rows as f64
    );
    // Same bf16 weights; only the order of the rotary pairs (and so of the Q.K sums) differs,
    // which moves a bf16 attention output by an ulp now and then; ten layers fed random
    // tokens carry that to a few hundredths of a logit on average (seen: 0.025, max 0.35).
    assert!(agree as f64 >= 0.99 * rows as f64, "{agree} of {rows}");
    assert!(mean < 0.05, "mean |dlogit| {mean}");
}

/// Every family of `models/` on the GPU against Hugging Face transformers (f32), on the tiny
/// random-weight checkpoints of `tests/oracle/tiny` (safetensors, and the GGUF of the same
/// weights where there is one), teacher-forced over a sequence longer than every window.
#[test]
fn families_agree_with_transformers() {
    // (family, has a GGUF, routes through experts or a delta rule: see the bounds below)
    for (family, has_gguf, sensitive) in [
        ("llama31", true, false),
        ("mistral", false, false),
        ("qwen2", true, false),
        ("qwen3", true, false),
        ("gemma2", true, false),
        ("gemma3", true, false),
        ("mixtral", true, true),
        ("qwen2_moe", true, true),
        ("qwen3_moe", false, true),
        ("qwen3_5", false, true),
        ("qwen3_5_moe", false, true),
        ("qwen3_next", false, true),
    ] {
        let (tokens, want) = common::tiny_oracle(family, "logits");
        let dir = common::repo_root().join(format!("tests/oracle/tiny/{family}"));
        let mut paths = vec![dir.clone()];
        if has_gguf {
            paths.push(dir.with_extension("gguf"));
        }
        for path in paths {
            let mut m = gpu_model(&path, false, 4096);
            let got = common::all_logits(&mut m, &tokens);
            let (mut sum, mut n, mut agree) = (0f64, 0usize, 0usize);
            let scale = want
                .iter()
                .flatten()
                .map(|x| x.abs() as f64)
                .fold(0f64, f64::max);
            // Per position, its largest |dlogit|, worst first.
            let mut per_position = Vec::new();
            for (g, w) in got.iter().zip(&want) {
                let wa = (0..w.len()).max_by(|&a, &b| w[a].total_cmp(&w[b])).unwrap();
                agree += (argmax(g) as usize == wa) as usize;
                let mut m = 0f64;
                for (x, y) in g.iter().zip(w) {
                    m = m.max((*x as f64 - *y as f64).abs());
                    sum += (*x as f64 - *y as f64).abs();
                    n += 1;
                }
                per_position.push(m);
            }
            per_position.sort_by(|a, b| b.total_cmp(a));
            let (mean, rows, worst) = (sum / n as f64, want.len(), per_position[0]);
            // Past the two worst positions (where a mixture may route a near-tie otherwise).
            let bounded_max = per_position[if sensitive { 2 } else { 0 }];
            println!(
                "{family} {}: {rows} positions, top-1 {agree}/{rows}, mean |dlogit| {mean:.2e}, max {worst:.2e}, bounded {bounded_max:.2e} (largest logit {scale:.2})",
                path.file_name().unwrap().to_string_lossy()
            );
            assert_eq!(got.len(), rows);
            // bf16 weights and activations (2^-9 relative per value) through a few layers:
            // a few hundredths of the logits' range, and the top-1 where it is not a near-tie.
            // Mixtures of experts flip a near-tied expert at a position or two (so the two
            // worst positions are left out of the max), and the gated delta rule amplifies
            // rounding, as transformers itself run in bf16 does: a family may stray up to 1.5x
            // as far as that run (and agree on top-1 10% less often).
            let bf16 = |key: &str| match sensitive {
                true => common::tiny_oracle_value(family, key),
                false => 0.0,
            };
            let max_bound = (0.05 * scale.max(1.0)).max(1.5 * bf16("transformers_bf16_max_dlogit"));
            let mean_bound =
                (0.01 * scale.max(1.0)).max(1.5 * bf16("transformers_bf16_mean_dlogit"));
            let top1 = match bf16("transformers_bf16_top1") {
                0.0 => 0.9,
                t => (t - 0.1).min(0.9),
            };
            assert!(
                bounded_max < max_bound,
                "{family}: max |dlogit| {bounded_max} (past the positions left out)"
            );
            assert!(mean < mean_bound, "{family}: mean |dlogit| {mean}");
            assert!(
                agree as f64 >= top1 * rows as f64,
                "{family}: top-1 {agree}/{rows}"
            );
        }
    }
}

/// A request's greedy tokens do not depend on what shares its steps: 16 prompts decoded
/// one at a time and all 16 together (decode graphs on, as the loader sets them) give the
/// same tokens.
#[test]
fn greedy_output_is_the_same_at_concurrency_1_and_16() {
    let path = test_model();
    let (bs, max_pos, new_tokens) = (16, 512, 24);
    let per = max_pos / bs;
    let blocks = 16 * per;
    let mut m = gpu_model(std::path::Path::new(&path), false, max_pos);
    m.allocate_cache(blocks + 1, bs).unwrap();
    enable_graphs(&mut m, 16, blocks, bs);
    let vocab = m.vocab_size() as u32;
    let mut rng = StdRng::seed_from_u64(21);
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| {
            (0..20 + 7 * i)
                .map(|_| rng.random_range(0..vocab))
                .collect()
        })
        .collect();
    let tables: Vec<Vec<u32>> = (0..16u32)
        .map(|i| (i * per as u32..(i + 1) * per as u32).collect())
        .collect();
    // Greedy decoding of the requests `which`, all in the same steps.
    let mut decode = |which: &[usize]| -> Vec<Vec<u32>> {
        let mut step = PackedStep::default();
        for &i in which {
            step.push(&prompts[i], 0, std::slice::from_ref(&tables[i]), bs);
            step.logits_indices.push(step.num_tokens() as u32 - 1);
        }
        step.finish();
        let mut last = m.forward_argmax(&step).unwrap();
        let mut out: Vec<Vec<u32>> = last.iter().map(|&t| vec![t]).collect();
        for n in 0..new_tokens - 1 {
            let mut step = PackedStep::default();
            for (j, &i) in which.iter().enumerate() {
                let at = prompts[i].len() + n;
                step.push(&[last[j]], at, std::slice::from_ref(&tables[i]), bs);
                step.logits_indices.push(j as u32);
            }
            step.finish();
            last = m.forward_argmax(&step).unwrap();
            for (o, &t) in out.iter_mut().zip(&last) {
                o.push(t);
            }
        }
        out
    };
    let alone: Vec<Vec<u32>> = (0..16).flat_map(|i| decode(&[i])).collect();
    let all: Vec<usize> = (0..16).collect();
    let together = decode(&all);
    let same = alone.iter().zip(&together).filter(|(a, b)| a == b).count();
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        if a != b {
            let at = a.iter().zip(b).position(|(x, y)| x != y).unwrap();
            println!("request {i}: alone and in 16 split at token {at}");
        }
    }
    println!(
        "greedy at concurrency 1 vs 16: {same}/16 requests identical over {new_tokens} tokens"
    );
    assert_eq!(same, 16, "greedy tokens depend on the batch");
}

/// `--batch-invariant`: each request decoded alone, one row a step, then all twelve again,
/// teacher-forced, in steps of random company: prompts in chunks of 1-48 tokens beside other
/// requests' chunks, decode rows and verify windows of 2-5 rows, from 1 to 12 requests a
/// step (graphs where a step fits one, eager otherwise). Every logits row is bit-identical
/// to the one the request got alone, so greedy output and logprobs do not depend on the
/// batch, with or without speculation. On the test model and on the tiny hybrid (Qwen3.5:
/// gated delta-net layers, each request's recurrent state in its own slot).
#[test]
fn batch_invariant_logits_do_not_depend_on_the_step() {
    logits_alone_and_in_company(std::path::Path::new(&test_model()));
    for family in ["qwen3_5", "qwen2_moe", "qwen3_5_moe"] {
        logits_alone_and_in_company(&common::repo_root().join("tests/oracle/tiny").join(family));
    }
}

fn logits_alone_and_in_company(path: &std::path::Path) {
    let (bs, max_pos, new_tokens, n) = (16, 512, 16, 12);
    let per = max_pos / bs;
    let mut m = gpu_model(path, false, max_pos);
    m.backend.kernels().set_batch_invariant(true);
    m.allocate_cache(2 * n * per + 1, bs).unwrap();
    // Recurrent state (the hybrid): slot i alone, n + i together, 2 n the graphs' scratch.
    if m.state_bytes_per_slot() > 0 {
        m.allocate_state(2 * n + 1).unwrap();
    }
    enable_graphs_with_slot(&mut m, 16, 2 * n * per, bs, 2 * n as u32);
    let vocab = m.vocab_size();
    let mut rng = StdRng::seed_from_u64(41);
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            (0..20 + 23 * i)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect()
        })
        .collect();
    // Alone in blocks [0, n per), together in [n per, 2 n per).
    let table = |i: usize| -> Vec<u32> { (i * per..(i + 1) * per).map(|b| b as u32).collect() };
    // Alone: the request's tokens (prompt and greedy ones) and the logits at each position
    // from the prompt's last on.
    let mut alone: Vec<(Vec<u32>, Vec<Vec<f32>>)> = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let mut step = PackedStep::default();
        step.push(prompt, 0, &[table(i)], bs);
        step.state.slots.push(i as u32);
        step.logits_indices.push(step.num_tokens() as u32 - 1);
        step.finish();
        let mut logits = vec![m.forward(&step).unwrap().to_vec()];
        let mut tokens = prompt.clone();
        for _ in 0..new_tokens {
            let next = argmax(logits.last().unwrap());
            let mut step = PackedStep::default();
            step.push(&[next], tokens.len(), &[table(i)], bs);
            step.state.slots.push(i as u32);
            step.logits_indices.push(0);
            step.finish();
            tokens.push(next);
            logits.push(m.forward(&step).unwrap().to_vec());
        }
        alone.push((tokens, logits));
    }
    // Together: each request's tokens fed again in random pieces beside random company.
    let mut fed = vec![0usize; n];
    let (mut steps, mut rows_checked, mut sizes) = (0, 0, std::collections::BTreeSet::new());
    let mut differ = Vec::new();
    while fed.iter().zip(&alone).any(|(&f, a)| f < a.0.len()) {
        let mut open: Vec<usize> = (0..n).filter(|&i| fed[i] < alone[i].0.len()).collect();
        open.shuffle(&mut rng);
        open.truncate(rng.random_range(1..=open.len()));
        let mut step = PackedStep::default();
        let mut expect = Vec::new();
        for &i in &open {
            let (tokens, logits) = &alone[i];
            let prompt = prompts[i].len();
            let most = if fed[i] < prompt { 48 } else { 5 };
            let take = rng.random_range(1..=most).min(tokens.len() - fed[i]);
            let first_row = step.num_tokens();
            step.push(&tokens[fed[i]..fed[i] + take], fed[i], &[table(n + i)], bs);
            step.state.slots.push((n + i) as u32);
            for p in fed[i]..fed[i] + take {
                if p + 1 >= prompt {
                    step.logits_indices.push((first_row + p - fed[i]) as u32);
                    expect.push((i, p, &logits[p + 1 - prompt]));
                }
            }
            fed[i] += take;
        }
        step.finish();
        sizes.insert(open.len());
        let got = m.forward(&step).unwrap().to_vec();
        for ((i, p, want), row) in expect.iter().zip(got.chunks(vocab)) {
            let worst = row
                .iter()
                .zip(want.iter())
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .map(|(a, b)| (a - b).abs())
                .fold(None, |w: Option<f32>, d| Some(w.map_or(d, |w| w.max(d))));
            if let Some(worst) = worst {
                differ.push(format!(
                    "request {i} position {p} (a step of {} rows, {} requests): up to {worst:.2e}",
                    step.num_tokens(),
                    open.len()
                ));
            }
        }
        rows_checked += expect.len();
        steps += 1;
    }
    for d in &differ {
        println!("{d}");
    }
    assert!(
        differ.is_empty(),
        "{}: {} of {rows_checked} logits rows differ from the request alone",
        path.display(),
        differ.len()
    );
    println!(
        "batch-invariant, {}: {rows_checked} logits rows in {steps} steps of {sizes:?} requests, every one bit-identical to the request alone",
        path.display()
    );
}

/// A request alone rounds alike whether it decodes or verifies drafts: its verify windows
/// of 2 to 8 rows (replayed from graphs) give bit for bit the logits its one-row decode steps
/// gave at the same positions, so greedy output with speculation on equals it off at
/// concurrency 1 by construction (the small-row matmuls sum each row the same way for every
/// row count; attention splits are fixed positions, not shares of each tile's keys).
#[test]
fn verify_windows_of_one_request_round_as_its_decode_steps() {
    let path = test_model();
    let (bs, max_pos, new_tokens) = (16, 512, 48);
    let per = max_pos / bs;
    let mut m = gpu_model(std::path::Path::new(&path), false, max_pos);
    m.allocate_cache(2 * per + 1, bs).unwrap();
    enable_graphs(&mut m, 8, 2 * per, bs);
    let vocab = m.vocab_size();
    let mut rng = StdRng::seed_from_u64(31);
    // Long enough that the keys span several attention splits.
    let prompt: Vec<u32> = (0..300)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    let tables: Vec<Vec<u32>> = (0..2u32)
        .map(|i| (i * per as u32..(i + 1) * per as u32).collect())
        .collect();
    let prefill = |m: &mut Model<CudaBackend>, table: &Vec<u32>| {
        let mut step = PackedStep::default();
        step.push(&prompt, 0, std::slice::from_ref(table), bs);
        step.logits_indices.push(step.num_tokens() as u32 - 1);
        step.finish();
        m.forward_argmax(&step).unwrap()[0]
    };
    // Greedy decode, one row a step: each step's logits.
    let mut tokens = vec![prefill(&mut m, &tables[0])];
    let mut decoded = Vec::new();
    for n in 0..new_tokens {
        let mut step = PackedStep::default();
        step.push(
            &[tokens[n]],
            prompt.len() + n,
            std::slice::from_ref(&tables[0]),
            bs,
        );
        step.logits_indices.push(0);
        step.finish();
        let logits = m.forward(&step).unwrap().to_vec();
        tokens.push(argmax(&logits));
        decoded.push(logits);
    }
    // The same tokens verified in windows of 2 to 8 rows (the last token and 1 to 7 drafts).
    assert_eq!(prefill(&mut m, &tables[1]), tokens[0]);
    let (mut at, mut windows) = (0, std::collections::BTreeSet::new());
    while at < new_tokens {
        let w = rng.random_range(2..=8usize).min(new_tokens - at);
        let mut step = PackedStep::default();
        step.push(
            &tokens[at..at + w],
            prompt.len() + at,
            std::slice::from_ref(&tables[1]),
            bs,
        );
        step.logits_indices = (0..w as u32).collect();
        step.finish();
        let logits = m.forward(&step).unwrap().to_vec();
        for (j, row) in logits.chunks(vocab).enumerate() {
            let want = &decoded[at + j];
            let differ = row
                .iter()
                .zip(want)
                .filter(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(
                differ.count(),
                0,
                "position {}: a window of {w} rows, row {j}, rounds otherwise than its decode step",
                prompt.len() + at + j
            );
        }
        windows.insert(w);
        at += w;
    }
    println!("{new_tokens} rows verified in windows of {windows:?} rows: logits bit-identical to one-row decode steps");
    // Every step ran from a graph (the default), the decodes' and each window's.
    for w in windows.iter().chain([&1]) {
        assert_eq!(m.backend.graphs_captured(*w), 1, "window {w}");
    }
}

/// The hybrid (gated delta-net) on the GPU fed in chunks of 1 (token-by-token decode), 7 and
/// 64, two requests sharing each step in their own state slots, against one whole prefill:
/// the same logits to bf16 precision (the chunks take other matmul paths than the whole).
#[test]
fn gated_delta_net_chunked_prefill_and_decode_match_a_whole_prefill() {
    let dir = common::repo_root().join("tests/oracle/tiny/qwen3_5");
    let mut m = gpu_model(&dir, false, 4096);
    let (tokens, _) = common::tiny_oracle("qwen3_5", "logits");
    let whole = common::all_logits(&mut m, &tokens);
    for chunk in [1, 7, 64] {
        let got = common::chunked_logits(&mut m, &tokens, chunk);
        let (mean, worst, scale) = differences(&got, &whole);
        println!(
            "qwen3_5 on the GPU in chunks of {chunk}: mean |dlogit| {mean:.2e}, max {worst:.2e} against one whole prefill (largest logit {scale:.2})"
        );
        assert!(mean < 0.01 * scale, "chunks of {chunk}: mean {mean}");
        assert!(worst < 0.1 * scale, "chunks of {chunk}: max {worst}");
    }
}

/// A prefix-cache hit on the hybrid on the GPU: the state checkpointed in place after 32
/// tokens of one request restored for another sharing them; logits equal a cold prefill to
/// bf16 precision.
#[test]
fn gated_delta_net_prefix_hit_from_a_checkpoint_matches_a_cold_prefill() {
    let dir = common::repo_root().join("tests/oracle/tiny/qwen3_5");
    let mut m = gpu_model(&dir, false, 4096);
    let (tokens, _) = common::tiny_oracle("qwen3_5", "logits");
    let b: Vec<u32> = tokens[..32]
        .iter()
        .chain(tokens[..16].iter().rev())
        .copied()
        .collect();
    let cold = common::all_logits(&mut m, &b);
    let (got, want) = common::prefix_hit(&mut m, &tokens, &b, &cold);
    let (mean, worst, scale) = differences(&got, &want);
    println!("qwen3_5 prefix hit on the GPU: mean |dlogit| {mean:.2e}, max {worst:.2e} (largest logit {scale:.2})");
    assert!(mean < 0.01 * scale, "mean {mean}");
    assert!(worst < 0.1 * scale, "max {worst}");
}

/// A rejected draft on the hybrid on the GPU: the verify step's kernels write the state after
/// each accepted-draft count into draft slots (the recurrent form), the step after restores
/// the one after the accepted tokens; logits equal a cold prefill to bf16 precision.
#[test]
fn gated_delta_net_rejected_draft_restores_the_state_after_the_accepted_tokens() {
    let dir = common::repo_root().join("tests/oracle/tiny/qwen3_5");
    let mut m = gpu_model(&dir, false, 4096);
    let (tokens, _) = common::tiny_oracle("qwen3_5", "logits");
    let cold = common::all_logits(&mut m, &tokens);
    let (got, want) = common::draft_rollback(&mut m, &tokens, &cold);
    let (mean, worst, scale) = differences(&got, &want);
    println!("qwen3_5 after a rejected draft on the GPU: mean |dlogit| {mean:.2e}, max {worst:.2e} (largest logit {scale:.2})");
    assert!(mean < 0.01 * scale, "mean {mean}");
    assert!(worst < 0.1 * scale, "max {worst}");
}

/// The MTP heads on the GPU (Qwen3-Next's with experts, Qwen3.5's dense) against
/// transformers' modules, teacher-forced whole and in chunks. The head reads the target's
/// hidden states, which stray from the oracle as far as the family does in bf16 (see
/// `families_agree_with_transformers`: the delta rule amplifies rounding); the head may add
/// its one layer's rounding to that, no more: mean |dlogit| within 1.5x the target's plus a
/// hundredth of the logits' range, and top-1 as often as the target's less 10%. (A wrong head
/// strays by the logits' whole range.)
#[test]
fn mtp_heads_agree_with_transformers() {
    let top1 = |got: &[Vec<f32>], want: &[Vec<f32>]| {
        let same = got.iter().zip(want).filter(|(g, w)| argmax(g) == argmax(w));
        same.count() as f64 / got.len() as f64
    };
    for name in ["qwen3_next_mtp", "qwen3_5_mtp"] {
        let dir = common::repo_root().join(format!("tests/oracle/tiny/{name}"));
        let backend = CudaBackend::new(device(), false, "cuda:0".into()).unwrap();
        let (src, mut w) = open_weights(&dir, LoadFormat::Auto).unwrap();
        let mut m = models::load_with_mtp(backend, &src, &mut w, 4096, &mut |_, _| {}).unwrap();
        let (tokens, want_target) = common::tiny_oracle(name, "logits_f16_kv");
        let (_, want_head) = common::tiny_oracle(name, "mtp_logits_f16_kv");
        for ends in [vec![tokens.len()], vec![20, 21, tokens.len()]] {
            let (target, head) = common::teacher_forced(&mut m, &tokens, &ends);
            let (tm, tw, _) = differences(&target, &want_target);
            let (hm, hw, scale) = differences(&head, &want_head);
            let (tt, ht) = (top1(&target, &want_target), top1(&head, &want_head));
            println!(
                "{name} on the GPU, chunks ending at {ends:?}: target mean |dlogit| {tm:.2e} (max {tw:.2e}, top-1 {tt:.2}), MTP head {hm:.2e} (max {hw:.2e}, top-1 {ht:.2}; largest logit {scale:.2})"
            );
            assert!(
                hm <= 1.5 * tm + 0.01 * scale,
                "{name}: head mean {hm}, target {tm}"
            );
            assert!(ht >= tt - 0.1, "{name}: head top-1 {ht}, target {tt}");
        }
    }
}

/// Speculation on the hybrid through the engine on the GPU (n-gram drafts, and the MTP head's
/// at k = 1 and 3): every request completes, drafts are verified, and greedy output matches
/// speculation off (counted: verify rows take the multi-row kernels, decodes the one-row
/// ones, so bf16 rounding may split a request where two logits tie).
#[test]
fn speculation_on_a_hybrid_through_the_engine() {
    use ferrite_core::sampling::SamplingParams;
    use ferrite_core::spec_decode::{Proposer, Speculation};
    let (tokens, _) = common::tiny_oracle("qwen3_5", "logits");
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| {
            tokens
                .iter()
                .cycle()
                .skip(3 * i)
                .take(20 + 2 * i)
                .copied()
                .collect()
        })
        .collect();
    let run = |spec: Option<Speculation>, batch_invariant: bool| {
        let mut args = ferrite_model::loader::EngineArgs::new(
            common::repo_root().join("tests/oracle/tiny/qwen3_5_mtp"),
        );
        args.device = ferrite_model::loader::DeviceKind::Cuda(0);
        args.batch_invariant = batch_invariant;
        args.max_model_len = Some(128);
        args.max_num_batched_tokens = 64;
        args.kv_cache_memory = Some(4 << 20);
        args.speculation = spec;
        let (engine, _) = common::engine_with(args);
        let params = SamplingParams {
            temperature: 0.0,
            max_tokens: Some(40),
            ignore_eos: true,
            ..Default::default()
        };
        let streams: Vec<_> = prompts
            .iter()
            .map(|p| engine.add_request(p.clone(), params.clone()).unwrap())
            .collect();
        let out: Vec<Vec<u32>> = streams
            .into_iter()
            .map(|s| common::tokens_of(&common::collect(s).unwrap()))
            .collect();
        (out, common::idle_stats(&engine).spec)
    };
    let spec = |k, proposer| {
        Some(Speculation {
            k,
            proposer,
            disable_by_batch_size: 64,
        })
    };
    // By default a near-tie may split an answer (cuBLAS rounds by the step's rows); with
    // `--batch-invariant` none can.
    for (batch_invariant, least) in [(false, 14), (true, 16)] {
        let (off, _) = run(None, batch_invariant);
        assert!(off.iter().all(|t| t.len() == 40));
        for s in [
            spec(3, Proposer::Ngram { min_n: 1, max_n: 3 }),
            spec(1, Proposer::Mtp),
            spec(3, Proposer::Mtp),
        ] {
            let (on, stats) = run(s.clone(), batch_invariant);
            let same = on.iter().zip(&off).filter(|(a, b)| a == b).count();
            println!("{s:?} on the GPU (batch-invariant {batch_invariant}): {same}/16 requests identical to speculation off; {stats:?}");
            assert!(on.iter().all(|t| t.len() == 40));
            assert!(stats.num_drafts > 100, "{stats:?}");
            assert!(same >= least, "{same}/16 identical");
        }
    }
}

/// Mean and largest |got - want|, and the largest |want|.
fn differences(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f32, f32, f32) {
    assert_eq!(got.len(), want.len());
    let d: Vec<f32> = got
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .collect();
    let scale = want.iter().flatten().map(|x| x.abs()).fold(0f32, f32::max);
    let worst = d.iter().copied().fold(0f32, f32::max);
    (d.iter().sum::<f32>() / d.len() as f32, worst, scale)
}

/// Attention rounds a query row alike wherever the step puts it: a request's last rows as
/// one prefill of the whole prompt and as chunks of 58, 44, 30 and 1 rows after the rest is
/// cached (other tile-mates, another place in the tile and the warp, another key range zero-
/// filled past the tile), bit for bit, in batch-invariant mode (unsplit), for GQA groups of
/// 1 to 4 and heads of 64 and 128. (It failed for 1 row in ~2000 before the softmax's
/// multiplies were kept out of FMAs.)
#[test]
fn attention_rows_round_alike_in_any_tile_arrangement() {
    let dev = device();
    let k = kernels(&dev);
    k.set_batch_invariant(true);
    let bs = 16;
    for &(h, hkv, d) in &[
        (9usize, 3usize, 64usize),
        (8, 8, 64),
        (8, 4, 64),
        (16, 4, 128),
    ] {
        let (mut rows, mut differ) = (0, Vec::new());
        for seed in 0..12u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let len = rng.random_range(100..300usize);
            let table: Vec<u32> = (0..len.div_ceil(bs) as u32).collect();
            let mut cache =
                KvPages::zeros(table.len(), hkv, bs, d, KvCacheDtype::Bf16, &dev).unwrap();
            cache.randomize().unwrap();
            let q = Tensor::randn(0f32, 1.0, (len, h * d), &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let shape = attention_shape((h, hkv, d), bs, 0, 0.0);
            // The rows from position `from` on, the keys before them already cached.
            let rows_from = |from: usize| -> Vec<f32> {
                let mut step = PackedStep::default();
                step.push(
                    &vec![0u32; len - from],
                    from,
                    std::slice::from_ref(&table),
                    bs,
                );
                step.finish();
                let q = q.narrow(0, from, len - from).unwrap();
                attend(&k, &q, &cache, &step, &shape, None)
            };
            let whole = rows_from(0);
            for from in [len - 58, len - 44, len / 64 * 64, len - 30, len - 1] {
                let part = rows_from(from).into_iter().map(f32::to_bits);
                let want = whole[from * h * d..].iter().map(|x| x.to_bits());
                let got: Vec<u32> = part.collect();
                let want: Vec<u32> = want.collect();
                for (r, (a, b)) in got.chunks(h * d).zip(want.chunks(h * d)).enumerate() {
                    rows += 1;
                    if a != b {
                        differ.push((len, from, from + r));
                    }
                }
            }
        }
        println!("attention rows in other tile arrangements, {h} heads / {hkv} KV heads, head size {d}: {} of {rows} differ", differ.len());
        assert!(
            differ.is_empty(),
            "(length, first chunk row, row) {differ:?}"
        );
    }
}

/// bf16 weights and activations against the CPU backend's f32 (the conformance suite's
/// tolerances for CUDA); K/V in each type CUDA stores. Seen on an H100 (2026-12-07): matmuls
/// at most 9.7e-3, attention 6.5e-3 (bf16 K/V), 1.1e-2 (int8), 4.5e-2 (fp8), mixtures
/// 2.8e-3, the delta rule 2.6e-2 (bf16 inputs and outputs, the same in any chunking).
const BF16: suite::Tolerances = suite::Tolerances {
    linear: 3e-2,
    attention: |kv| match kv {
        KvCacheDtype::Int8 => 4e-2,
        KvCacheDtype::Fp8 => 8e-2,
        _ => 3e-2,
    },
    moe: 4e-2,
    gated_delta: 4e-2,
    pointwise: 1e-2,
};

fn cuda_backend() -> CudaBackend {
    CudaBackend::new(device(), false, "cuda:0".into()).unwrap()
}

/// Every op of the backend trait against the CPU backend (`tests/suite`): CUDA refuses only
/// the encoders' ops and the K/V types it does not store (f32, f16).
#[test]
fn the_conformance_suite_passes() {
    let out = suite::run(&cuda_backend, &BF16);
    let bad = suite::failures(&out);
    assert!(
        bad.is_empty(),
        "{:?}",
        bad.iter().map(|o| (&o.case, o.error)).collect::<Vec<_>>()
    );
    let refused: Vec<&str> = out
        .iter()
        .filter(|o| o.error.is_none())
        .map(|o| o.case.as_str())
        .collect();
    for case in &refused {
        let encoder = ["AddRows", "AddBias", "LayerNorm"]
            .iter()
            .any(|op| case.starts_with(op));
        assert!(
            encoder || case.contains("kv: Fp32") || case.contains("kv: Fp16"),
            "{case}"
        );
    }
    // Five encoder ops; f32 and f16 K/V for each of the five attention cases.
    assert_eq!(refused.len(), 5 + 2 * 5, "{refused:?}");
}

/// Every family's tiny checkpoint through a whole prompt step, bf16 K/V, against the CPU
/// backend's f32: a twentieth of the largest logit, or for the families that route through
/// experts or a delta rule as far as 1.5x what transformers itself strays in bf16, past the
/// two worst rows (the bounds of `families_agree_with_transformers`).
#[test]
fn every_family_conforms() {
    let bound = |family: &str| {
        let bf16_max = common::tiny_oracle_value(family, "transformers_bf16_max_dlogit");
        let (_, want) = common::tiny_oracle(family, "logits");
        let scale = want.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
        suite::FamilyBound {
            error: (1.5 * bf16_max as f32 / scale).max(5e-2),
            skip: if bf16_max > 0.0 { 2 } else { 0 },
        }
    };
    let out = suite::families(&cuda_backend, &bound);
    assert!(suite::failures(&out).is_empty());
    assert!(out.iter().all(|o| o.error.is_some()));
}
