//! Decode and verify steps replayed from CUDA graphs. Launching a step's ~400 kernels one by
//! one costs the host about as much time as a small batch costs the GPU; a graph launches them
//! all at once. One graph per batch bucket (powers of two) and window (the most rows a
//! request has: 1 for a decode, 1 + k for a verify step of k drafts): a step is padded to its
//! bucket with requests that read their window's keys in a scratch block outside the
//! scheduler's pool, and each request to the window with rows after its own (causal: its
//! rows never see them) that write their K/V into that block. Everything a graph bakes in is fixed per bucket: input buffers at fixed
//! addresses (filled before each launch), block tables as wide as the longest request,
//! attention splits sized for the longest context, and cuBLAS's workspace. The draw (grammar
//! masks, sampling) is a second graph, so the host makes the masks while the forward runs.

use super::inputs::{u32s, GroupInputs, StepInputs};
use super::kernels::attention::attention_tiles;
use super::kernels::sample::{draw_params, mask_words};
use super::kernels::{ptr, Arena, Kernels};
use crate::step::{DeviceDraws, RowDraw};
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

/// Most rows (requests x window) of a verify step replayed from a graph: verify steps of
/// a few requests, where launching kernels one by one costs what the GPU work does
/// (speculation pauses above a few requests by default).
pub const MAX_WINDOW_ROWS: usize = 64;

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
    logits: Tensor,
    /// `[bucket]` u32 tokens drawn from `logits`.
    tokens: Tensor,
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
    /// By (batch bucket, window).
    graphs: HashMap<(usize, usize), DecodeGraph>,
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

/// A step laid out in a graph's rows: row `j` of request `i` at `i * w + j`, `b` requests
/// padded to `bucket`.
struct Rows<'a> {
    step: &'a PackedStep,
    b: usize,
    w: usize,
    bucket: usize,
}

impl Rows<'_> {
    fn q_len(&self, i: usize) -> usize {
        (self.step.cu_seqlens_q[i + 1] - self.step.cu_seqlens_q[i]) as usize
    }

    /// Keys request `i` reads: a whole window of them, its padding rows' included.
    fn keys(&self, i: usize) -> usize {
        self.step.seq_lens_k[i] as usize + self.w - self.q_len(i)
    }

    /// `v`'s rows placed; rows past a request's own take `fill`, or repeat the request's
    /// last row's value.
    fn place(&self, v: &[u32], fill: Option<u32>) -> Vec<u32> {
        let (step, w) = (self.step, self.w);
        let mut p = vec![fill.unwrap_or(0); self.bucket * w];
        for i in 0..self.b {
            let rows = &v[step.cu_seqlens_q[i] as usize..step.cu_seqlens_q[i + 1] as usize];
            let out = &mut p[i * w..(i + 1) * w];
            out[..rows.len()].copy_from_slice(rows);
            if fill.is_none() {
                out[rows.len()..].fill(rows[rows.len() - 1]);
            }
        }
        p
    }

    /// The step's ids, positions, slots, block tables, key lengths and state slots into
    /// the graph's inputs.
    fn copy_inputs(
        &self,
        stream: &Arc<CudaStream>,
        inputs: &StepInputs,
        scratch_slot: u32,
        width: usize,
        state_scratch: Option<u32>,
    ) -> Result<()> {
        let step = self.step;
        copy_in(stream, &inputs.ids, &self.place(&step.input_ids, Some(0)))?;
        // Padding rows' positions stay inside the rotary tables.
        copy_in(
            stream,
            &inputs.positions,
            &self.place(&step.positions, None),
        )?;
        for (kv, gi) in step.kv.iter().zip(&inputs.groups) {
            let slots = self.place(&kv.slot_mapping, Some(scratch_slot));
            copy_in(stream, &gi.slots, &slots)?;
            copy_table(stream, &gi.block_tables, kv, self.b, width)?;
        }
        let mut seq_lens: Vec<u32> = (0..self.b).map(|i| self.keys(i) as u32).collect();
        seq_lens.resize(self.bucket, self.w as u32);
        copy_in(stream, &inputs.seq_lens_k, &seq_lens)?;
        if let Some(scratch) = state_scratch {
            // One slot per request (decodes only: a window graph has no state).
            let mut slots = step.state.slots.clone();
            slots.resize(self.bucket, scratch);
            copy_in(stream, &inputs.state_slots, &slots)?;
        }
        Ok(())
    }

    /// Each graph row's draw parameters (a verify window's padding rows greedy).
    fn draw_params(&self, draws: &DeviceDraws) -> Vec<u32> {
        let (step, w) = (self.step, self.w);
        if w == 1 {
            let masked = draws.masks.map_or(&[][..], |m| m.rows);
            return draw_params(draws.rows, self.bucket, masked);
        }
        let mut rows = vec![RowDraw::Greedy; self.bucket * w];
        for (row, &d) in draws.rows.iter().enumerate() {
            let i = step.cu_seqlens_q.partition_point(|&c| c as usize <= row) - 1;
            rows[i * w + row - step.cu_seqlens_q[i] as usize] = d;
        }
        draw_params(&rows, self.bucket * w, &[])
    }
}

