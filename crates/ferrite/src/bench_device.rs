//! `ferrite bench device` (CUDA builds): step times of the CUDA model straight through its
//! forward pass, each against a physical floor measured in the same run — the bf16 matmul
//! rate (cuBLAS) and the device-to-device copy bandwidth.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use ferrite_model::backend::cuda::graph::{GraphShape, MAX_WINDOW_ROWS};
use ferrite_model::backend::cuda::kernels::attention::{AttentionMeta, AttentionShape};
use ferrite_model::backend::cuda::kernels::matmul::MatIn;
use ferrite_model::backend::cuda::kernels::Kernels;
use ferrite_model::backend::cuda::linear::{self, interleave_gate_up, Linear};
use ferrite_model::backend::cuda::{open_device, CudaBackend, KvPages};
use ferrite_model::backend::Activation;
use ferrite_model::config::ModelConfig;
use ferrite_model::kv_dtype::KvCacheDtype;
use ferrite_model::models;
use ferrite_model::step::PackedStep;
use ferrite_model::step::StepModel;
use ferrite_model::weights::config_source::ConfigSource;
use ferrite_model::weights::WeightSource;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct DeviceBenchArgs {
    /// A Hugging Face config.json; weights are random (`--load-format dummy`).
    pub config: PathBuf,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Decode batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    pub batch: Vec<usize>,
    /// K/V length of every request in the decode measurement.
    #[arg(long, default_value_t = 1024)]
    pub context: usize,
    /// Prompt length of the prefill measurement (one request, one step).
    #[arg(long, default_value_t = 4608)]
    pub prompt_tokens: usize,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub repeats: usize,
    /// Draft lengths of the speculative verify-step table (each request 1 + k rows).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    pub verify_k: Vec<usize>,
    /// Time the batch-invariant kernels (`ferrite serve --batch-invariant`): every matmul
    /// of the steps (and of the small-row tables) through them, attention unsplit.
    #[arg(long)]
    pub batch_invariant: bool,
}

const BLOCK: usize = 16;

/// Median seconds of `f` over `n` runs after two warm-up runs; `f` must end synchronized.
fn median(n: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    f()?;
    let mut t = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[n / 2])
}

/// One launch of a matmul kind on one layer's weights.
type Folded<'a> = &'a dyn Fn(&Linear) -> Result<()>;

fn sync(dev: &Device) -> Result<()> {
    if let Device::Cuda(d) = dev {
        d.cuda_stream().synchronize()?;
    }
    Ok(())
}

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

/// `batch` requests of `qlen` new tokens each, at K/V length `ctx`, in disjoint blocks; a
/// logits row for the last `rows` tokens of each.
fn step_rows(batch: usize, qlen: usize, ctx: usize, rows: usize) -> PackedStep {
    let per = ctx.div_ceil(BLOCK);
    let mut s = PackedStep::default();
    for b in 0..batch {
        let table: Vec<u32> = (0..per).map(|i| (b * per + i) as u32).collect();
        let ids: Vec<u32> = (0..qlen).map(|i| (1000 + 7 * i + b) as u32).collect();
        s.push(&ids, ctx - qlen, std::slice::from_ref(&table), BLOCK);
        let end = s.num_tokens() as u32;
        s.logits_indices.extend(end - rows as u32..end);
        s.state.slots.push(b as u32);
    }
    s.finish();
    s
}

