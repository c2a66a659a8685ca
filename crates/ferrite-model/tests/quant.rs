//! The quantized matmul kernels against scalar references on random data: every kernel set
//! this CPU can run (the portable one always), odd shapes, every tile remainder.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use ferrite_model::backend::cpu::quant::activations::QuantizedActs;
use ferrite_model::backend::cpu::quant::packed::{Codes, Layout, PackedWeight, BLOCK};
use ferrite_model::backend::cpu::quant::{matmul, Isa};
use ferrite_model::backend::Rounding;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ROUNDINGS: [Rounding; 2] = [Rounding::Coarse, Rounding::Fine];

fn random(rng: &mut StdRng, n: usize) -> Vec<f32> {
    // Mixed magnitudes so blocks differ in scale, with an occasional outlier.
    (0..n)
        .map(|i| {
            let v: f32 = rng.random_range(-1.0..1.0);
            if i % 97 == 0 {
                v * 8.0
            } else {
                v * (1 + i % 5) as f32
            }
        })
        .collect()
}

fn ggml(x: &[f32], rows: usize, cols: usize, dtype: GgmlDType) -> QTensor {
    let t = Tensor::from_slice(x, (rows, cols), &Device::Cpu).unwrap();
    QTensor::quantize(&t, dtype).unwrap()
}

