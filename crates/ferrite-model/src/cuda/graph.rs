//! Decode-only steps replayed from CUDA graphs. Launching a step's ~400 kernels one by one
//! costs the host about as much time as a small batch costs the GPU; a graph launches them
//! all at once. One graph per batch bucket (powers of two): a step is padded to its bucket
//! with rows that read one key and write their K/V into a scratch block outside the
//! scheduler's pool. Everything a graph bakes in is fixed per bucket: input buffers at fixed
//! addresses (filled before each launch), block tables as wide as the longest request,
//! attention splits sized for the longest context, and cuBLAS's workspace.

use super::kernels::{attention_tiles, draw_params, ptr};
use super::model::{CudaModel, StepInputs};
use crate::runner::RowDraw;
use crate::step::PackedStep;
use anyhow::{ensure, Context, Result};
use candle_core::cuda::cudarc::cublas::sys::{cublasSetWorkspace_v2, cublasStatus_t};
use candle_core::cuda::cudarc::cublas::CudaBlas;
use candle_core::cuda::cudarc::driver::{result, sys, CudaGraph, CudaSlice, CudaStream, DevicePtr};
use candle_core::{CudaDevice, DType, Device, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// Largest decode batch replayed from a graph.
pub const MAX_GRAPH_BATCH: usize = 256;

pub struct DecodeGraph {
    // Declared first: the graph goes before the tensors it allocated.
    graph: CudaGraph,
    inputs: StepInputs,
    /// `[bucket * DRAW_PARAMS]` u32 draw parameters of each row, filled before each launch.
    draws: Tensor,
    /// `[bucket, vocab]` f32, written by each launch.
    pub logits: Tensor,
    /// `[bucket]` u32 tokens drawn from `logits`.
    pub tokens: Tensor,
}

// SAFETY: CUDA graphs may move between threads as long as calls on one graph are serialized
// (driver API docs, "Graph object thread safety"); a `DecodeGraph` is only reached through
// `&mut` of the model that owns it, on the engine thread that runs steps.
unsafe impl Send for DecodeGraph {}

/// A workspace for cuBLAS that stays put: a captured gemm keeps the workspace address it was
/// captured with, and cuBLAS's own workspace may move when a larger gemm needs more.
struct BlasWorkspace {
    handle: Arc<CudaBlas>,
    _buf: CudaSlice<u8>,
}

const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

impl BlasWorkspace {
    fn set(dev: &CudaDevice) -> Result<Self> {
        let stream = dev.cuda_stream();
        // SAFETY: cuBLAS only uses it as scratch.
        let buf = unsafe { stream.alloc::<u8>(BLAS_WORKSPACE_BYTES)? };
        let handle = dev.cublas_handle();
        let (p, _) = buf.device_ptr(&stream);
        // SAFETY: a live handle bound to this stream; `buf` lives until `drop` unsets it.
        let status =
            unsafe { cublasSetWorkspace_v2(*handle.handle(), p as *mut _, BLAS_WORKSPACE_BYTES) };
        ensure!(
            status == cublasStatus_t::CUBLAS_STATUS_SUCCESS,
            "cublasSetWorkspace: {status:?}"
        );
        Ok(Self { handle, _buf: buf })
    }
}

impl Drop for BlasWorkspace {
    fn drop(&mut self) {
        // SAFETY: back to cuBLAS's own workspace before the buffer goes.
        unsafe { cublasSetWorkspace_v2(*self.handle.handle(), std::ptr::null_mut(), 0) };
    }
}

#[derive(Default)]
pub struct DecodeGraphs {
    graphs: HashMap<usize, DecodeGraph>,
    /// Declared after `graphs`: dropped once no graph can launch a gemm.
    _workspace: Option<BlasWorkspace>,
    max_batch: usize,
    /// The block that padding rows write to.
    scratch_block: u32,
    block_size: usize,
    /// Block-table width of every graph: the most blocks one request can hold.
    width: usize,
    max_seq_len: usize,
    /// Set after a failed capture: every step then runs eagerly.
    disabled: bool,
}

/// Batch size of a decode-only step (one new token and one logits row per request).
fn decode_batch(step: &PackedStep) -> Option<usize> {
    let b = step.num_seqs();
    (b > 0 && step.num_tokens() == b && step.logits_indices.len() == b).then_some(b)
}

fn u32s(v: &[u32], dev: &Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(v, v.len(), dev)?)
}

impl DecodeGraphs {
    pub fn new(
        dev: &CudaDevice,
        max_batch: usize,
        scratch_block: u32,
        block_size: usize,
        max_seq_len: usize,
    ) -> Result<Self> {
        Ok(Self {
            graphs: HashMap::new(),
            _workspace: Some(BlasWorkspace::set(dev)?),
            max_batch: max_batch.min(MAX_GRAPH_BATCH),
            scratch_block,
            block_size,
            width: max_seq_len.div_ceil(block_size),
            max_seq_len,
            disabled: false,
        })
    }

