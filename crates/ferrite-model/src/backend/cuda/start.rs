//! Start-up on a GPU: the device's memory, weights bf16 or kept quantized, a step's memory
//! as the device reports it, one padding block and slot, decode graphs captured last.

use super::device::{cuda, open_device};
use super::graph::{GraphShape, MAX_GRAPH_BATCH, MAX_WINDOW_ROWS};
use super::CudaBackend;
use crate::config::ModelConfig;
use crate::engine_args::EngineArgs;
use crate::memory::{self, MemoryPlan, GIB};
use crate::models::Model;
use crate::parallel::Group;
use crate::pooling::Pooling;
use crate::settings::{DeviceKind, WeightFormat};
use crate::start::Startup;
use crate::step::{PackedStep, StepModel};
use crate::weights::WeightSource;
use anyhow::{bail, Result};
use candle_core::cuda::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda::cudarc::driver::CudaContext;
use candle_core::Device;

pub struct CudaStart {
    device: Device,
    /// `cuda:N (name)`, as the start-up line states it.
    name: String,
    /// The GPU's memory, and this rank's part of it.
    gpu_bytes: u64,
    memory: u64,
    /// Whether a rank has a GPU of its own (else the host's ranks share one).
    own_gpu: bool,
    /// A GGUF's blocks kept (candle's quantized matmuls) rather than dequantized to bf16.
    quantized: bool,
    split: bool,
}

/// A split model's GPU for this rank: one of its own, `ordinal + local rank`, when the host
/// has that many; else every rank of the host shares `ordinal` (host-staged collectives).
fn rank_device(g: Option<&Group>, ordinal: usize) -> (usize, bool) {
    let Some(g) = g else {
        return (ordinal, true);
    };
    let gpus = CudaContext::device_count().unwrap_or(0).max(0) as usize;
    match ordinal + g.local_ranks <= gpus {
        true => (ordinal + g.local_rank, true),
        false => {
            tracing::warn!(
                "{} ranks on this host and {gpus} GPU(s) from cuda:{ordinal} on: the ranks share cuda:{ordinal}, their activations staged through host memory",
                g.local_ranks
            );
            (ordinal, false)
        }
    }
}

impl CudaStart {
    /// Whether decode steps replay captured graphs. candle's quantized matmuls keep a
    /// workspace they may move between calls, which a captured graph would go on pointing
    /// at: quantized weights run eagerly. A split model's ranks run eagerly too: every rank
    /// would have to capture the same graphs in step.
    fn graphs(&self, args: &EngineArgs) -> bool {
        !args.enforce_eager && !self.quantized && !self.split
    }
}

impl Startup for CudaStart {
    type Backend = CudaBackend;

