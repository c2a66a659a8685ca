//! The dense layers' matmuls of a decode step alone: all of them, with the ops around them
//! folded in, and each kind on its own, against the weights-read floor.

use super::args::DeviceBenchArgs;
use super::measure::{median, sync};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use ferrite_model::backend::cuda::kernels::matmul::MatIn;
use ferrite_model::backend::cuda::kernels::Kernels;
use ferrite_model::backend::cuda::linear::{self, interleave_gate_up, Linear};
use ferrite_model::backend::Activation;
use ferrite_model::config::ModelConfig;

/// One launch of a matmul kind on one layer's weights.
type Folded<'a> = &'a dyn Fn(&Linear) -> Result<()>;

/// One layer's matrices (random, bf16), for the matmul timings.
struct LayerWeights {
    attn_norm: Tensor,
    qkv: Linear,
    o: Linear,
    ffn_norm: Tensor,
    gate_up: Linear,
    down: Linear,
}

fn layer_weights(c: &ModelConfig, dev: &Device) -> Result<Vec<LayerWeights>> {
    let (h, d) = (c.hidden_size, c.head_dim);
    let dense = |r, k| Ok::<_, anyhow::Error>(Linear::Dense(linear::random(r, k, dev)?));
    let ones = || Ok::<_, anyhow::Error>(Tensor::ones(h, DType::BF16, dev)?);
    (0..c.num_layers)
        .map(|_| {
            let i = c.intermediate_size;
            let gate_up =
                interleave_gate_up(&linear::random(i, h, dev)?, &linear::random(i, h, dev)?)?;
            Ok(LayerWeights {
                attn_norm: ones()?,
                qkv: dense((c.num_heads + 2 * c.num_kv_heads) * d, h)?,
                o: dense(h, c.num_heads * d)?,
                ffn_norm: ones()?,
                gate_up: Linear::Dense(gate_up),
                down: dense(h, i)?,
            })
        })
        .collect()
}

/// The matmuls of a dense model's decode step alone, one and a few rows, through cuBLAS,
/// the small-row kernels and with the ops around them folded in.
pub(super) fn dense_matmuls(
    cuda: &candle_core::CudaDevice,
    config: &ModelConfig,
    a: &DeviceBenchArgs,
    wbytes: f64,
    copy_bw: f64,
) -> Result<()> {
    let dev = Device::Cuda(cuda.clone());
    let kernels = Kernels::load(cuda)?;
    kernels.set_batch_invariant(a.batch_invariant);
    let layers = layer_weights(config, &dev)?;
    let lm_head = Linear::Dense(linear::random(config.vocab_size, config.hidden_size, &dev)?);
    let final_norm = Tensor::ones(config.hidden_size, DType::BF16, &dev)?;
    let kit = DenseKit {
        dev,
        kernels,
        layers,
        lm_head,
        final_norm,
    };
    matmuls_alone(&kit, config, a, wbytes, copy_bw)?;
    matmuls_folded(&kit, config, a, wbytes, copy_bw)?;
    matmuls_each(&kit, config, a, copy_bw)?;
    Ok(())
}

/// What the dense matmul tables run on: random weights of every layer, the LM head.
struct DenseKit {
    dev: Device,
    kernels: Kernels,
    layers: Vec<LayerWeights>,
    lm_head: Linear,
    final_norm: Tensor,
}

/// The matmuls of a decode step alone (every layer's four and the LM head, a few rows):
/// what cuBLAS makes of reading the weights once.
fn matmuls_alone(
    k: &DenseKit,
    config: &ModelConfig,
    a: &DeviceBenchArgs,
    wbytes: f64,
    copy_bw: f64,
) -> Result<()> {
    let DenseKit {
        dev,
        kernels,
        layers,
        lm_head,
        ..
    } = k;
    for rows in [1usize, 2, 4, 8, 32] {
        let x = Tensor::randn(0f32, 1.0, (rows, config.hidden_size), dev)?.to_dtype(DType::BF16)?;
        let xi = Tensor::randn(0f32, 1.0, (rows, config.intermediate_size), dev)?
            .to_dtype(DType::BF16)?;
        let xo = Tensor::randn(0f32, 1.0, (rows, config.num_heads * config.head_dim), dev)?
            .to_dtype(DType::BF16)?;
        let t = median(a.repeats, || {
            for l in layers {
                kernels.matmul_nt(&x, l.qkv.dense()?, DType::BF16)?;
                kernels.matmul_nt(&xo, l.o.dense()?, DType::BF16)?;
                kernels.matmul_nt(&x, l.gate_up.dense()?, DType::BF16)?;
                kernels.matmul_nt(&xi, l.down.dense()?, DType::BF16)?;
            }
            kernels.matmul_nt(&x, lm_head.dense()?, DType::F32)?;
            sync(dev)
        })?;
        println!(
            "matmuls only, {rows} rows: {:.3} ms = {:.0} GB/s of weights ({:.2}x the weights-read floor)",
            t * 1e3,
            wbytes / t / 1e9,
            t / (wbytes / copy_bw)
        );
    }
    Ok(())
}