    /// Runs `step` from its bucket's graph (capturing it on first use), drawing each row's
    /// token as `draws` says (greedy where it says nothing), and returns that graph, whose
    /// first `step.num_seqs()` rows are the step's; `None` when the step is not a decode-only
    /// step that fits.
    pub fn replay(
        &mut self,
        model: &CudaModel,
        step: &PackedStep,
        draws: &[RowDraw],
    ) -> Result<Option<&DecodeGraph>> {
        let Some(b) = decode_batch(step) else {
            return Ok(None);
        };
        if self.disabled || b > self.max_batch || step.kv[0].max_blocks > self.width {
            return Ok(None);
        }
        model.check(step)?;
        let bucket = b.next_power_of_two();
        if !self.graphs.contains_key(&bucket) {
            match self.capture(model, bucket) {
                Ok(g) => {
                    self.graphs.insert(bucket, g);
                }
                Err(e) => {
                    tracing::warn!(
                        "CUDA graph capture failed, decoding eagerly from now on: {e:#}"
                    );
                    self.disabled = true;
                    return Ok(None);
                }
            }
        }
        let g = &self.graphs[&bucket];
        let Device::Cuda(dev) = model.device() else {
            unreachable!("a CUDA model")
        };
        let stream = dev.cuda_stream();
        let scratch_slot = self.scratch_block * self.block_size as u32;
        let pad = |v: &[u32], fill: u32| -> Vec<u32> {
            let mut p = v.to_vec();
            p.resize(bucket, fill);
            p
        };
        copy_in(&stream, &g.inputs.ids, &pad(&step.input_ids, 0))?;
        copy_in(&stream, &g.inputs.positions, &pad(&step.positions, 0))?;
        copy_in(
            &stream,
            &g.inputs.slots,
            &pad(&step.kv[0].slot_mapping, scratch_slot),
        )?;
        copy_in(&stream, &g.inputs.seq_lens_k, &pad(&step.seq_lens_k, 1))?;
        copy_table(&stream, &g.inputs.block_tables, step, self.width)?;
        copy_in(&stream, &g.draws, &draw_params(draws, bucket))?;
        g.graph.launch()?;
        Ok(Some(g))
    }

    fn capture(&self, model: &CudaModel, bucket: usize) -> Result<DecodeGraph> {
        let dev = model.device();
        let Device::Cuda(cuda) = dev else {
            unreachable!("a CUDA model")
        };
        let c = &model.config;
        // Padding rows: one key, in the scratch block, at position 0.
        let mut table = vec![0u32; bucket * self.width];
        table
            .iter_mut()
            .step_by(self.width)
            .for_each(|t| *t = self.scratch_block);
        let tiles = attention_tiles(bucket, bucket, c.head_dim, c.num_heads / c.num_kv_heads);
        let inputs = StepInputs {
            ids: u32s(&vec![0; bucket], dev)?,
            positions: u32s(&vec![0; bucket], dev)?,
            slots: u32s(
                &vec![self.scratch_block * self.block_size as u32; bucket],
                dev,
            )?,
            cu_seqlens_q: u32s(&(0..=bucket as u32).collect::<Vec<_>>(), dev)?,
            seq_lens_k: u32s(&vec![1; bucket], dev)?,
            block_tables: u32s(&table, dev)?,
            rows: u32s(&(0..bucket as u32).collect::<Vec<_>>(), dev)?,
            max_blocks: self.width,
            max_seq_len: self.max_seq_len,
            splits: Some(
                model
                    .kernels()
                    .splits(tiles * c.num_kv_heads, self.max_seq_len),
            ),
        };
        let draws = u32s(&draw_params(&[], bucket), dev)?;
        // An eager run first, so every module is loaded outside the capture.
        model.kernels().sample_rows(&model.run(&inputs)?, &draws)?;
        let stream = cuda.cuda_stream();
        stream.synchronize()?;
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        // Only ferrite's kernels and cuBLAS in here: candle's launches copy their shapes from
        // host memory, which a replay would read after it is gone.
        let captured = model
            .run(&inputs)
            .and_then(|l| Ok((model.kernels().sample_rows(&l, &draws)?, l)));
        // Always end the capture, so a failure leaves the stream usable.
        let graph = stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        let (tokens, logits) = captured?;
        let graph = graph?.context("the capture recorded nothing")?;
        graph.upload()?;
        Ok(DecodeGraph {
            graph,
            inputs,
            draws,
            logits,
            tokens,
        })
    }
}

/// Host to device into a fixed buffer, ordered on the stream.
fn copy_in(stream: &Arc<CudaStream>, dst: &Tensor, data: &[u32]) -> Result<()> {
    debug_assert_eq!(dst.dtype(), DType::U32);
    // SAFETY: `dst` is a live contiguous u32 buffer of at least `data.len()` elements; the
    // driver stages pageable host memory before returning, so `data` may go right after.
    unsafe { result::memcpy_htod_async(ptr(dst)?, data, stream.cu_stream()) }?;
    Ok(())
}

/// The step's `[B, max_blocks]` tables into the first B rows of the `[bucket, width]` table.
fn copy_table(
    stream: &Arc<CudaStream>,
    dst: &Tensor,
    step: &PackedStep,
    width: usize,
) -> Result<()> {
    let row = step.kv[0].max_blocks * 4;
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        srcHost: step.kv[0].block_tables.as_ptr().cast(),
        srcDevice: 0,
        srcArray: std::ptr::null_mut(),
        srcPitch: row,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: ptr(dst)?,
        dstArray: std::ptr::null_mut(),
        dstPitch: width * 4,
        WidthInBytes: row,
        Height: step.num_seqs(),
    };
    // SAFETY: as in `copy_in`; the copy stays inside B rows of `width` u32 each.
    unsafe { sys::cuMemcpy2DAsync_v2(&p, stream.cu_stream()).result()? };
    Ok(())
}