/// Requests and window (the most rows one has) of a step every row of which makes logits,
/// in order: decodes (window 1) and verify steps (1 + the longest draft).
fn window_shape(step: &PackedStep) -> Option<(usize, usize)> {
    let b = step.num_seqs();
    let all_rows = step.logits_indices.len() == step.num_tokens()
        && step
            .logits_indices
            .iter()
            .enumerate()
            .all(|(i, &r)| r as usize == i);
    let w = step.cu_seqlens_q.windows(2).map(|c| c[1] - c[0]).max()?;
    (b > 0 && all_rows).then_some((b, w as usize))
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

    /// Graphs captured for steps of `window` rows per request.
    pub fn captured(&self, window: usize) -> usize {
        self.graphs.keys().filter(|&&(_, w)| w == window).count()
    }

    /// Runs `step` from its (bucket, window) graph (capturing it on first use), drawing each
    /// row's token as `draws` says (greedy where it says nothing), and returns the step's
    /// logits and tokens; `None` when the step is not a decode or verify step that fits.
    pub fn replay(
        &mut self,
        kernels: &Kernels,
        dev: &Device,
        step: &PackedStep,
        draws: DeviceDraws,
        forward: Launch,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let Some((b, w)) = self.graph_shape(step, &draws) else {
            return Ok(None);
        };
        let bucket = b.next_power_of_two();
        if !self.graphs.contains_key(&(bucket, w)) {
            match self.capture(kernels, dev, bucket, w, forward) {
                Ok(g) => {
                    self.graphs.insert((bucket, w), g);
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
        let Device::Cuda(cuda) = dev else {
            unreachable!("a CUDA device")
        };
        let stream = cuda.cuda_stream();
        let rows = Rows { step, b, w, bucket };
        let scratch_slot = self.scratch_block * self.block_size as u32;
        let (width, state_scratch) = (self.width, self.state_scratch);
        let g = self.graphs.get_mut(&(bucket, w)).expect("captured above");
        rows.copy_inputs(&stream, &g.inputs, scratch_slot, width, state_scratch)?;
        copy_in(&stream, &g.draws, &rows.draw_params(&draws))?;
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
        if w == 1 {
            return Ok(Some((g.logits.narrow(0, 0, b)?, g.tokens.narrow(0, 0, b)?)));
        }
        let real: Vec<u32> = (0..b)
            .flat_map(|i| (0..rows.q_len(i) as u32).map(move |j| (i * w) as u32 + j))
            .collect();
        let real = u32s(&real, dev)?;
        Ok(Some((
            g.logits.index_select(&real, 0)?,
            g.tokens.index_select(&real, 0)?,
        )))
    }

    /// The step's (requests, window) when a graph can run it: a decode or verify step that
    /// moves no state, keeps no hidden rows, and fits the graphs' batch and block tables.
    fn graph_shape(&self, step: &PackedStep, draws: &DeviceDraws) -> Option<(usize, usize)> {
        let (b, w) = window_shape(step)?;
        let rows = Rows {
            step,
            b,
            w,
            bucket: b.next_power_of_two(),
        };
        let too_wide = step.kv.iter().any(|kv| kv.max_blocks > self.width)
            || (0..b).any(|i| rows.keys(i) > self.width * self.block_size);
        // A graph moves no state between slots (a prompt's last token can look like a decode),
        // and keeps no hidden states for an MTP head (nor is one).
        if step.moves_state() || step.hidden.keep || !step.hidden.rows.is_empty() {
            return None;
        }
        if self.disabled || b > self.max_batch || too_wide || step.kv.len() != self.kv_groups {
            return None;
        }
        // Verify windows: grammar masks are written row by row in the step's order, and a
        // recurrent state steps once per request.
        if w > 1
            && (rows.bucket * w > MAX_WINDOW_ROWS
                || draws.masks.is_some()
                || self.state_scratch.is_some())
        {
            return None;
        }
        Some((b, w))
    }

    fn capture(
        &self,
        kernels: &Kernels,
        dev: &Device,
        bucket: usize,
        w: usize,
        forward: Launch,
    ) -> Result<DecodeGraph> {
        let Device::Cuda(cuda) = dev else {
            unreachable!("a CUDA device")
        };
        let (h, hkv, _) = self.heads;
        let rows = bucket * w;
        // Padding requests: a window of keys from the scratch block, at position 0.
        let mut table = vec![0u32; bucket * self.width];
        for t in table.chunks_mut(self.width) {
            t[..w.div_ceil(self.block_size)].fill(self.scratch_block);
        }
        // Attention splits as for the bucket's decode step, whatever the window: a request's
        // rows then sum the same key splits whether it decodes or verifies drafts.
        let tiles = attention_tiles(bucket, bucket, h / hkv);
        let scratch_slots = vec![self.scratch_block * self.block_size as u32; rows];
        let groups = (0..self.kv_groups)
            .map(|_| {
                Ok(GroupInputs {
                    slots: u32s(&scratch_slots, dev)?,
                    block_tables: u32s(&table, dev)?,
                    max_blocks: self.width,
                })
            })
            .collect::<Result<_>>()?;
        let cu_seqlens_q: Vec<u32> = (0..=bucket).map(|i| (i * w) as u32).collect();
        let inputs = StepInputs {
            ids: u32s(&vec![0; rows], dev)?,
            positions: u32s(&vec![0; rows], dev)?,
            cu_seqlens_q: u32s(&cu_seqlens_q, dev)?,
            seq_lens_k: u32s(&vec![w as u32; bucket], dev)?,
            rows: u32s(&(0..rows as u32).collect::<Vec<_>>(), dev)?,
            state_slots: u32s(&vec![self.state_scratch.unwrap_or(0); bucket], dev)?,
            state_moves: None,
            groups,
            num_seqs: bucket,
            num_tokens: rows,
            max_query_len: w,
            max_seq_len: self.max_seq_len,
            splits: Some(kernels.splits(tiles * hkv, self.max_seq_len)),
        };
        let draws = u32s(&draw_params(&[], rows, &[]), dev)?;
        // An eager run first, so every module is loaded outside the capture; it also measures
        // the outputs the graphs will carve from arenas.
        let (logits, sizes) = kernels.count_outputs(|| forward(&inputs))?;
        let words = mask_words(logits.dim(1)?);
        let masks = u32s(&vec![0; rows * words], dev)?;
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
        let staged = unsafe { stream.context().alloc_pinned::<u32>(rows * words)? };
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
