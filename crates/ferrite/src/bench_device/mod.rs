//! `ferrite bench device` (CUDA builds): step times of the CUDA model straight through its
//! forward pass, each against a physical floor measured in the same run — the bf16 matmul
//! rate (cuBLAS) and the device-to-device copy bandwidth.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use ferrite_model::backend::cuda::graph::{GraphShape, MAX_WINDOW_ROWS};
use ferrite_model::backend::cuda::{open_device, CudaBackend};
use ferrite_model::backend::MoeBytes;
use ferrite_model::config::ModelConfig;
use ferrite_model::models::{self, Model};
use ferrite_model::step::PackedStep;
use ferrite_model::step::StepModel;
use ferrite_model::weights::config_source::ConfigSource;
use ferrite_model::weights::WeightSource;
use std::time::Instant;

mod args;
mod attention;
mod dense;
mod measure;

pub use args::DeviceBenchArgs;
use attention::attention_alone;
use dense::dense_matmuls;
use measure::{median, step, step_rows, sync, BLOCK};

/// (bf16 matmul FLOP/s, copy bytes/s) of this device, on random data.
fn ceilings(dev: &Device, repeats: usize) -> Result<(f64, f64)> {
    let n = 8192;
    let a = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(DType::BF16)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(DType::BF16)?;
    let mm = median(repeats, || {
        a.matmul(&b)?;
        sync(dev)
    })?;
    let Device::Cuda(cuda) = dev else {
        bail!("not a CUDA device")
    };
    let stream = cuda.cuda_stream();
    let len = 1usize << 30; // 4 GiB of f32
    let src = Tensor::randn(0f32, 1.0, len, dev)?;
    let (storage, _) = src.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*storage else {
        bail!("not a CUDA tensor")
    };
    let src_slice = s.as_cuda_slice::<f32>()?;
    // SAFETY: fully written by the copies below before anything reads it.
    let mut dst = unsafe { stream.alloc::<f32>(len)? };
    let cp = median(repeats, || {
        stream.memcpy_dtod(src_slice, &mut dst)?;
        sync(dev)
    })?;
    Ok((2.0 * (n as f64).powi(3) / mm, 2.0 * (len * 4) as f64 / cp))
}

pub fn run(a: DeviceBenchArgs) -> Result<()> {
    let src = ConfigSource::from_hf(&a.config)?;
    let config = models::config(&src)?;
    let dev = open_device(a.device)?;
    let Device::Cuda(cuda) = &dev else {
        bail!("not a CUDA device")
    };
    let (matmul_rate, copy_bw) = ceilings(&dev, a.repeats)?;
    println!(
        "ceilings: bf16 matmul 8192^3 {:.0} TFLOP/s, device copy {:.0} GB/s (read + write)",
        matmul_rate / 1e12,
        copy_bw / 1e9
    );
    let max_ctx = a.context.max(a.prompt_tokens) + 1;
    let backend = CudaBackend::new(dev.clone(), false, "bench".into())?;
    backend.kernels().set_batch_invariant(a.batch_invariant);
    if a.batch_invariant {
        println!("batch-invariant kernels: every matmul through gemm_bi, attention unsplit");
    }
    let mut model = models::load(
        backend,
        &src,
        &mut WeightSource::Dummy,
        max_ctx,
        &mut |_, _| {},
    )?;
    let wbytes = model.weight_bytes() as f64;
    // A mixture of experts reads its routed experts only where a step's rows go.
    let experts = model.expert_bytes();
    let dense_bytes = wbytes - experts.routed as f64;
    let read_by = |tokens: usize| dense_bytes + experts.read_by(tokens) - experts.always as f64;
    let max_batch = a.batch.iter().copied().max().unwrap_or(1);
    let blocks = (max_batch * a.context.div_ceil(BLOCK)).max(a.prompt_tokens.div_ceil(BLOCK));
    // The last block is the decode graphs' scratch block.
    model.allocate_cache(blocks + 1, BLOCK)?;
    // Linear-attention layers: a state slot per request, and the graphs' scratch slot.
    let state_bytes = model.state_bytes_per_slot();
    model.allocate_state(max_batch + 1)?;
    for pages in model.caches_mut() {
        pages.randomize()?;
    }
    let kv_row = 2 * config.num_kv_heads * config.head_dim * 2 * config.layer_windows.len();
    println!(
        "model: {} layers, hidden {}, {:.2} GB of bf16 weights; floor of a decode step = weights / copy bandwidth = {:.3} ms",
        config.num_layers,
        config.hidden_size,
        wbytes / 1e9,
        wbytes / copy_bw * 1e3
    );
    describe_sparse(&experts, read_by(1), state_bytes);
    println!("| decode batch | context | launch | step ms | host enqueue ms | tokens/s | floor ms (weights + KV read) | step / floor |");
    println!("|---:|---:|---|---:|---:|---:|---:|---:|");
    let mut graph_decode = Vec::new();
    for graphs in [false, true] {
        if graphs {
            model.backend.enable_decode_graphs(GraphShape {
                max_batch,
                scratch_block: blocks as u32,
                state_scratch: (state_bytes > 0).then_some(max_batch as u32),
                block_size: BLOCK,
                max_seq_len: max_ctx,
                heads: (config.num_heads, config.num_kv_heads, config.head_dim),
                kv_groups: model.layout.groups.len(),
            })?;
        }
        for &b in &a.batch {
            let s = step(b, 1, a.context);
            let t = median(a.repeats, || model.forward_argmax(&s).map(|_| ()))?;
            if graphs {
                graph_decode.push((b, t));
            }
            // Host time to launch the step's work, the GPU still busy: the CPU-side floor.
            let host = match graphs {
                true => None,
                false => Some(host_enqueue(&mut model, &s, &dev, a.repeats)?),
            };
            // The recurrent state is read and written back.
            let state = (2 * b * state_bytes) as f64;
            let floor = (read_by(b) + (b * a.context * kv_row) as f64 + state) / copy_bw;
            println!(
                "| {b} | {} | {} | {:.3} | {} | {:.0} | {:.3} | {:.2} |",
                a.context,
                if graphs { "CUDA graph" } else { "eager" },
                t * 1e3,
                host.map_or("-".into(), |h| format!("{:.3}", h * 1e3)),
                b as f64 / t,
                floor * 1e3,
                t / floor
            );
        }
    }
    if state_bytes == 0 {
        verify_table(&mut model, &a, &graph_decode)?;
    }
    if experts.num_experts == 0 && state_bytes == 0 {
        dense_matmuls(cuda, &config, &a, wbytes, copy_bw)?;
    } else {
        println!("(the dense-layer matmul tables are skipped: this model has experts or linear attention)");
    }
    prefill_line(&mut model, &config, &a, dense_bytes, &experts, matmul_rate)?;
    attention_alone(cuda, &config, &a, copy_bw)?;
    Ok(())
}

