//! Loading the kernels: the fat binary's module, each function, and the shared memory and
//! variants each op's launches were built for (the sizes live with their op's launches).

use super::{gdn, matmul, Kernels, Outputs};
use anyhow::{Context, Result};
use candle_core::cuda::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda::cudarc::driver::CudaFunction;
use candle_core::cuda::cudarc::nvrtc::Ptx;
use candle_core::CudaDevice;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Mutex;

/// sm_80 and sm_90 machine code plus sm_90 PTX, built by `build.rs`.
static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ferrite.fatbin"));

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
        let shared = |name: &str, bytes: usize| -> Result<CudaFunction> {
            let g = f(name)?;
            g.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )?;
            Ok(g)
        };
        let gemv = (1..=matmul::GEMV_MAX_ROWS)
            .map(|r| shared(&format!("gemv_r{r}_bf16"), matmul::GEMV_MAX_SHARED))
            .collect::<Result<Vec<_>>>()?;
        let gemm_invariant = ["m16", "m64", "m128"]
            .iter()
            .zip(matmul::GEMM_INVARIANT_SHARED)
            .map(|(name, bytes)| {
                let g = shared(&format!("gemm_bi_{name}"), bytes)?;
                let threads =
                    g.get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?;
                Ok((g, threads as u32))
            })
            .collect::<Result<Vec<_>>>()?
            .try_into()
            .map_err(|_| anyhow::anyhow!("three batch-invariant matmul kernels"))?;
        let gdn_chunked = gdn::RULE_KEY_DIMS
            .iter()
            .map(|&d| shared(&format!("gdn_chunked_k{d}_f32"), gdn::chunk_shared_bytes(d)))
            .collect::<Result<Vec<_>>>()?
            .try_into()
            .map_err(|_| anyhow::anyhow!("one chunked delta-rule kernel per key head size"))?;
        let context = stream.context();
        let multiprocessors =
            context.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let major =
            context.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let chained = major >= 9 && std::env::var("FERRITE_CUDA_CHAINED").as_deref() != Ok("0");
        Ok(Self {
            dev: dev.clone(),
            embed: f("embed_bf16")?,
            rms_norm: f("rms_norm_bf16")?,
            rms_norm_f32: f("rms_norm_f32")?,
            add_rms_norm: f("add_rms_norm_f32")?,
            gated_mul: f("gated_mul_bf16")?,
            add_f32: f("add_f32")?,
            softcap: f("softcap_f32")?,
            gemv,
            gemv_occupancy: Mutex::default(),
            fused_rows: AtomicUsize::new(matmul::GEMV_MAX_ROWS),
            gemm_invariant,
            batch_invariant: AtomicBool::new(false),
            qkv_rope_write: [
                f("qkv_rope_write_bf16")?,
                f("qkv_rope_write_fp8")?,
                f("qkv_rope_write_int8")?,
            ],
            attention_mma: {
                let by_dim = |d: usize| -> Result<[CudaFunction; 3]> {
                    let g = |kv: &str| f(&format!("paged_attention_mma_d{d}_{kv}"));
                    Ok([g("bf16")?, g("fp8")?, g("int8")?])
                };
                [by_dim(32)?, by_dim(64)?, by_dim(128)?, by_dim(256)?]
            },
            merge_splits: f("merge_splits_bf16")?,
            moe_route: f("moe_route_f32")?,
            moe_align: f("moe_align")?,
            moe_gate_up: [f("moe_gate_up_m16_bf16")?, f("moe_gate_up_m64_bf16")?],
            moe_down: [f("moe_down_m16_bf16")?, f("moe_down_m64_bf16")?],
            moe_combine: f("moe_combine_f32")?,
            gdn_state_restore: f("gdn_state_restore")?,
            gdn_conv: f("gdn_conv_f32")?,
            gdn_conv_window: f("gdn_conv_window")?,
            gdn_rule: [
                f("gdn_rule_k16_f32")?,
                f("gdn_rule_k32_f32")?,
                f("gdn_rule_k64_f32")?,
                f("gdn_rule_k128_f32")?,
            ],
            gdn_chunked,
            gdn_gated_norm: f("gdn_gated_norm_bf16")?,
            gate_sigmoid: f("gate_sigmoid_bf16")?,
            moe_gemv_gate_up: f("moe_gemv_gate_up_bf16")?,
            moe_gemv_down: f("moe_gemv_down_bf16")?,
            sample_rows: f("sample_rows_f32")?,
            mask_rows: f("mask_rows_f32")?,
            multiprocessors,
            chained,
            outputs: Mutex::new(Outputs::Allocate),
            _module: module,
        })
    }
}
