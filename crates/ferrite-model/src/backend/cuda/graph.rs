//! Decode-only steps replayed from CUDA graphs. Launching a step's ~400 kernels one by one
//! costs the host about as much time as a small batch costs the GPU; a graph launches them
//! all at once. One graph per batch bucket (powers of two): a step is padded to its bucket
//! with rows that read one key and write their K/V into a scratch block outside the
//! scheduler's pool. Everything a graph bakes in is fixed per bucket: input buffers at fixed
//! addresses (filled before each launch), block tables as wide as the longest request,
//! attention splits sized for the longest context, and cuBLAS's workspace. The draw (grammar
//! masks, sampling) is a second graph, so the host makes the masks while the forward runs.

use super::inputs::{u32s, GroupInputs, StepInputs};
use super::kernels::attention::attention_tiles;
use super::kernels::sample::{draw_params, mask_words};
use super::kernels::{ptr, Arena, Kernels};
use crate::runner::DeviceDraws;
use crate::step::{KvTables, PackedStep};
use anyhow::{ensure, Context, Result};
use candle_core::cuda::cudarc::cublas::sys::{cublasSetWorkspace_v2, cublasStatus_t};
use candle_core::cuda::cudarc::cublas::CudaBlas;
use candle_core::cuda::cudarc::driver::{
    result, sys, CudaGraph, CudaSlice, CudaStream, DevicePtr, HostSlice, PinnedHostSlice,
};
use candle_core::{CudaDevice, DType, Device, Tensor};

/// The forward pass a graph captures: launches every op over the inputs, returns the logits.
pub type Launch<'a> = &'a mut dyn FnMut(&StepInputs) -> Result<Tensor>;
use std::collections::HashMap;
use std::sync::Arc;

/// Largest decode batch replayed from a graph.
pub const MAX_GRAPH_BATCH: usize = 256;

/// Largest arena a graph carves its outputs from (an 8B model's batch of 2 needs ~14 MB).
const MAX_ARENA_BYTES: usize = 64 << 20;

pub struct DecodeGraph {
    // Declared first: the graphs go before the tensors they allocated.
    forward: CudaGraph,
    /// Masks and samples `logits` into `tokens`.
    draw: CudaGraph,
    inputs: StepInputs,
    /// `[bucket * DRAW_PARAMS]` u32 draw parameters of each row, filled before each launch.
    draws: Tensor,
    /// `[bucket, words]` u32 grammar masks, filled before a draw with masked rows.
    masks: Tensor,
    /// Page-locked host copy of `masks`: the masks are written there and copied
    /// asynchronously.
    staged: PinnedHostSlice<u32>,
    words: usize,
    /// `[bucket, vocab]` f32, written by each launch.
    pub logits: Tensor,
    /// `[bucket]` u32 tokens drawn from `logits`.
    pub tokens: Tensor,
    /// What the graphs' outputs were carved from (the forward's, if they were).
    _arenas: (Option<Arena>, Arena),
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
    /// The recurrent-state slot padding rows write to (models with linear attention).
    state_scratch: Option<u32>,
    block_size: usize,
    /// Block-table width of every graph: the most blocks one request can hold.
    width: usize,
    max_seq_len: usize,
    /// Query heads, KV heads and head size (they size the attention splits).
    heads: (usize, usize, usize),
    kv_groups: usize,
    /// Set after a failed capture: every step then runs eagerly.
    disabled: bool,
}

/// The shapes a set of decode graphs is built for.
pub struct GraphShape {
    pub max_batch: usize,
    /// The block that padding rows write to.
    pub scratch_block: u32,
    /// The recurrent-state slot padding rows write to, for a model with linear attention.
    pub state_scratch: Option<u32>,
    pub block_size: usize,
    pub max_seq_len: usize,
    pub heads: (usize, usize, usize),
    pub kv_groups: usize,
}

/// Batch size of a decode-only step (one new token and one logits row per request).
fn decode_batch(step: &PackedStep) -> Option<usize> {
    let b = step.num_seqs();
    (b > 0 && step.num_tokens() == b && step.logits_indices.len() == b).then_some(b)
}

impl DecodeGraphs {
    pub fn new(dev: &CudaDevice, s: GraphShape) -> Result<Self> {
        Ok(Self {
            graphs: HashMap::new(),
            _workspace: Some(BlasWorkspace::set(dev)?),
            max_batch: s.max_batch.min(MAX_GRAPH_BATCH),
            scratch_block: s.scratch_block,
            state_scratch: s.state_scratch,
            block_size: s.block_size,
            width: s.max_seq_len.div_ceil(s.block_size),
            max_seq_len: s.max_seq_len,
            heads: s.heads,
            kv_groups: s.kv_groups,
            disabled: false,
        })
    }