    fn open(args: &EngineArgs, group: Option<&Group>) -> Result<Self> {
        let DeviceKind::Cuda(ordinal) = args.device else {
            bail!("the CUDA start-up needs --device cuda");
        };
        let (ordinal, own_gpu) = rank_device(group, ordinal);
        let device = open_device(ordinal)?;
        let ctx = cuda(&device)?.cuda_stream().context().clone();
        let gpu_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let (_, mut total) = ctx.mem_get_info()?;
        // A GPU sharing the host's memory counts what the host has free (the OS, a
        // browser, an editor use the same memory): the budget is a share of that.
        if ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)? == 1 {
            let available = memory::available_memory_bytes()? as usize;
            tracing::info!(
                "{gpu_name} shares the host's memory: the budget is a share of the {:.1} GiB \
                 the host has available, of {:.1} GiB",
                available as f64 / GIB,
                total as f64 / GIB
            );
            total = total.min(available);
        }
        let sharing = match (group, own_gpu) {
            (Some(g), false) => g.local_ranks as u64,
            _ => 1,
        };
        Ok(Self {
            device,
            name: format!("cuda:{ordinal} ({gpu_name})"),
            gpu_bytes: total as u64,
            memory: total as u64 / sharing,
            own_gpu,
            quantized: false,
            split: group.is_some(),
        })
    }

    fn check(_args: &EngineArgs, pooling: Option<&Pooling>) -> Result<()> {
        if pooling.is_some() {
            bail!("embedding models run on the CPU backend only; use --device cpu");
        }
        Ok(())
    }

    fn memory_bytes(&self) -> u64 {
        self.memory
    }

    fn backend(
        &mut self,
        args: &EngineArgs,
        weights: &WeightSource,
        group: Option<Group>,
    ) -> Result<CudaBackend> {
        // `native` keeps a GGUF's blocks (candle's quantized matmuls), `f32` dequantizes to
        // bf16 (cuBLAS and ferrite's small-row matmuls: faster, see h200.md), `auto` takes
        // bf16 when that needs at most half the GPU's memory (always, with
        // `--batch-invariant`).
        self.quantized = match (weights, args.weight_format) {
            (WeightSource::Gguf { file, .. }, WeightFormat::Auto) => {
                !args.batch_invariant && 2 * file.param_count() as u64 > self.gpu_bytes / 2
            }
            (WeightSource::Gguf { .. }, format) => format == WeightFormat::Native,
            _ => false,
        };
        if self.quantized && args.batch_invariant {
            bail!("--batch-invariant runs bf16 weights: leave out --weight-format native");
        }
        let backend = CudaBackend::new(self.device.clone(), self.quantized, self.name.clone())?;
        backend.kernels().set_batch_invariant(args.batch_invariant);
        match group {
            Some(g) => backend.in_group(g, self.own_gpu),
            None => Ok(backend),
        }
    }

    /// A draft model's steps run eagerly, on the same stream.
    fn draft_backend(&self, args: &EngineArgs, _main: &CudaBackend) -> Result<CudaBackend> {
        let name = format!("{}, eager", self.name);
        let backend = CudaBackend::new(self.device.clone(), self.quantized, name)?;
        backend.kernels().set_batch_invariant(args.batch_invariant);
        Ok(backend)
    }

    /// The larger of what the step took from the device and a count of every intermediate
    /// tensor it allocates (cuBLAS picks its algorithms here; nothing is compiled: the
    /// kernels ship as machine code).
    fn measure_step(model: &mut Model<CudaBackend>, step: &PackedStep) -> Result<u64> {
        let stream = cuda(model.backend.device())?.cuda_stream();
        let ctx = stream.context().clone();
        let (free_before, _) = ctx.mem_get_info()?;
        model.forward(step)?;
        stream.synchronize()?;
        let (free_after, _) = ctx.mem_get_info()?;
        const CUBLAS_WORKSPACE: usize = 64 << 20;
        let c = &model.config;
        let tokens = step.input_ids.len();
        let counted = (tokens * bytes_per_token(c) + c.vocab_size * 8 + CUBLAS_WORKSPACE) as u64;
        Ok(counted.max(free_before.saturating_sub(free_after) as u64))
    }

    fn reserved_bytes(&self, args: &EngineArgs, config: &ModelConfig) -> u64 {
        if !self.graphs(args) {
            return 0;
        }
        graph_bytes(config, args.max_num_seqs.min(MAX_GRAPH_BATCH))
            + args
                .speculation
                .as_ref()
                .map_or(0, |s| verify_graph_bytes(config, s.k))
    }

    /// Decode graphs pad into one block and one state slot past the scheduler's.
    fn padding(&self) -> usize {
        1
    }

    fn ready(
        &mut self,
        model: &mut Model<CudaBackend>,
        args: &EngineArgs,
        plan: &MemoryPlan,
        max_model_len: usize,
    ) -> Result<()> {
        if !self.graphs(args) {
            return Ok(());
        }
        let c = &model.config;
        let heads = (c.num_heads, c.num_kv_heads, c.head_dim);
        let scratch = plan.state_slots + plan.state_checkpoints + plan.state_draft_slots;
        let shape = GraphShape {
            max_batch: args.max_num_seqs,
            scratch_block: plan.num_blocks as u32,
            state_scratch: (plan.state_slots > 0).then_some(scratch as u32),
            block_size: args.block_size,
            max_seq_len: max_model_len,
            heads,
            kv_groups: model.layout.groups.len(),
        };
        model.backend.enable_decode_graphs(shape)
    }
}

/// Every intermediate tensor of one token's pass through a layer (and the step's inputs).
fn bytes_per_token(c: &ModelConfig) -> usize {
    let q_w = c.num_heads * c.head_dim;
    4 * 2 * c.hidden_size
        + 2 * (3 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
        + 2 * 2 * q_w
        + 2 * 3 * c.intermediate_size
        + 4 * 8
}

/// What the decode graphs keep allocated: each bucket's intermediates, f32 logits and
/// attention partials, captured once and held for the life of the engine.
fn graph_bytes(c: &ModelConfig, max_batch: usize) -> u64 {
    let mut b = 1;
    let mut total = 0;
    while b <= max_batch.next_power_of_two() {
        total += b * (bytes_per_token(c) + 8 * c.vocab_size) + (4 << 20);
        b *= 2;
    }
    total as u64
}

/// What the verify graphs keep allocated: windows of 2 to 1 + k rows per request, each in
/// buckets of requests up to [`MAX_WINDOW_ROWS`] rows.
fn verify_graph_bytes(c: &ModelConfig, k: usize) -> u64 {
    let mut total = 0;
    for w in 2..=1 + k {
        let mut b = 1;
        while b * w <= MAX_WINDOW_ROWS {
            total += b * w * (bytes_per_token(c) + 8 * c.vocab_size) + (4 << 20);
            b *= 2;
        }
    }
    total as u64
}
