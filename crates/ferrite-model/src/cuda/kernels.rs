//! Launches of ferrite's own CUDA kernels (`kernels/ferrite.cu`), on candle tensors: each
//! wrapper checks shapes, allocates its output on the device's stream and launches once.

use super::weights::Linear;
use crate::runner::RowDraw;
use anyhow::{bail, ensure, Context, Result};
use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda::cudarc::driver::{
    CudaFunction, CudaModule, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda::cudarc::nvrtc::Ptx;
use candle_core::op::BackpropOp;
use candle_core::quantized::QTensor;
use candle_core::{CudaDevice, CudaStorage, DType, Shape, Storage, Tensor};
use half::bf16;
use std::collections::hash_map::{Entry, HashMap};
use std::sync::{Arc, Mutex};

/// sm_80 and sm_90 machine code plus sm_90 PTX, built by `build.rs`.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ferrite.fatbin"));

const ATTENTION_THREADS: u32 = 128;
/// Query rows (tokens x heads of one KV head) per program of the CUDA-core attention kernel
/// (its `ROWS`) and of the tensor-core one (`MMA_ROWS`).
pub const ATTENTION_ROWS: usize = 16;
const MMA_ROWS: usize = 64;
/// Steps of up to this many rows (decodes of one or two requests) get the fused one-warp-per-
/// column matmuls (`gemv_r*_bf16`); larger ones cuBLAS.
pub const GEMV_MAX_ROWS: usize = 2;
/// The `__launch_bounds__` of `gemv_r*_bf16`.
const GEMV_THREADS: u32 = 512;
/// Shared memory the fused matmuls may take for their input rows.
const GEMV_MAX_SHARED: usize = 160 * 1024;

pub struct Kernels {
    dev: CudaDevice,
    _module: Arc<CudaModule>,
    embed: CudaFunction,
    rms_norm: CudaFunction,
    silu_mul: CudaFunction,
    add_f32: CudaFunction,
    /// For 1 and 2 rows.
    gemv: [CudaFunction; 2],
    /// Blocks of `gemv[r - 1]` per multiprocessor with `k`-wide rows, by (r, k): asked of the
    /// driver once per shape, not at every launch.
    gemv_occupancy: Mutex<HashMap<(usize, usize), u32>>,
    qkv_rope_write: CudaFunction,
    /// Head size 256 on CUDA cores; 64 and 128 on tensor cores.
    attention: CudaFunction,
    attention_mma: [CudaFunction; 2],
    merge_splits: CudaFunction,
    sample_rows: CudaFunction,
    multiprocessors: u32,
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

/// Paged varlen attention inputs of one step, already on the device.
pub struct AttentionMeta<'a> {
    /// `[B + 1]` u32
    pub cu_seqlens_q: &'a Tensor,
    /// `[B]` u32
    pub seq_lens_k: &'a Tensor,
    /// `[B, max_blocks]` u32
    pub block_tables: &'a Tensor,
    pub max_blocks: usize,
    pub num_seqs: usize,
    pub num_tokens: usize,
    /// Longest K/V length in the step (sizes the split of long decodes).
    pub max_seq_len: usize,
    /// Splits of each key range, when fixed by the caller (a captured graph must not
    /// depend on the step's lengths); `None`: chosen from the shape.
    pub splits: Option<usize>,
}

pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub scale: f32,
    /// 0: none.
    pub sliding_window: usize,
    /// 0: none.
    pub softcap: f32,
}

/// The rotary, bias and per-head norm options of [`Kernels::qkv_rope_write`].
pub struct QkvParams<'a> {
    pub bias: Option<&'a Tensor>,
    pub q_norm: Option<&'a Tensor>,
    pub k_norm: Option<&'a Tensor>,
    pub eps: f32,
    pub rope_cos: &'a Tensor,
    pub rope_sin: &'a Tensor,
    pub rope_dim: usize,
    pub neox: bool,
}