fn dequantized(q: &QTensor) -> Vec<f32> {
    q.dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Repacking keeps every weight of the exactly-decoded types bit for bit, Q4_K within its
/// scales' rounding to f16, and re-quantized types within half an 8-bit step of their block;
/// laid out in panels, every weight is the same, and the padding rows are zero.
#[test]
fn repacked_weights_match_ggml_dequantization() {
    let mut rng = StdRng::seed_from_u64(1);
    let cases = [
        (GgmlDType::Q4_0, 224, Codes::U4, 0.0),
        (GgmlDType::Q4_1, 224, Codes::U4, 0.0),
        (GgmlDType::Q4K, 512, Codes::U4, 1e-3),
        (GgmlDType::Q8_0, 224, Codes::U8, 0.0),
        (GgmlDType::Q5_0, 224, Codes::U8, 0.0),
        (GgmlDType::Q5_1, 224, Codes::U8, 1.002 / 254.0),
        (GgmlDType::Q6K, 512, Codes::U8, 1.002 / 254.0),
    ];
    // Allowed |error| as a fraction of the block's largest magnitude.
    for (dtype, cols, codes, tol) in cases {
        let rows = 7;
        let q = ggml(&random(&mut rng, rows * cols), rows, cols, dtype);
        let want = dequantized(&q);
        let w = PackedWeight::from_qtensor(&q).unwrap();
        let panels = w.clone().into_layout(Layout::Panels);
        assert_eq!(panels.data.len(), w.data.len() / rows * 16);
        for r in 0..16 {
            for c in 0..cols {
                let want = if r < rows { w.get(r, c) } else { 0.0 };
                assert_eq!(panels.get(r, c), want, "{dtype:?} panels r{r} c{c}");
            }
        }
        assert_eq!(w.codes, codes, "{dtype:?}");
        assert_eq!(w.blocks, (cols / BLOCK).next_multiple_of(2));
        for r in 0..rows {
            for blk in want[r * cols..][..cols].chunks(BLOCK).enumerate() {
                let (b, vals) = blk;
                let amax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (j, &v) in vals.iter().enumerate() {
                    let got = w.get(r, b * BLOCK + j);
                    if tol == 0.0 {
                        assert_eq!(got, v, "{dtype:?} r{r} c{}", b * BLOCK + j);
                    } else {
                        let tol = tol * amax + 1e-7;
                        assert!(
                            (got - v).abs() <= tol,
                            "{dtype:?}: {got} vs {v} (tol {tol})"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn activations_round_to_the_nearest_step() {
    let mut rng = StdRng::seed_from_u64(2);
    let (rows, cols) = (5, 7 * BLOCK);
    let mut x = random(&mut rng, rows * cols);
    x[3 * cols..3 * cols + BLOCK].fill(0.0); // an all-zero block
    let mut a = QuantizedActs::default();
    a.quantize(&x, rows, cols, Rounding::Coarse);
    assert_eq!(a.blocks, 8);
    for r in 0..rows {
        for b in 0..a.blocks {
            let d = a.d[r * a.blocks + b];
            let q = &a.q[(r * a.blocks + b) * BLOCK..][..BLOCK];
            let sum: i32 = q.iter().map(|&v| v as i32).sum();
            assert_eq!(a.s[r * a.blocks + b], d * sum as f32);
            for (j, &qv) in q.iter().enumerate() {
                let c = b * BLOCK + j;
                let v = if c < cols { x[r * cols + c] } else { 0.0 };
                assert!((d * qv as f32 - v).abs() <= d * 0.5 * 1.0001 + 1e-9);
                assert!(qv != i8::MIN);
            }
        }
    }
}

/// Fine activations keep the rounding residual: every value within a 256th of a coarse step
/// (half a 256th but where a residual of nearly half a step is clamped to int8), the mean
/// error near a 1024th, block sums as the codes hold them.
#[test]
fn fine_activations_keep_the_residual() {
    let mut rng = StdRng::seed_from_u64(5);
    let (rows, cols) = (4, 9 * BLOCK);
    let x = random(&mut rng, rows * cols);
    let (mut coarse, mut fine) = (QuantizedActs::default(), QuantizedActs::default());
    coarse.quantize(&x, rows, cols, Rounding::Coarse);
    fine.quantize(&x, rows, cols, Rounding::Fine);
    let (mut total, mut n) = (0f64, 0usize);
    for r in 0..rows {
        for b in 0..fine.blocks {
            let i = r * fine.blocks + b;
            let step = coarse.d[i] as f64;
            assert_eq!(fine.d[i], coarse.d[i] / 256.0);
            assert_eq!(
                &fine.q[i * BLOCK..][..BLOCK],
                &coarse.q[i * BLOCK..][..BLOCK],
                "the coarse codes are the same"
            );
            let sum: f64 = (0..BLOCK).map(|j| fine.value(r, b * BLOCK + j)).sum();
            assert!((fine.s[i] as f64 - sum).abs() <= 1e-6 * sum.abs().max(step));
            for j in 0..BLOCK {
                let c = b * BLOCK + j;
                let v = if c < cols {
                    x[r * cols + c] as f64
                } else {
                    0.0
                };
                let err = (fine.value(r, c) - v).abs();
                assert!(
                    err <= step / 256.0 * 1.0001 + 1e-9,
                    "r{r} c{c}: {err} of a step {step}"
                );
                if step > 0.0 {
                    total += err / step;
                    n += 1;
                }
            }
        }
    }
    let mean = total / n as f64;
    assert!(mean < 0.3 / 256.0, "mean error {mean} of a coarse step");
}

/// `sum_k w[r, k] * d[t, k] q[t, k]` in f64: the exact value of what the kernels compute.
fn reference(w: &PackedWeight, a: &QuantizedActs) -> Vec<f64> {
    let mut y = vec![0f64; a.rows * w.rows];
    for t in 0..a.rows {
        for r in 0..w.rows {
            y[t * w.rows + r] = (0..w.cols)
                .map(|c| w.get(r, c) as f64 * a.value(t, c))
                .sum();
        }
    }
    y
}

/// Scale of the rounding error allowed for one output: `sum_k |w| |x|` times f32 epsilon,
/// times a margin for the per-block scale products.
fn magnitude(w: &PackedWeight, a: &QuantizedActs, t: usize, r: usize) -> f64 {
    (0..w.cols)
        .map(|c| (w.get(r, c) as f64 * a.value(t, c)).abs())
        .sum()
}

/// The fastest set this CPU runs is the one picked, or the one `FERRITE_CPU_ISA` names;
/// `FERRITE_EXPECT_ISA` states which that must be (CI's runs under qemu at each Arm level).
#[test]
fn the_fastest_supported_kernel_set_is_picked() {
    let picked = Isa::detect();
    println!("kernel set picked: {}", picked.name());
    let want = std::env::var("FERRITE_EXPECT_ISA")
        .or_else(|_| std::env::var(ferrite_model::backend::cpu::quant::isa::ISA_ENV))
        .unwrap_or_else(|_| Isa::available()[0].name().to_string());
    assert_eq!(picked.name(), want);
    assert!(picked.supported());
}

#[test]
fn every_kernel_set_matches_the_reference_on_odd_shapes() {
    let isas = Isa::available();
    assert!(isas.contains(&Isa::Portable));
    println!("kernel sets on this CPU: {isas:?}");
    let mut rng = StdRng::seed_from_u64(3);
    let mut worst = 0f64;
    for dtype in [
        GgmlDType::Q4_1,
        GgmlDType::Q4_0,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ] {
        let col_sizes: &[usize] = if dtype == GgmlDType::Q4K || dtype == GgmlDType::Q6K {
            &[256, 768]
        } else {
            &[32, 224, 576]
        };
        for &cols in col_sizes {
            for (rows, tokens) in [(1, 1), (5, 3), (37, 9), (70, 17), (9, 1)] {
                let w = PackedWeight::from_qtensor(&ggml(
                    &random(&mut rng, rows * cols),
                    rows,
                    cols,
                    dtype,
                ))
                .unwrap();
                let x = random(&mut rng, tokens * cols);
                for (rounding, &isa) in ROUNDINGS
                    .iter()
                    .flat_map(|r| isas.iter().map(move |i| (r, i)))
                {
                    let mut a = QuantizedActs::default();
                    a.quantize(&x, tokens, cols, *rounding);
                    let want = reference(&w, &a);
                    let mut y = vec![f32::NAN; tokens * rows];
                    matmul(&w.clone().into_layout(isa.layout()), &a, &mut y, isa);
                    for t in 0..tokens {
                        for r in 0..rows {
                            let (got, exp) = (y[t * rows + r] as f64, want[t * rows + r]);
                            let err = (got - exp).abs() / magnitude(&w, &a, t, r).max(1e-30);
                            worst = worst.max(err);
                            assert!(
                                err < 1e-5,
                                "{isa:?} {rounding:?} {dtype:?} {rows}x{cols} t{t} r{r}: {got} vs {exp}"
                            );
                        }
                    }
                }
            }
        }
    }
    println!("worst error / sum|w x|: {worst:.2e}");
}

/// On Arm every kernel set repeats the portable set's arithmetic per row and token, so a
/// model answers the same, bit for bit, on every Arm CPU.
#[test]
#[cfg(target_arch = "aarch64")]
fn arm_kernel_sets_give_the_portable_sets_bits() {
    let mut rng = StdRng::seed_from_u64(5);
    for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q4K] {
        for (rows, cols, tokens) in [(37, 768, 9), (6, 256, 3), (1, 256, 1)] {
            let w = PackedWeight::from_qtensor(&ggml(
                &random(&mut rng, rows * cols),
                rows,
                cols,
                dtype,
            ))
            .unwrap();
            let x = random(&mut rng, tokens * cols);
            for rounding in ROUNDINGS {
                let mut a = QuantizedActs::default();
                a.quantize(&x, tokens, cols, rounding);
                let run = |isa: Isa| {
                    let mut y = vec![f32::NAN; tokens * rows];
                    matmul(&w.clone().into_layout(isa.layout()), &a, &mut y, isa);
                    y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                let want = run(Isa::Portable);
                for isa in Isa::available() {
                    assert_eq!(
                        run(isa),
                        want,
                        "{isa:?} {rounding:?} {dtype:?} {rows}x{cols}"
                    );
                }
            }
        }
    }
}

/// A token's output is bit-identical whether it shares the matmul with 0 or 36 others (three
/// 16-token tiles for AMX, the last one partly filled).
#[test]
fn a_tokens_result_does_not_depend_on_its_neighbours() {
    let mut rng = StdRng::seed_from_u64(4);
    let (rows, cols, tokens) = (75, 576, 37);
    for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
        let w =
            PackedWeight::from_qtensor(&ggml(&random(&mut rng, rows * cols), rows, cols, dtype))
                .unwrap();
        let x = random(&mut rng, tokens * cols);
        for (rounding, isa) in ROUNDINGS
            .iter()
            .flat_map(|&r| Isa::available().into_iter().map(move |i| (r, i)))
        {
            let w = w.clone().into_layout(isa.layout());
            let mut all = QuantizedActs::default();
            all.quantize(&x, tokens, cols, rounding);
            let mut y = vec![0f32; tokens * rows];
            matmul(&w, &all, &mut y, isa);
            // Steps of 0-9 tokens (a step without logits rows gives the LM head none): each
            // count has its own kernel instance below a tile.
            for n in 0..=9 {
                let mut few = QuantizedActs::default();
                few.quantize(&x[..n * cols], n, cols, rounding);
                let mut y_few = vec![0f32; n * rows];
                matmul(&w, &few, &mut y_few, isa);
                assert_eq!(
                    &y[..n * rows],
                    &y_few[..],
                    "{isa:?} {rounding:?} {dtype:?} {n} tokens"
                );
            }
            for t in 0..tokens {
                let mut one = QuantizedActs::default();
                one.quantize(&x[t * cols..][..cols], 1, cols, rounding);
                let mut y1 = vec![0f32; rows];
                matmul(&w, &one, &mut y1, isa);
                assert_eq!(
                    &y[t * rows..][..rows],
                    &y1[..],
                    "{isa:?} {rounding:?} {dtype:?} token {t}"
                );
            }
        }
    }
}
