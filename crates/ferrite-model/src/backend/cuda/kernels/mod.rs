//! Launches of ferrite's own CUDA kernels (`kernels/ferrite.cu`), on candle tensors: each
//! wrapper checks shapes, allocates its output on the device's stream and launches once.
//! One file per op family: matmuls, attention (with the Q/K/V preparation), sampling, and
//! the small kernels in between (here).

pub mod attention;
pub mod gdn;
mod load;
pub mod matmul;
pub mod moe;
pub mod sample;

use crate::backend::Activation;
use anyhow::{bail, ensure, Context, Result};
use candle_core::cuda::cudarc::driver::{
    CudaFunction, CudaModule, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Shape, Storage, Tensor};
use half::bf16;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};

pub struct Kernels {
    dev: CudaDevice,
    _module: Arc<CudaModule>,
    embed: CudaFunction,
    rms_norm: CudaFunction,
    rms_norm_f32: CudaFunction,
    add_rms_norm: CudaFunction,
    gated_mul: CudaFunction,
    add_f32: CudaFunction,
    softcap: CudaFunction,
    /// For 1 to [`matmul::GEMV_MAX_ROWS`] rows.
    gemv: Vec<CudaFunction>,
    /// Blocks of `gemv[r - 1]` per multiprocessor with `k`-wide rows, by (r, k): asked of the
    /// driver once per shape, not at every launch.
    gemv_occupancy: Mutex<HashMap<(usize, usize), u32>>,
    /// The most rows the fused matmuls take in the current step (see
    /// [`Kernels::set_fused_rows`]).
    fused_rows: AtomicUsize,
    /// Tiles of up to 16, 64 and 128 rows ([`matmul::GEMM_INVARIANT_ROWS`]), each with the
    /// threads of its block (its `__launch_bounds__`).
    gemm_invariant: [(CudaFunction, u32); 3],
    /// Every matmul through `gemm_invariant` and attention split at a fixed width, so a row
    /// gets the same bits in a step of any size (`--batch-invariant`).
    batch_invariant: AtomicBool,
    /// By KV dtype ([`attention::KvPages::variant`]).
    qkv_rope_write: [CudaFunction; 3],
    /// Head sizes 32, 64, 128 and 256, each by KV dtype.
    attention_mma: [[CudaFunction; 3]; 4],
    merge_splits: CudaFunction,
    moe_route: CudaFunction,
    moe_align: CudaFunction,
    /// Tiles of 16 and of 64 rows.
    moe_gate_up: [CudaFunction; 2],
    moe_down: [CudaFunction; 2],
    moe_combine: CudaFunction,
    gdn_state_restore: CudaFunction,
    gdn_conv: CudaFunction,
    gdn_conv_window: CudaFunction,
    /// For key heads of 16, 32, 64 and 128 ([`gdn::RULE_KEY_DIMS`]).
    gdn_rule: [CudaFunction; 4],
    /// The rule's chunk-parallel form, for steps with prefill chunks, same key head sizes.
    gdn_chunked: [CudaFunction; 4],
    gdn_gated_norm: CudaFunction,
    gate_sigmoid: CudaFunction,
    moe_gemv_gate_up: CudaFunction,
    moe_gemv_down: CudaFunction,
    sample_rows: CudaFunction,
    mask_rows: CudaFunction,
    multiprocessors: u32,
    /// Whether [`Kernels::launch_chained`] launches programmatically dependent (sm_90 and up,
    /// unless `FERRITE_CUDA_CHAINED=0`).
    chained: bool,
    /// Where [`Kernels::output`] takes its tensors from.
    outputs: Mutex<Outputs>,
}

/// How outputs are made: allocated on the stream (the default), allocated while their sizes
/// are summed, or carved in order out of an [`Arena`].
enum Outputs {
    Allocate,
    Count(OutputSizes),
    Carve(Arena, [usize; 3]),
}

/// Elements a run of kernels allocated, by dtype (bf16, f32, u32), each output padded.
#[derive(Clone, Copy, Default)]
pub struct OutputSizes([usize; 3]);