impl Kernels {
    pub fn load(dev: &CudaDevice) -> Result<Self> {
        let stream = dev.cuda_stream();
        let module = stream
            .context()
            .load_module(Ptx::from_binary(FATBIN.to_vec()))
            .context(
                "loading ferrite's CUDA kernels (no sm_80/sm_90 code or PTX this driver takes)",
            )?;
        let f = |name: &str| {
            module
                .load_function(name)
                .with_context(|| format!("kernel {name}"))
        };
        let gemv = [f("gemv_r1_bf16")?, f("gemv_r2_bf16")?];
        for g in &gemv {
            g.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                GEMV_MAX_SHARED as i32,
            )?;
        }
        let multiprocessors = stream.context().attribute(
            candle_core::cuda::cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        Ok(Self {
            dev: dev.clone(),
            embed: f("embed_bf16")?,
            rms_norm: f("rms_norm_bf16")?,
            silu_mul: f("silu_mul_bf16")?,
            add_f32: f("add_f32")?,
            gemv,
            gemv_occupancy: Mutex::default(),
            qkv_rope_write: f("qkv_rope_write_bf16")?,
            attention: f("paged_attention_d256_bf16")?,
            attention_mma: [
                f("paged_attention_mma_d64_bf16")?,
                f("paged_attention_mma_d128_bf16")?,
            ],
            merge_splits: f("merge_splits_bf16")?,
            sample_rows: f("sample_rows_f32")?,
            multiprocessors,
            _module: module,
        })
    }

