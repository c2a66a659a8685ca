//! Matmuls: cuBLAS (cublasGemmEx) for steps of many rows, ferrite's fused small-row kernels
//! for decodes of one or two requests, candle's quantized kernels for GGUF blocks kept as
//! they are; each with the op before it (RMSNorm) and after it (residual add, gated
//! activation) folded in where the kernel can. With `--batch-invariant`, ferrite's
//! batch-invariant kernel (`gemm_bi_*`) for every row count instead.

use super::{cfg, opt, ptr, Arg, Kernels};
use crate::backend::cuda::linear::Linear;
use crate::backend::Activation;
use anyhow::{ensure, Context, Result};
use candle_core::quantized::QTensor;
use candle_core::{DType, Tensor};
use std::collections::hash_map::Entry;
use std::sync::atomic::Ordering;

/// Steps of one request of up to this many rows (a decode, a verify window of up to 7 drafts)
/// get the fused one-warp-per-column matmuls (`gemv_r*_bf16`), when the rows fit shared
/// memory; larger ones cuBLAS. A row's sum is the same for every row count, so a request
/// alone rounds alike whether it decodes or verifies drafts.
pub const GEMV_MAX_ROWS: usize = 8;
/// The same for steps of several requests: past two rows cuBLAS reads the weights about as
/// fast or faster (the Llama-3.1-8B shape's matmuls on an H100: 4 rows 5.76 ms fused with the
/// norms, 5.70 ms cuBLAS alone; 8 rows 6.94 against 5.71; h200-speculative.md).
pub const GEMV_BATCH_ROWS: usize = 2;
/// The batch-invariant kernels' tiles (`gemm_bi_m16/m64/m128`): the most rows each is
/// picked for, its block's rows and columns, and dynamic shared memory (gemm.cuh).
pub const GEMM_INVARIANT_ROWS: [usize; 3] = [16, 64, usize::MAX];
const GEMM_INVARIANT_TILES: [(usize, usize); 3] = [(16, 32), (64, 32), (128, 128)];
/// (rows + columns) x 64 bytes a chunk, x chunks a stage x stages.
pub(super) const GEMM_INVARIANT_SHARED: [usize; 3] =
    [48 * 64 * 4 * 6, 96 * 64 * 4 * 4, 256 * 64 * 4];
/// The `__launch_bounds__` of `gemv_r*_bf16`.
const GEMV_THREADS: u32 = 512;
/// Shared memory the fused matmuls may take for their input rows.
pub(super) const GEMV_MAX_SHARED: usize = 160 * 1024;

impl Kernels {
    /// `x [R, k] @ w [n, k]^T` into `[R, n]` of `out_dtype` (bf16 or f32), bf16 operands
    /// and f32 accumulation, one cublasGemmEx call. The LM head asks for f32: logits rounded
    /// to bf16 would lose near-ties.
    pub fn matmul_nt(&self, x: &Tensor, w: &Tensor, out_dtype: DType) -> Result<Tensor> {
        let out = self.output((x.dim(0)?, w.dim(0)?), out_dtype)?;
        self.gemm(x, w, &out, 0.0)?;
        Ok(out)
    }

    /// From now on every matmul (and attention, unsplit: see [`Kernels::paged_attention`])
    /// rounds a row the same way in a step of any size: set once, before the first step
    /// (`--batch-invariant`).
    pub fn set_batch_invariant(&self, on: bool) {
        self.batch_invariant.store(on, Ordering::Relaxed);
    }

    pub fn batch_invariant(&self) -> bool {
        self.batch_invariant.load(Ordering::Relaxed)
    }

    /// `x [R, k] @ w [n, k]^T` into `out` by `out_mode` through `gemm_bi_*`.
    fn gemm_invariant(&self, x: &Tensor, w: &Tensor, out: &Tensor, out_mode: i32) -> Result<()> {
        let (r, k) = x.dims2()?;
        let (n, k2) = w.dims2()?;
        let out_cols = if out_mode >= GEMV_OUT_SILU { n / 2 } else { n };
        ensure!(
            k == k2 && k % 8 == 0 && out.dims2()? == (r, out_cols),
            "batch-invariant matmul of [{r}, {k}] by [{n}, {k2}]^T into {:?} (the depth a multiple of 8)",
            out.dims()
        );
        if r == 0 {
            return Ok(());
        }
        let at = GEMM_INVARIANT_ROWS
            .iter()
            .position(|&most| r <= most)
            .unwrap_or(2);
        let (rows, cols) = GEMM_INVARIANT_TILES[at];
        let (f, threads) = &self.gemm_invariant[at];
        self.launch_chained(
            f,
            cfg(
                (n.div_ceil(cols) as u32, r.div_ceil(rows) as u32, 1),
                *threads,
                GEMM_INVARIANT_SHARED[at] as u32,
            ),
            &[
                Arg::P(ptr(x)?),
                Arg::P(ptr(w)?),
                Arg::I(r as i32),
                Arg::I(n as i32),
                Arg::I(k as i32),
                Arg::I(out_mode),
                Arg::P(ptr(out)?),
            ],
        )
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
        if self.batch_invariant() {
            self.gemm_invariant(&self.materialize(input)?, w, &out, mode)?;
        } else if !self.gemv(&input, w, &out, mode)? {
            self.gemm(&self.materialize(input)?, w, &out, 0.0)?;
        }
        Ok(out)
    }

