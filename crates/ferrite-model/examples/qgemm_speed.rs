use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use ferrite_model::backend::cpu::quant::activations::QuantizedActs;
use ferrite_model::backend::cpu::quant::packed::PackedWeight;
use ferrite_model::backend::cpu::quant::{matmul, Isa};
use ferrite_model::backend::Rounding;
use std::time::Instant;

fn main() {
    // Every vector kernel set this CPU has (portable is too slow to matter), fastest first.
    let isas: Vec<Isa> = Isa::available()
        .into_iter()
        .filter(|&i| i != Isa::Portable)
        .collect();
    for (n, k, t) in [
        (3072usize, 576usize, 512usize),
        (576, 1536, 512),
        (960, 576, 512),
        (3072, 576, 32),
        (3072, 576, 24),
        (3072, 576, 16),
        (3072, 576, 8),
        (3072, 576, 5),
        (3072, 576, 4),
        (3072, 576, 3),
        (3072, 576, 2),
        (3072, 576, 1),
        (960, 576, 1),
        (576, 576, 1),
        (576, 1536, 1),
        (49152, 576, 5),
        (49152, 576, 1),
    ] {
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let q = QTensor::quantize(
            &Tensor::from_slice(&x, (n, k), &Device::Cpu).unwrap(),
            if n == 49152 {
                GgmlDType::Q8_0
            } else {
                GgmlDType::Q4_1
            },
        )
        .unwrap();
        let w = PackedWeight::from_qtensor(&q).unwrap();
        let a_f: Vec<f32> = (0..t * k)
            .map(|i| ((i * 104729) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut a = QuantizedActs::default();
        let mut y = vec![0f32; t * n];
        let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
        for (rounding, &isa) in [Rounding::Coarse, Rounding::Fine]
            .iter()
            .flat_map(|r| isas.iter().map(move |i| (*r, i)))
        {
            let w = w.clone().into_layout(isa.layout());
            pool.install(|| {
                for _ in 0..3 {
                    a.quantize(&a_f, t, k, rounding);
                    matmul(&w, &a, &mut y, isa);
                }
                // The best of 7 batches: a shared host's other work only ever adds time.
                let reps = if t >= 64 { 5 } else { 50 };
                let dt = (0..7)
                    .map(|_| {
                        let st = Instant::now();
                        for _ in 0..reps {
                            a.quantize(&a_f, t, k, rounding);
                            matmul(&w, &a, &mut y, isa);
                        }
                        st.elapsed().as_secs_f64() / reps as f64
                    })
                    .fold(f64::INFINITY, f64::min);
                println!(
                    "{n}x{k} t={t} {rounding:?} {}: {:.3} ms, {:.1} GOPS, {:.1} GB/s weights",
                    isa.name(),
                    dt * 1e3,
                    2.0 * (n * k * t) as f64 / dt / 1e9,
                    w.bytes() as f64 / dt / 1e9
                );
            });
        }
    }
}