fn matmuls_folded(
    k: &DenseKit,
    config: &ModelConfig,
    a: &DeviceBenchArgs,
    wbytes: f64,
    copy_bw: f64,
) -> Result<()> {
    let DenseKit {
        dev,
        kernels,
        layers,
        lm_head,
        final_norm,
    } = k;
    // The same through the small-row matmuls of steps of up to 8 rows (decodes, one request's
    // verify window), with the RMSNorms, the SiLU-mul and the residual adds of the layer folded
    // in; a matrix whose rows do not fit shared memory goes to cuBLAS, as in a step. (With
    // --batch-invariant: the batch-invariant kernel at every row count, the norms apart.)
    let rows_list: &[usize] = match a.batch_invariant {
        true => &[1, 2, 4, 8, 32],
        false => &[1, 2, 4, 8],
    };
    for &rows in rows_list {
        let x = Tensor::randn(0f32, 1.0, (rows, config.hidden_size), dev)?;
        let attn = Tensor::randn(0f32, 1.0, (rows, config.num_heads * config.head_dim), dev)?
            .to_dtype(DType::BF16)?;
        let act = Tensor::randn(0f32, 1.0, (rows, config.intermediate_size), dev)?
            .to_dtype(DType::BF16)?;
        let eps = config.rms_norm_eps;
        let norm = |norm| MatIn::Rms {
            x: &x,
            rows: None,
            norm,
            eps,
        };
        let t = median(a.repeats, || {
            for l in layers {
                kernels.matmul(norm(&l.attn_norm), &l.qkv, DType::BF16)?;
                kernels.matmul_add(MatIn::Bf16(&attn), &l.o, &x)?;
                kernels.matmul_gated(norm(&l.ffn_norm), &l.gate_up, Activation::Silu)?;
                kernels.matmul_add(MatIn::Bf16(&act), &l.down, &x)?;
            }
            kernels.matmul(norm(final_norm), lm_head, DType::F32)?;
            sync(dev)
        })?;
        println!(
            "{} matmuls with norms, SiLU and residual adds, {rows} rows: {:.3} ms = {:.0} GB/s of weights ({:.2}x the weights-read floor)",
            if a.batch_invariant { "batch-invariant" } else { "small-row (folded)" },
            t * 1e3,
            wbytes / t / 1e9,
            t / (wbytes / copy_bw)
        );
    }
    Ok(())
}

fn matmuls_each(
    k: &DenseKit,
    config: &ModelConfig,
    a: &DeviceBenchArgs,
    copy_bw: f64,
) -> Result<()> {
    let DenseKit {
        dev,
        kernels,
        layers,
        lm_head,
        final_norm,
    } = k;
    // Each matmul of a layer on its own (all 32 layers' of that kind; the head once), one row:
    // cuBLAS, the small-row kernel on bf16 rows, and with the op before it folded in.
    {
        let x = Tensor::randn(0f32, 1.0, (1, config.hidden_size), dev)?;
        let xb = x.to_dtype(DType::BF16)?;
        let attn = Tensor::randn(0f32, 1.0, (1, config.num_heads * config.head_dim), dev)?
            .to_dtype(DType::BF16)?;
        let act =
            Tensor::randn(0f32, 1.0, (1, config.intermediate_size), dev)?.to_dtype(DType::BF16)?;
        let eps = config.rms_norm_eps;
        let rms = |norm| MatIn::Rms {
            x: &x,
            rows: None,
            norm,
            eps,
        };
        let head = std::slice::from_ref(lm_head);
        let kinds: [(&str, Vec<&Linear>, &Tensor, Folded); 5] = [
            (
                "qkv (RMSNorm folded)",
                layers.iter().map(|l| &l.qkv).collect(),
                &xb,
                &|w| {
                    kernels
                        .matmul(rms(&layers[0].attn_norm), w, DType::BF16)
                        .map(|_| ())
                },
            ),
            (
                "o (residual add folded)",
                layers.iter().map(|l| &l.o).collect(),
                &attn,
                &|w| kernels.matmul_add(MatIn::Bf16(&attn), w, &x),
            ),
            (
                "gate_up (RMSNorm folded)",
                layers.iter().map(|l| &l.gate_up).collect(),
                &xb,
                &|w| {
                    kernels
                        .matmul(rms(&layers[0].ffn_norm), w, DType::BF16)
                        .map(|_| ())
                },
            ),
            (
                "down (residual add folded)",
                layers.iter().map(|l| &l.down).collect(),
                &act,
                &|w| kernels.matmul_add(MatIn::Bf16(&act), w, &x),
            ),
            (
                "LM head (final RMSNorm folded)",
                head.iter().collect(),
                &xb,
                &|w| kernels.matmul(rms(final_norm), w, DType::F32).map(|_| ()),
            ),
        ];
        println!("| one row, all layers | weights MB | floor us | cuBLAS us | small-row us | folded us | folded / floor |");
        println!("|---|---:|---:|---:|---:|---:|---:|");
        for (name, ws, input, folded) in kinds {
            let time = |f: Folded| {
                median(a.repeats, || {
                    for w in &ws {
                        f(w)?;
                    }
                    sync(dev)
                })
            };
            let cublas = time(&|w| {
                kernels
                    .matmul_nt(input, w.dense()?, DType::BF16)
                    .map(|_| ())
            })?;
            let small = time(&|w| {
                kernels
                    .matmul(MatIn::Bf16(input), w, DType::BF16)
                    .map(|_| ())
            })?;
            let fold = time(folded)?;
            let bytes: f64 = ws.iter().map(|w| w.bytes() as f64).sum();
            let floor = bytes / copy_bw;
            println!(
                "| {name} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} |",
                bytes / 1e6,
                floor * 1e6,
                cublas * 1e6,
                small * 1e6,
                fold * 1e6,
                fold / floor
            );
        }
    }
    Ok(())
}