/// What a decode step reads beyond dense weights: the experts its rows hit, the recurrent
/// state.
fn describe_sparse(experts: &MoeBytes, read_at_batch_1: f64, state_bytes: usize) {
    if experts.num_experts > 0 {
        println!(
            "experts: {} per layer, {} per token, {:.2} GB of them; a decode step's floor counts the weights of the experts its rows are expected to hit (uniform routing): {:.2} GB at batch 1",
            experts.num_experts,
            experts.top_k,
            experts.routed as f64 / 1e9,
            read_at_batch_1 / 1e9
        );
    }
    if state_bytes > 0 {
        println!(
            "linear attention: {:.2} MiB of recurrent state per request, read and written by each decode step",
            state_bytes as f64 / (1 << 20) as f64
        );
    }
}

/// The median host time to enqueue `s`'s work (the GPU still busy): the CPU-side floor.
fn host_enqueue(
    model: &mut Model<CudaBackend>,
    s: &PackedStep,
    dev: &Device,
    repeats: usize,
) -> Result<f64> {
    let mut hosts = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t0 = Instant::now();
        model.launch(s)?;
        hosts.push(t0.elapsed().as_secs_f64());
        sync(dev)?;
    }
    hosts.sort_by(f64::total_cmp);
    Ok(hosts[hosts.len() / 2])
}

/// Speculative verification: each request feeds its last token and k drafts, and every
/// one of the 1 + k rows gets logits (replayed from a graph of that window up to
/// MAX_WINDOW_ROWS rows, eagerly above).
fn verify_table(
    model: &mut Model<CudaBackend>,
    a: &DeviceBenchArgs,
    graph_decode: &[(usize, f64)],
) -> Result<()> {
    println!("| verify batch | k | context | verify step | verify step ms | decode step ms (CUDA graph) | verify / decode | accepted drafts per step to break even |");
    println!("|---:|---:|---:|---|---:|---:|---:|---:|");
    for &(b, decode) in graph_decode {
        for &k in &a.verify_k {
            let s = step_rows(b, 1 + k, a.context, 1 + k);
            let t = median(a.repeats, || model.forward_argmax(&s).map(|_| ()))?;
            let replayed = b.next_power_of_two() * (1 + k) <= MAX_WINDOW_ROWS;
            println!(
                "| {b} | {k} | {} | {} | {:.3} | {:.3} | {:.2} | {:.2} |",
                a.context,
                if replayed { "CUDA graph" } else { "eager" },
                t * 1e3,
                decode * 1e3,
                t / decode,
                t / decode - 1.0
            );
        }
    }
    Ok(())
}

/// Prefill: one request, the whole prompt in one step, against the measured matmul rate.
fn prefill_line(
    model: &mut Model<CudaBackend>,
    config: &ModelConfig,
    a: &DeviceBenchArgs,
    dense_bytes: f64,
    experts: &MoeBytes,
    matmul_rate: f64,
) -> Result<()> {
    let p = a.prompt_tokens;
    let s = step(1, p, p);
    let t = median(a.repeats.min(5), || model.forward_argmax(&s).map(|_| ()))?;
    // Each token multiplies by its top-k experts only.
    let active = dense_bytes
        + experts.routed as f64 * experts.top_k as f64 / experts.num_experts.max(1) as f64;
    let matmul_params = active / 2.0 - (config.vocab_size * config.hidden_size) as f64;
    let attn_flops = 4.0
        * (p as f64 * p as f64 / 2.0)
        * (config.num_heads * config.head_dim * config.layer_windows.len()) as f64;
    let flops = 2.0 * matmul_params * p as f64 + attn_flops;
    println!(
        "prefill {p} tokens: {:.1} ms, {:.0} tokens/s, {:.0} TFLOP/s = {:.0}% of the measured matmul rate",
        t * 1e3,
        p as f64 / t,
        flops / t / 1e12,
        100.0 * flops / t / matmul_rate
    );
    Ok(())
}