    /// `silu(gate) * up` of `input @ w^T`, `[R, I]` bf16, for gate|up weights `[2I, k]` whose
    /// rows alternate gate, up (see [`super::weights::interleave_gate_up`]).
    /// `act(gate) * up` of `input @ w^T`, `[R, I]` bf16, for gate|up weights `[2I, k]` whose
    /// rows alternate gate, up (see [`crate::backend::cuda::linear`]).
    pub fn matmul_gated(&self, input: MatIn, w: &Linear, act: Activation) -> Result<Tensor> {
        let out = self.output((input.rows()?, w.dims()?.0 / 2), DType::BF16)?;
        let gate_up = match w {
            Linear::Quant(q) => self.quant_matmul(input, q)?.to_dtype(DType::BF16)?,
            Linear::Dense(w) => {
                let mode = match act {
                    Activation::Silu => GEMV_OUT_SILU,
                    Activation::GeluTanh => GEMV_OUT_GELU,
                };
                if self.batch_invariant() {
                    self.gemm_invariant(&self.materialize(input)?, w, &out, mode)?;
                    return Ok(out);
                }
                if self.gemv(&input, w, &out, mode)? {
                    return Ok(out);
                }
                let gate_up = self.output((input.rows()?, w.dim(0)?), DType::BF16)?;
                self.gemm(&self.materialize(input)?, w, &gate_up, 0.0)?;
                gate_up
            }
        };
        self.gated_mul_into(&gate_up, &out, act)?;
        Ok(out)
    }

    /// `x += input @ w^T` on the f32 residual stream `x [R, n]` (the residual add folded
    /// into the matmul).
    pub fn matmul_add(&self, input: MatIn, w: &Linear, x: &Tensor) -> Result<()> {
        match w {
            Linear::Quant(q) => self.add_into(x, &self.quant_matmul(input, q)?),
            Linear::Dense(w) if self.batch_invariant() => {
                self.gemm_invariant(&self.materialize(input)?, w, x, GEMV_OUT_ADD)?;
                Ok(())
            }
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
        ensure!(
            !self.batch_invariant(),
            "--batch-invariant runs bf16 weights; these are {:?} blocks",
            q.dtype()
        );
        let a = self.materialize(input)?.to_dtype(DType::F32)?;
        Ok(a.apply_op1_no_bwd(q)?)
    }
    /// Matmuls of up to `rows` rows ([`GEMV_MAX_ROWS`] at most) take the fused kernels from
    /// now on: set before each step, from how many requests it has (graphs bake it in).
    pub fn set_fused_rows(&self, rows: usize) {
        self.fused_rows
            .store(rows.min(GEMV_MAX_ROWS), Ordering::Relaxed);
    }

    /// The fused small-row matmul into `out`, when the step is small enough; false otherwise.
    fn gemv(&self, input: &MatIn, w: &Tensor, out: &Tensor, out_mode: i32) -> Result<bool> {
        let r = input.rows()?;
        let (n, k) = w.dims2()?;
        let most = self.fused_rows.load(Ordering::Relaxed);
        if r == 0 || r > most || k % 8 != 0 || n % 2 != 0 || r * k * 2 > GEMV_MAX_SHARED {
            return Ok(false);
        }
        let (in_mode, src, rows, norm, eps) = match input {
            MatIn::Bf16(a) => (GEMV_IN_BF16, *a, None, None, 0.0),
            MatIn::Rms { x, rows, norm, eps } => (GEMV_IN_RMS, *x, *rows, Some(*norm), *eps),
        };
        let out_cols = if out_mode >= GEMV_OUT_SILU { n / 2 } else { n };
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
        // A warp takes a pair of columns at a time.
        let warps = GEMV_THREADS as usize / 32;
        let blocks = (n / 2)
            .div_ceil(warps)
            .min((per_sm * self.multiprocessors) as usize);
        self.launch_chained(
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
            MatIn::Rms { x, rows, norm, eps } => self.rms_norm(x, rows, norm, eps, DType::BF16),
        }
    }
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
const GEMV_OUT_GELU: i32 = 4;