    /// An uninitialized tensor of `shape`; every kernel writes all of its output.
    fn output(&self, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        let shape = shape.into();
        let n = shape.elem_count();
        // SAFETY: the launching kernel writes every element before anything reads it.
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

    /// `x [R, k] @ w [n, k]^T` into `[R, n]` of `out_dtype` (bf16 or f32), bf16 operands
    /// and f32 accumulation, one cublasGemmEx call. The LM head asks for f32: logits rounded
    /// to bf16 would lose near-ties.
    pub fn matmul_nt(&self, x: &Tensor, w: &Tensor, out_dtype: DType) -> Result<Tensor> {
        let out = self.output((x.dim(0)?, w.dim(0)?), out_dtype)?;
        self.gemm(x, w, &out, 0.0)?;
        Ok(out)
    }

    /// `out = x @ w^T + beta * out`, `out` bf16 or f32 `[R, n]`.
    fn gemm(&self, x: &Tensor, w: &Tensor, out: &Tensor, beta: f32) -> Result<()> {
        use candle_core::cuda::cudarc::cublas::{result::gemm_ex, sys};
        let (r, k) = x.dims2()?;
        let (n, k2) = w.dims2()?;
        ensure!(
            k == k2 && out.dims2()? == (r, n),
            "matmul of [{r}, {k}] by [{n}, {k2}]^T into {:?}",
            out.dims()
        );
        let out_type = match out.dtype() {
            DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
            _ => sys::cudaDataType::CUDA_R_32F,
        };
        if r == 0 {
            return Ok(());
        }
        let alpha = 1f32;
        let blas = self.dev.cublas_handle();
        // Column-major view: out^T [n, r] = w [k, n]^T x^T [k, r].
        // SAFETY: pointers come from live contiguous tensors of the shapes checked above.
        unsafe {
            gemm_ex(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                r as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                ptr(w)? as *const _,
                sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                ptr(x)? as *const _,
                sys::cudaDataType::CUDA_R_16BF,
                k as i32,
                (&beta as *const f32).cast(),
                ptr(out)? as *mut _,
                out_type,
                n as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .context("cublasGemmEx")?;
        Ok(())
    }

    /// `input @ w^T` into a new `[R, n]` tensor of `dtype` (bf16, or f32 for logits).
    pub fn matmul(&self, input: MatIn, w: &Linear, dtype: DType) -> Result<Tensor> {
        let w = match w {
            Linear::Quant(q) => return Ok(self.quant_matmul(input, q)?.to_dtype(dtype)?),
            Linear::Dense(w) => w,
        };
        let out = self.output((input.rows()?, w.dim(0)?), dtype)?;
        let mode = match dtype {
            DType::BF16 => GEMV_OUT_BF16,
            _ => GEMV_OUT_F32,
        };
        if !self.gemv(&input, w, &out, mode)? {
            self.gemm(&self.materialize(input)?, w, &out, 0.0)?;
        }
        Ok(out)
    }

    /// `silu(gate) * up` of `input @ w^T`, `[R, I]` bf16, for gate|up weights `[2I, k]` whose
    /// rows alternate gate, up (see [`super::weights::interleave_gate_up`]).
    pub fn matmul_silu(&self, input: MatIn, w: &Linear) -> Result<Tensor> {
        let out = self.output((input.rows()?, w.dims()?.0 / 2), DType::BF16)?;
        let gate_up = match w {
            Linear::Quant(q) => self.quant_matmul(input, q)?.to_dtype(DType::BF16)?,
            Linear::Dense(w) => {
                if self.gemv(&input, w, &out, GEMV_OUT_SILU)? {
                    return Ok(out);
                }
                let gate_up = self.output((input.rows()?, w.dim(0)?), DType::BF16)?;
                self.gemm(&self.materialize(input)?, w, &gate_up, 0.0)?;
                gate_up
            }
        };
        self.silu_mul_into(&gate_up, &out)?;
        Ok(out)
    }

    /// `x += input @ w^T` on the f32 residual stream `x [R, n]` (the residual add folded
    /// into the matmul).
    pub fn matmul_add(&self, input: MatIn, w: &Linear, x: &Tensor) -> Result<()> {
        match w {
            Linear::Quant(q) => self.add_into(x, &self.quant_matmul(input, q)?),
            Linear::Dense(w) => {
                if !self.gemv(&input, w, x, GEMV_OUT_ADD)? {
                    self.gemm(&self.materialize(input)?, w, x, 1.0)?;
                }
                Ok(())
            }
        }
    }

    /// candle's quantized CUDA matmul (its MMVQ kernels up to 8 rows, MMQ or dequantize +
    /// matmul beyond) on the input rows in f32, `[R, n]` f32 out.
    fn quant_matmul(&self, input: MatIn, q: &QTensor) -> Result<Tensor> {
        let a = self.materialize(input)?.to_dtype(DType::F32)?;
        Ok(a.apply_op1_no_bwd(q)?)
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

    /// The fused small-row matmul into `out`, when the step is small enough; false otherwise.
    fn gemv(&self, input: &MatIn, w: &Tensor, out: &Tensor, out_mode: i32) -> Result<bool> {
        let r = input.rows()?;
        let (n, k) = w.dims2()?;
        let shared = GEMV_MAX_ROWS * k * 2;
        if r == 0 || r > GEMV_MAX_ROWS || k % 8 != 0 || shared > GEMV_MAX_SHARED {
            return Ok(false);
        }
        let (in_mode, src, rows, norm, eps) = match input {
            MatIn::Bf16(a) => (GEMV_IN_BF16, *a, None, None, 0.0),
            MatIn::Rms { x, rows, norm, eps } => (GEMV_IN_RMS, *x, *rows, Some(*norm), *eps),
        };
        let out_cols = if out_mode == GEMV_OUT_SILU { n / 2 } else { n };
        ensure!(
            src.dim(1)? == k && out.dims2()? == (r, out_cols),
            "matmul input {:?} for weights [{n}, {k}] into {:?}",
            src.dims(),
            out.dims()
        );
        let f = &self.gemv[r - 1];
        let shared = (r * k * 2) as u32;
        let per_sm = match self.gemv_occupancy.lock().unwrap().entry((r, k)) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => *e.insert(
                f.occupancy_max_active_blocks_per_multiprocessor(
                    GEMV_THREADS,
                    shared as usize,
                    None,
                )?
                .max(1),
            ),
        };
        let warps = GEMV_THREADS as usize / 32;
        let blocks = n
            .div_ceil(warps)
            .min((per_sm * self.multiprocessors) as usize);
        self.launch(
            f,
            cfg((blocks as u32, 1, 1), GEMV_THREADS, shared),
            &[
                Arg::P(ptr(w)?),
                Arg::I(n as i32),
                Arg::I(k as i32),
                Arg::I(r as i32),
                Arg::I(in_mode),
                Arg::P(ptr(src)?),
                opt(rows)?,
                opt(norm)?,
                Arg::F(eps),
                Arg::I(out_mode),
                Arg::P(ptr(out)?),
            ],
        )?;
        Ok(true)
    }

    /// The bf16 rows a matmul reads, computed by the kernel that folds into the small-row path.
    fn materialize(&self, input: MatIn) -> Result<Tensor> {
        match input {
            MatIn::Bf16(a) => Ok(a.clone()),
            MatIn::Rms { x, rows, norm, eps } => self.rms_norm(x, rows, norm, eps),
        }
    }

    /// One token per row of f32 `[R, n]` logits, as `params` (`[R * DRAW_PARAMS]` u32, see
    /// [`draw_params`]) say: greedy, or drawn on the device from the row's own key.
    pub fn sample_rows(&self, logits: &Tensor, params: &Tensor) -> Result<Tensor> {
        let (r, n) = logits.dims2()?;
        ensure!(
            params.dim(0)? >= DRAW_PARAMS * r,
            "draw parameters for {r} rows"
        );
        let out = self.output(r, DType::U32)?;
        if r > 0 {
            self.launch(
                &self.sample_rows,
                cfg((r as u32, 1, 1), 1024, 0),
                &[
                    Arg::P(ptr(logits)?),
                    Arg::P(ptr(params)?),
                    Arg::P(ptr(&out)?),
                    Arg::I(n as i32),
                ],
            )?;
        }
        Ok(out)
    }

    /// `[T]` ids into `[vocab, hidden]` bf16 rows, widened to an f32 `[T, hidden]`.
    pub fn embed(&self, ids: &Tensor, table: &Tensor) -> Result<Tensor> {
        let t = ids.dim(0)?;
        let hidden = table.dim(1)?;
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
                ],
            )?;
        }
        Ok(x)
    }