    /// Runs `step` from its bucket's graph (capturing it on first use), drawing each row's
    /// token as `draws` says (greedy where it says nothing), and returns that graph, whose
    /// first `step.num_seqs()` rows are the step's; `None` when the step is not a decode-only
    /// step that fits.
    pub fn replay(
        &mut self,
        kernels: &Kernels,
        dev: &Device,
        step: &PackedStep,
        draws: DeviceDraws,
        forward: Launch,
    ) -> Result<Option<&DecodeGraph>> {
        let Some(b) = decode_batch(step) else {
            return Ok(None);
        };
        let too_wide = step.kv.iter().any(|kv| kv.max_blocks > self.width);
        // A graph moves no state between slots (a prompt's last token can look like a decode),
        // and keeps no hidden states for an MTP head (nor is one).
        if step.moves_state() || step.keep_hidden || !step.hidden_rows.is_empty() {
            return Ok(None);
        }
        if self.disabled || b > self.max_batch || too_wide || step.kv.len() != self.kv_groups {
            return Ok(None);
        }
        let bucket = b.next_power_of_two();
        if !self.graphs.contains_key(&bucket) {
            match self.capture(kernels, dev, bucket, forward) {
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
        let Device::Cuda(dev) = dev else {
            unreachable!("a CUDA device")
        };
        let stream = dev.cuda_stream();
        let scratch_slot = self.scratch_block * self.block_size as u32;
        let pad = |v: &[u32], fill: u32| -> Vec<u32> {
            let mut p = v.to_vec();
            p.resize(bucket, fill);
            p
        };
        let g = self.graphs.get_mut(&bucket).expect("captured above");
        copy_in(&stream, &g.inputs.ids, &pad(&step.input_ids, 0))?;
        copy_in(&stream, &g.inputs.positions, &pad(&step.positions, 0))?;
        for (kv, gi) in step.kv.iter().zip(&g.inputs.groups) {
            copy_in(&stream, &gi.slots, &pad(&kv.slot_mapping, scratch_slot))?;
            copy_table(&stream, &gi.block_tables, kv, b, self.width)?;
        }
        copy_in(&stream, &g.inputs.seq_lens_k, &pad(&step.seq_lens_k, 1))?;
        if let Some(scratch) = self.state_scratch {
            copy_in(
                &stream,
                &g.inputs.state_slots,
                &pad(&step.state_slots, scratch),
            )?;
        }
        let masked = draws.masks.map_or(&[][..], |m| m.rows);
        copy_in(&stream, &g.draws, &draw_params(draws.rows, bucket, masked))?;
        g.forward.launch()?;
        if let Some(m) = draws.masks {
            let n = b * g.words;
            (m.fill)(&mut g.staged.as_mut_slice()?[..n], g.words);
            // SAFETY: used on `stream` only; the guard records the copy's end, which the next
            // `as_mut_slice` waits for.
            let (src, _copied) = unsafe { g.staged.stream_synced_slice(&stream) };
            unsafe { result::memcpy_htod_async(ptr(&g.masks)?, &src[..n], stream.cu_stream()) }?;
        }
        g.draw.launch()?;
        Ok(Some(g))
    }

    fn capture(
        &self,
        kernels: &Kernels,
        dev: &Device,
        bucket: usize,
        forward: Launch,
    ) -> Result<DecodeGraph> {
        let Device::Cuda(cuda) = dev else {
            unreachable!("a CUDA device")
        };
        let (h, hkv, _) = self.heads;
        // Padding rows: one key, in the scratch block, at position 0.
        let mut table = vec![0u32; bucket * self.width];
        table
            .iter_mut()
            .step_by(self.width)
            .for_each(|t| *t = self.scratch_block);
        let tiles = attention_tiles(bucket, bucket, h / hkv);
        let scratch_slots = vec![self.scratch_block * self.block_size as u32; bucket];
        let groups = (0..self.kv_groups)
            .map(|_| {
                Ok(GroupInputs {
                    slots: u32s(&scratch_slots, dev)?,
                    block_tables: u32s(&table, dev)?,
                    max_blocks: self.width,
                })
            })
            .collect::<Result<_>>()?;
        let inputs = StepInputs {
            ids: u32s(&vec![0; bucket], dev)?,
            positions: u32s(&vec![0; bucket], dev)?,
            cu_seqlens_q: u32s(&(0..=bucket as u32).collect::<Vec<_>>(), dev)?,
            seq_lens_k: u32s(&vec![1; bucket], dev)?,
            rows: u32s(&(0..bucket as u32).collect::<Vec<_>>(), dev)?,
            state_slots: u32s(&vec![self.state_scratch.unwrap_or(0); bucket], dev)?,
            state_moves: None,
            groups,
            num_seqs: bucket,
            num_tokens: bucket,
            max_query_len: 1,
            max_seq_len: self.max_seq_len,
            splits: Some(kernels.splits(tiles * hkv, self.max_seq_len)),
        };
        let draws = u32s(&draw_params(&[], bucket, &[]), dev)?;
        // An eager run first, so every module is loaded outside the capture; it also measures
        // the outputs the graphs will carve from arenas.
        let (logits, sizes) = kernels.count_outputs(|| forward(&inputs))?;
        let words = mask_words(logits.dim(1)?);
        let masks = u32s(&vec![0; bucket * words], dev)?;
        let (_, draw_sizes) =
            kernels.count_outputs(|| kernels.sample_rows(&logits, &draws, Some(&masks)))?;
        drop(logits);
        // Small steps (the ones that gain from chained launches) carve their outputs from an
        // arena, larger ones let the graph allocate and free (memory reused inside the graph).
        let arena = (sizes.bytes() <= MAX_ARENA_BYTES)
            .then(|| Arena::new(sizes, kernels))
            .transpose()?;
        let stream = cuda.cuda_stream();
        let (forward_graph, logits) = capture_graph(&stream, || match &arena {
            Some(a) => kernels.carve_outputs(a, || forward(&inputs)),
            None => forward(&inputs),
        })?;
        let draw_arena = Arena::new(draw_sizes, kernels)?;
        let (draw, tokens) = capture_graph(&stream, || {
            kernels.carve_outputs(&draw_arena, || {
                kernels.sample_rows(&logits, &draws, Some(&masks))
            })
        })?;
        // SAFETY: written before each read (`replay` fills the rows it copies).
        let staged = unsafe { stream.context().alloc_pinned::<u32>(bucket * words)? };
        Ok(DecodeGraph {
            forward: forward_graph,
            draw,
            inputs,
            draws,
            masks,
            staged,
            words,
            logits,
            tokens,
            _arenas: (arena, draw_arena),
        })
    }
}

/// Captures what `run` launches on `stream` as a graph, and what it returned.
fn capture_graph<T>(
    stream: &Arc<CudaStream>,
    run: impl FnOnce() -> Result<T>,
) -> Result<(CudaGraph, T)> {
    stream.synchronize()?;
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    // Only ferrite's kernels and cuBLAS in here: candle's launches copy their shapes from
    // host memory, which a replay would read after it is gone.
    let out = run();
    // Always end the capture, so a failure leaves the stream usable.
    let graph = stream.end_capture(
        sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
    );
    let out = out?;
    let graph = graph?.context("the capture recorded nothing")?;
    graph.upload()?;
    Ok((graph, out))
}

/// Host to device into a fixed buffer, ordered on the stream.
fn copy_in(stream: &Arc<CudaStream>, dst: &Tensor, data: &[u32]) -> Result<()> {
    debug_assert_eq!(dst.dtype(), DType::U32);
    // SAFETY: `dst` is a live contiguous u32 buffer of at least `data.len()` elements; the
    // driver stages pageable host memory before returning, so `data` may go right after.
    unsafe { result::memcpy_htod_async(ptr(dst)?, data, stream.cu_stream()) }?;
    Ok(())
}

/// A group's `[B, max_blocks]` tables into the first B rows of the `[bucket, width]` table.
fn copy_table(
    stream: &Arc<CudaStream>,
    dst: &Tensor,
    kv: &KvTables,
    num_seqs: usize,
    width: usize,
) -> Result<()> {
    let row = kv.max_blocks * 4;
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        srcHost: kv.block_tables.as_ptr().cast(),
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
        Height: num_seqs,
    };
    // SAFETY: as in `copy_in`; the copy stays inside B rows of `width` u32 each.
    unsafe { sys::cuMemcpy2DAsync_v2(&p, stream.cu_stream()).result()? };
    Ok(())
}