impl OutputSizes {
    pub fn bytes(&self) -> usize {
        2 * self.0[0] + 4 * (self.0[1] + self.0[2])
    }
}

/// Fixed buffers a captured graph's outputs are carved from, kept as long as the graph: no
/// allocation or free in the graph between two kernels, so consecutive kernels keep the
/// programmatic edge of a chained launch (a memory node between them would serialize them).
#[derive(Clone)]
pub struct Arena {
    bufs: [Tensor; 3],
}

impl Arena {
    const DTYPES: [DType; 3] = [DType::BF16, DType::F32, DType::U32];

    pub fn new(sizes: OutputSizes, kernels: &Kernels) -> Result<Self> {
        let buf = |i: usize| kernels.allocate(sizes.0[i].max(1), Self::DTYPES[i]);
        Ok(Self {
            bufs: [buf(0)?, buf(1)?, buf(2)?],
        })
    }

    fn index(dtype: DType) -> Result<usize> {
        Self::DTYPES
            .iter()
            .position(|&d| d == dtype)
            .with_context(|| format!("no kernel writes {dtype:?}"))
    }

    /// Every output starts 256 bytes aligned, as an allocation would, for the kernels'
    /// 16-byte loads.
    fn padded(n: usize) -> usize {
        n.next_multiple_of(64)
    }
}

/// Device address of a contiguous tensor's first element.
pub fn ptr(t: &Tensor) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        bail!("tensor is not on a CUDA device")
    };
    let (start, _) = layout
        .contiguous_offsets()
        .context("kernel input must be contiguous")?;
    let stream = s.device.cuda_stream();
    let base = match t.dtype() {
        DType::BF16 => s.as_cuda_slice::<bf16>()?.device_ptr(&stream).0,
        DType::F32 => s.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::U32 => s.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        DType::U8 => s.as_cuda_slice::<u8>()?.device_ptr(&stream).0,
        d => bail!("no kernel takes {d:?}"),
    };
    Ok(base + (start * t.dtype().size_in_bytes()) as u64)
}