/// `batch` requests of `qlen` new tokens each, a logits row for the last.
fn step(batch: usize, qlen: usize, ctx: usize) -> PackedStep {
    step_rows(batch, qlen, ctx, 1)
}

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
    if experts.num_experts > 0 {
        println!(
            "experts: {} per layer, {} per token, {:.2} GB of them; a decode step's floor counts the weights of the experts its rows are expected to hit (uniform routing): {:.2} GB at batch 1",
            experts.num_experts,
            experts.top_k,
            experts.routed as f64 / 1e9,
            read_by(1) / 1e9
        );
    }
    if state_bytes > 0 {
        println!(
            "linear attention: {:.2} MiB of recurrent state per request, read and written by each decode step",
            state_bytes as f64 / (1 << 20) as f64
        );
    }
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
            let host = if graphs {
                None
            } else {
                let mut hosts = Vec::with_capacity(a.repeats);
                for _ in 0..a.repeats {
                    let t0 = Instant::now();
                    model.launch(&s)?;
                    hosts.push(t0.elapsed().as_secs_f64());
                    sync(&dev)?;
                }
                hosts.sort_by(f64::total_cmp);
                Some(hosts[hosts.len() / 2])
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
    // Speculative verification: each request feeds its last token and k drafts, and every
    // one of the 1 + k rows gets logits (replayed from a graph of that window up to
    // MAX_WINDOW_ROWS rows, eagerly above).
    if state_bytes == 0 {
        println!("| verify batch | k | context | verify step | verify step ms | decode step ms (CUDA graph) | verify / decode | accepted drafts per step to break even |");
        println!("|---:|---:|---:|---|---:|---:|---:|---:|");
        for &(b, decode) in &graph_decode {
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
    }
    if experts.num_experts == 0 && state_bytes == 0 {
        dense_matmuls(cuda, &config, &a, wbytes, copy_bw)?;
    } else {
        println!("(the dense-layer matmul tables are skipped: this model has experts or linear attention)");
    }
    // Prefill: one request, the whole prompt in one step.
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
    attention_alone(cuda, &config, &a, copy_bw)?;
    Ok(())
}

/// The matmuls of a dense model's decode step alone, one and a few rows, through cuBLAS,
/// the small-row kernels and with the ops around them folded in.
fn dense_matmuls(
    cuda: &candle_core::CudaDevice,
    config: &ModelConfig,
    a: &DeviceBenchArgs,
    wbytes: f64,
    copy_bw: f64,
) -> Result<()> {
    let dev = Device::Cuda(cuda.clone());
    // The matmuls of a decode step alone (every layer's four and the LM head, one row each):
    // what cuBLAS makes of reading the weights once.
    let kernels = Kernels::load(cuda)?;
    kernels.set_batch_invariant(a.batch_invariant);
    let layers = layer_weights(config, &dev)?;
    let lm_head = Linear::Dense(linear::random(config.vocab_size, config.hidden_size, &dev)?);
    let final_norm = Tensor::ones(config.hidden_size, DType::BF16, &dev)?;
    for rows in [1usize, 2, 4, 8, 32] {
        let x =
            Tensor::randn(0f32, 1.0, (rows, config.hidden_size), &dev)?.to_dtype(DType::BF16)?;
        let xi = Tensor::randn(0f32, 1.0, (rows, config.intermediate_size), &dev)?
            .to_dtype(DType::BF16)?;
        let xo = Tensor::randn(0f32, 1.0, (rows, config.num_heads * config.head_dim), &dev)?
            .to_dtype(DType::BF16)?;
        let t = median(a.repeats, || {
            for l in &layers {
                kernels.matmul_nt(&x, l.qkv.dense()?, DType::BF16)?;
                kernels.matmul_nt(&xo, l.o.dense()?, DType::BF16)?;
                kernels.matmul_nt(&x, l.gate_up.dense()?, DType::BF16)?;
                kernels.matmul_nt(&xi, l.down.dense()?, DType::BF16)?;
            }
            kernels.matmul_nt(&x, lm_head.dense()?, DType::F32)?;
            sync(&dev)
        })?;
        println!(
            "matmuls only, {rows} rows: {:.3} ms = {:.0} GB/s of weights ({:.2}x the weights-read floor)",
            t * 1e3,
            wbytes / t / 1e9,
            t / (wbytes / copy_bw)
        );
    }
    // The same through the small-row matmuls of steps of up to 8 rows (decodes, one request's
    // verify window), with the RMSNorms, the SiLU-mul and the residual adds of the layer folded
    // in; a matrix whose rows do not fit shared memory goes to cuBLAS, as in a step. (With
    // --batch-invariant: the batch-invariant kernel at every row count, the norms apart.)
    let rows_list: &[usize] = match a.batch_invariant {
        true => &[1, 2, 4, 8, 32],
        false => &[1, 2, 4, 8],
    };
    for &rows in rows_list {
        let x = Tensor::randn(0f32, 1.0, (rows, config.hidden_size), &dev)?;
        let attn = Tensor::randn(0f32, 1.0, (rows, config.num_heads * config.head_dim), &dev)?
            .to_dtype(DType::BF16)?;
        let act = Tensor::randn(0f32, 1.0, (rows, config.intermediate_size), &dev)?
            .to_dtype(DType::BF16)?;
        let eps = config.rms_norm_eps;
        let norm = |norm| MatIn::Rms {
            x: &x,
            rows: None,
            norm,
            eps,
        };
        let t = median(a.repeats, || {
            for l in &layers {
                kernels.matmul(norm(&l.attn_norm), &l.qkv, DType::BF16)?;
                kernels.matmul_add(MatIn::Bf16(&attn), &l.o, &x)?;
                kernels.matmul_gated(norm(&l.ffn_norm), &l.gate_up, Activation::Silu)?;
                kernels.matmul_add(MatIn::Bf16(&act), &l.down, &x)?;
            }
            kernels.matmul(norm(&final_norm), &lm_head, DType::F32)?;
            sync(&dev)
        })?;
        println!(
            "{} matmuls with norms, SiLU and residual adds, {rows} rows: {:.3} ms = {:.0} GB/s of weights ({:.2}x the weights-read floor)",
            if a.batch_invariant { "batch-invariant" } else { "small-row (folded)" },
            t * 1e3,
            wbytes / t / 1e9,
            t / (wbytes / copy_bw)
        );
    }
    // Each matmul of a layer on its own (all 32 layers' of that kind; the head once), one row:
    // cuBLAS, the small-row kernel on bf16 rows, and with the op before it folded in.
    {
        let x = Tensor::randn(0f32, 1.0, (1, config.hidden_size), &dev)?;
        let xb = x.to_dtype(DType::BF16)?;
        let attn = Tensor::randn(0f32, 1.0, (1, config.num_heads * config.head_dim), &dev)?
            .to_dtype(DType::BF16)?;
        let act =
            Tensor::randn(0f32, 1.0, (1, config.intermediate_size), &dev)?.to_dtype(DType::BF16)?;
        let eps = config.rms_norm_eps;
        let rms = |norm| MatIn::Rms {
            x: &x,
            rows: None,
            norm,
            eps,
        };
        let layers = &layers;
        let head = std::slice::from_ref(&lm_head);
        let final_norm = &final_norm;
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
                    sync(&dev)
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

/// The attention kernel by itself on decode batches: time against the K/V bytes it must read.
fn attention_alone(
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