    /// RMSNorm of the f32 residual stream into bf16; with `rows`, only those rows of `x`, in
    /// that order.
    pub fn rms_norm(
        &self,
        x: &Tensor,
        rows: Option<&Tensor>,
        weight: &Tensor,
        eps: f32,
    ) -> Result<Tensor> {
        let (t, hidden) = x.dims2()?;
        let n = rows.map_or(Ok(t), |r| r.dim(0))?;
        let out = self.output((n, hidden), DType::BF16)?;
        if n > 0 {
            self.launch(
                &self.rms_norm,
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

    /// `[T, 2I]` interleaved gate|up into `silu(gate) * up`, `out [T, I]`.
    fn silu_mul_into(&self, gate_up: &Tensor, out: &Tensor) -> Result<()> {
        let (t, two_i) = gate_up.dims2()?;
        ensure!(
            out.dims2()? == (t, two_i / 2),
            "silu-mul of {:?}",
            gate_up.dims()
        );
        let n = t * two_i / 2;
        if n > 0 {
            self.launch(
                &self.silu_mul,
                cfg((n.div_ceil(256) as u32, 1, 1), 256, 0),
                &[Arg::P(ptr(gate_up)?), Arg::P(ptr(out)?), Arg::Z(n)],
            )?;
        }
        Ok(())
    }

    /// Splits `[T, (H + 2 Hkv) D]` QKV rows: Q rotated into the returned `[T, H * D]`, K
    /// rotated and V into the caches at `slots`.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_rope_write(
        &self,
        qkv: &Tensor,
        positions: &Tensor,
        slots: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        shape: &AttentionShape,
        p: &QkvParams,
    ) -> Result<Tensor> {
        let (h, hkv, d) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
        let (t, width) = qkv.dims2()?;
        ensure!(width == (h + 2 * hkv) * d, "qkv is {width} wide");
        let q = self.output((t, h * d), DType::BF16)?;
        if t > 0 {
            const WARPS: u32 = 8;
            self.launch(
                &self.qkv_rope_write,
                cfg((t as u32, 1, 1), 32 * WARPS, WARPS * d as u32 * 4),
                &[
                    Arg::P(ptr(qkv)?),
                    opt(p.bias)?,
                    opt(p.q_norm)?,
                    opt(p.k_norm)?,
                    Arg::F(p.eps),
                    Arg::P(ptr(positions)?),
                    Arg::P(ptr(p.rope_cos)?),
                    Arg::P(ptr(p.rope_sin)?),
                    Arg::P(ptr(slots)?),
                    Arg::P(ptr(&q)?),
                    Arg::P(ptr(k_cache)?),
                    Arg::P(ptr(v_cache)?),
                    Arg::I(h as i32),
                    Arg::I(hkv as i32),
                    Arg::I(d as i32),
                    Arg::I(p.rope_dim as i32),
                    Arg::I(p.neox as i32),
                    Arg::I(shape.block_size as i32),
                ],
            )?;
        }
        Ok(q)
    }

    /// Attention of every query row of the step over its request's paged K/V; `[T, H * D]`.
    pub fn paged_attention(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        meta: &AttentionMeta,
        s: &AttentionShape,
    ) -> Result<Tensor> {
        let (h, hkv, d) = (s.num_heads, s.num_kv_heads, s.head_dim);
        let group = h / hkv;
        ensure!(
            group <= ATTENTION_ROWS,
            "{group} query heads per KV head (at most {ATTENTION_ROWS})"
        );
        // Tensor cores for the head sizes they serve; the CUDA-core kernel for the others.
        let f = match d {
            64 => &self.attention_mma[0],
            128 => &self.attention_mma[1],
            256 => &self.attention,
            _ => bail!("head_dim {d} (the CUDA attention kernels take 64, 128, 256)"),
        };
        let t = meta.num_tokens;
        let out = self.output((t, h * d), DType::BF16)?;
        if t == 0 {
            return Ok(out);
        }
        let tiles = attention_tiles(t, meta.num_seqs, d, group);
        let splits = meta
            .splits
            .unwrap_or_else(|| self.splits(tiles * hkv, meta.max_seq_len));
        // Partials only when the key range is split.
        let (acc, ml) = if splits > 1 {
            (
                self.output((t * h * splits, d), DType::F32)?,
                self.output((t * h * splits, 2), DType::F32)?,
            )
        } else {
            (out.clone(), out.clone())
        };
        self.launch(
            f,
            cfg(
                (tiles as u32, hkv as u32, splits as u32),
                ATTENTION_THREADS,
                0,
            ),
            &[
                Arg::P(ptr(q)?),
                Arg::P(ptr(k_cache)?),
                Arg::P(ptr(v_cache)?),
                Arg::P(ptr(meta.cu_seqlens_q)?),
                Arg::P(ptr(meta.seq_lens_k)?),
                Arg::P(ptr(meta.block_tables)?),
                Arg::I(meta.max_blocks as i32),
                Arg::I(meta.num_seqs as i32),
                Arg::I(h as i32),
                Arg::I(hkv as i32),
                Arg::I(s.block_size as i32),
                Arg::F(s.scale),
                Arg::I(s.sliding_window as i32),
                Arg::F(s.softcap),
                Arg::I(splits as i32),
                Arg::P(ptr(&out)?),
                Arg::P(ptr(&acc)?),
                Arg::P(ptr(&ml)?),
            ],
        )?;
        if splits > 1 {
            self.launch(
                &self.merge_splits,
                cfg(((t * h) as u32, 1, 1), d as u32, 0),
                &[
                    Arg::P(ptr(&acc)?),
                    Arg::P(ptr(&ml)?),
                    Arg::P(ptr(&out)?),
                    Arg::I(splits as i32),
                    Arg::I(d as i32),
                ],
            )?;
        }
        Ok(out)
    }

    /// Splits of each tile's key range: enough programs for four per multiprocessor (a
    /// program walks its keys serially, so decodes need many in flight), no split shorter
    /// than 128 keys.
    pub fn splits(&self, programs: usize, max_seq_len: usize) -> usize {
        let want = (4 * self.multiprocessors as usize).div_ceil(programs.max(1));
        want.min(max_seq_len.div_ceil(128)).max(1)
    }
}

/// Programs along the grid's x axis of the attention kernel for `head_dim`: a tile holds
/// `rows / group` tokens of one request, and request i's tiles start at `cu_q[i] / TQ + i`.
pub fn attention_tiles(tokens: usize, seqs: usize, head_dim: usize, group: usize) -> usize {
    let rows = if head_dim == 256 {
        ATTENTION_ROWS
    } else {
        MMA_ROWS
    };
    tokens / (rows / group) + seqs
}

/// u32 parameters per row of `sample_rows` (the kernel's `DRAW_PARAMS`).
pub const DRAW_PARAMS: usize = 6;

/// `sample_rows`' parameters: per row temperature, min-p and top-p as f32 bits, top-k and the
/// 64-bit key; greedy rows are all zeros. Padded with greedy rows up to `rows`.
pub fn draw_params(draws: &[RowDraw], rows: usize) -> Vec<u32> {
    let mut p = vec![0u32; DRAW_PARAMS * rows.max(draws.len())];
    for (d, out) in draws.iter().zip(p.chunks_mut(DRAW_PARAMS)) {
        if let RowDraw::Sample {
            temperature,
            top_k,
            top_p,
            min_p,
            key,
        } = *d
        {
            out.copy_from_slice(&[
                temperature.to_bits(),
                min_p.to_bits(),
                top_p.to_bits(),
                top_k,
                key as u32,
                (key >> 32) as u32,
            ]);
        }
    }
    p
}

/// What a matmul reads: bf16 rows, or the RMSNorm before it, folded into the matmul when the
/// step is small (see [`GEMV_MAX_ROWS`]).
pub enum MatIn<'a> {
    Bf16(&'a Tensor),
    /// RMSNorm (weights `norm`) of the f32 residual stream `x`; with `rows`, only those rows.
    Rms {
        x: &'a Tensor,
        rows: Option<&'a Tensor>,
        norm: &'a Tensor,
        eps: f32,
    },
}

impl MatIn<'_> {
    fn rows(&self) -> Result<usize> {
        Ok(match self {
            MatIn::Bf16(a) => a.dim(0)?,
            MatIn::Rms { x, rows, .. } => rows.map_or(x.dim(0), |r| r.dim(0))?,
        })
    }
}

// Input and output modes of `gemv_r*_bf16` (ferrite.cu).
const GEMV_IN_BF16: i32 = 0;
const GEMV_IN_RMS: i32 = 1;
const GEMV_OUT_BF16: i32 = 0;
const GEMV_OUT_F32: i32 = 1;
const GEMV_OUT_ADD: i32 = 2;
const GEMV_OUT_SILU: i32 = 3;

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