fn cfg(grid: (u32, u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// The kernels' code of an activation (`ACT_*` in elementwise.cuh).
fn act_code(a: Activation) -> i32 {
    match a {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
    }
}

impl Kernels {
    /// An uninitialized tensor of `shape`; every kernel writes all of its output.
    fn output(&self, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        let shape = shape.into();
        let n = shape.elem_count();
        match &mut *self.outputs.lock().unwrap() {
            Outputs::Allocate => {}
            Outputs::Count(sizes) => sizes.0[Arena::index(dtype)?] += Arena::padded(n),
            Outputs::Carve(arena, used) => {
                let i = Arena::index(dtype)?;
                let view = arena.bufs[i].narrow(0, used[i], n)?.reshape(shape)?;
                used[i] += Arena::padded(n);
                return Ok(view);
            }
        }
        self.allocate(shape, dtype)
    }

    /// A fresh tensor on the stream, uninitialized.
    fn allocate(&self, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        let shape = shape.into();
        let n = shape.elem_count();
        // SAFETY: callers write every element before anything reads it.
        let storage = unsafe {
            match dtype {
                DType::BF16 => {
                    CudaStorage::wrap_cuda_slice(self.dev.alloc::<bf16>(n)?, self.dev.clone())
                }
                DType::F32 => {
                    CudaStorage::wrap_cuda_slice(self.dev.alloc::<f32>(n)?, self.dev.clone())
                }
                DType::U32 => {
                    CudaStorage::wrap_cuda_slice(self.dev.alloc::<u32>(n)?, self.dev.clone())
                }
                d => bail!("no kernel writes {d:?}"),
            }
        };
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            shape,
            BackpropOp::none(),
            false,
        ))
    }

    fn launch(&self, f: &CudaFunction, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        let stream = self.dev.cuda_stream();
        let mut b = stream.launch_builder(f);
        for a in args {
            match a {
                Arg::P(p) => b.arg(p),
                Arg::I(i) => b.arg(i),
                Arg::F(x) => b.arg(x),
                Arg::Z(z) => b.arg(z),
            };
        }
        // SAFETY: argument lists match the kernels' signatures in ferrite.cu.
        unsafe { b.launch(cfg) }.context("kernel launch")?;
        Ok(())
    }

    /// Runs `f`, its outputs allocated as usual, and sums their sizes.
    pub fn count_outputs<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<(T, OutputSizes)> {
        *self.outputs.lock().unwrap() = Outputs::Count(OutputSizes::default());
        let r = f();
        let Outputs::Count(sizes) =
            std::mem::replace(&mut *self.outputs.lock().unwrap(), Outputs::Allocate)
        else {
            unreachable!("set above")
        };
        Ok((r?, sizes))
    }

    /// Runs `f` with its outputs carved out of `arena` in order (a run making the same outputs
    /// as the one `count_outputs` measured for it).
    pub fn carve_outputs<T>(&self, arena: &Arena, f: impl FnOnce() -> Result<T>) -> Result<T> {
        *self.outputs.lock().unwrap() = Outputs::Carve(arena.clone(), [0; 3]);
        let r = f();
        *self.outputs.lock().unwrap() = Outputs::Allocate;
        r
    }

    /// Launches a kernel that calls `wait_for_previous_kernel()` (common.cuh) before it touches
    /// what earlier kernels wrote, as a programmatic dependent launch: it may start while the
    /// kernel before it finishes, hiding its launch (and, for the matmuls, the first weight
    /// loads) behind that kernel's tail. Inside graph capture this becomes a programmatic edge.
    fn launch_chained(&self, f: &CudaFunction, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        use candle_core::cuda::cudarc::driver::sys;
        if !self.chained {
            return self.launch(f, cfg, args);
        }
        let mut values: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut v = [0u8; 8];
                match a {
                    Arg::P(p) => v.copy_from_slice(&p.to_ne_bytes()),
                    Arg::I(i) => v[..4].copy_from_slice(&i.to_ne_bytes()),
                    Arg::F(x) => v[..4].copy_from_slice(&x.to_ne_bytes()),
                    Arg::Z(z) => v.copy_from_slice(&(*z as u64).to_ne_bytes()),
                }
                v
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> =
            values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        // SAFETY: a zeroed union is a valid value; the field set is the one `id` names.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.dev.cuda_stream().cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: every argument is passed by address as the kernel's parameter of the same
        // size (pointers and size_t as 8 bytes, int and float as 4), matching ferrite.cu;
        // `values`, `params` and `attr` outlive the call, which copies them.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .context("kernel launch")?;
        Ok(())
    }

    /// `x += d`, both f32 of the same shape.
    fn add_into(&self, x: &Tensor, d: &Tensor) -> Result<()> {
        ensure!(
            x.dims() == d.dims(),
            "adding {:?} into {:?}",
            d.dims(),
            x.dims()
        );
        let n = x.elem_count();
        if n > 0 {
            self.launch(
                &self.add_f32,
                cfg((n.div_ceil(256) as u32, 1, 1), 256, 0),
                &[Arg::P(ptr(x)?), Arg::P(ptr(d)?), Arg::Z(n)],
            )?;
        }
        Ok(())
    }

    /// `[T]` ids into `[vocab, hidden]` bf16 rows times `scale`, widened to an f32 `[T, hidden]`.
    /// Rows `ids - first` of `table` (a vocabulary shard from token `first` on) times `scale`,
    /// f32 `[T, hidden]`; zeros for tokens outside the shard.
    pub fn embed(&self, ids: &Tensor, table: &Tensor, first: usize, scale: f32) -> Result<Tensor> {
        let t = ids.dim(0)?;
        let (rows, hidden) = table.dims2()?;
        let x = self.output((t, hidden), DType::F32)?;
        if t > 0 {
            self.launch(
                &self.embed,
                cfg((t as u32, 1, 1), 256, 0),
                &[
                    Arg::P(ptr(ids)?),
                    Arg::P(ptr(table)?),
                    Arg::P(ptr(&x)?),
                    Arg::I(hidden as i32),
                    Arg::F(scale),
                    Arg::I(first as i32),
                    Arg::I(rows as i32),
                ],
            )?;
        }
        Ok(x)
    }

    /// RMSNorm of the f32 residual stream into `dtype` (bf16, or f32: a residual stream of
    /// its own); with `rows`, only those rows of `x`, in that order.
    pub fn rms_norm(
        &self,
        x: &Tensor,
        rows: Option<&Tensor>,
        weight: &Tensor,
        eps: f32,
        dtype: DType,
    ) -> Result<Tensor> {
        let (t, hidden) = x.dims2()?;
        let n = rows.map_or(Ok(t), |r| r.dim(0))?;
        let out = self.output((n, hidden), dtype)?;
        let f = match dtype {
            DType::F32 => &self.rms_norm_f32,
            _ => &self.rms_norm,
        };
        if n > 0 {
            self.launch(
                f,
                cfg((n as u32, 1, 1), 256, 0),
                &[
                    Arg::P(ptr(x)?),
                    opt(rows)?,
                    Arg::P(ptr(weight)?),
                    Arg::P(ptr(&out)?),
                    Arg::I(hidden as i32),
                    Arg::F(eps),
                ],
            )?;
        }
        Ok(out)
    }

    /// `x += rms_norm(y) * w` on the f32 residual stream, `y` f32 of the same shape.
    pub fn add_rms_norm(&self, x: &Tensor, y: &Tensor, w: &Tensor, eps: f32) -> Result<()> {
        let (t, hidden) = x.dims2()?;
        ensure!(
            y.dims2()? == (t, hidden),
            "adding {:?} into {:?}",
            y.dims(),
            x.dims()
        );
        if t > 0 {
            self.launch(
                &self.add_rms_norm,
                cfg((t as u32, 1, 1), 256, 0),
                &[
                    Arg::P(ptr(x)?),
                    Arg::P(ptr(y)?),
                    Arg::P(ptr(w)?),
                    Arg::I(hidden as i32),
                    Arg::F(eps),
                ],
            )?;
        }
        Ok(())
    }

    /// `[T, 2I]` interleaved gate|up into `act(gate) * up`, `out [T, I]`.
    fn gated_mul_into(&self, gate_up: &Tensor, out: &Tensor, act: Activation) -> Result<()> {
        let (t, two_i) = gate_up.dims2()?;
        ensure!(
            out.dims2()? == (t, two_i / 2),
            "gated mul of {:?}",
            gate_up.dims()
        );
        let n = t * two_i / 2;
        if n > 0 {
            self.launch(
                &self.gated_mul,
                cfg((n.div_ceil(256) as u32, 1, 1), 256, 0),
                &[
                    Arg::P(ptr(gate_up)?),
                    Arg::P(ptr(out)?),
                    Arg::Z(n),
                    Arg::I(act_code(act)),
                ],
            )?;
        }
        Ok(())
    }

    /// `x = cap * tanh(x / cap)` in place, f32.
    pub fn softcap(&self, x: &Tensor, cap: f32) -> Result<()> {
        let n = x.elem_count();
        if n > 0 {
            self.launch(
                &self.softcap,
                cfg((n.div_ceil(256) as u32, 1, 1), 256, 0),
                &[Arg::P(ptr(x)?), Arg::Z(n), Arg::F(cap)],
            )?;
        }
        Ok(())
    }
}

/// A kernel argument: device pointer, int, float or size.
enum Arg {
    P(u64),
    I(i32),
    F(f32),
    Z(usize),
}

/// An optional input: its address or a null pointer.
fn opt(t: Option<&Tensor>) -> Result<Arg> {
    Ok(Arg::P(t.map(ptr).transpose()?.unwrap_or(0)))
}
