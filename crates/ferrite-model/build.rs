//! With the `cuda` feature: compiles `src/backend/cuda/kernels/ferrite.cu` (which includes the
//! kernel file of each op, beside the Rust file that launches it) into one fat binary holding machine
//! code for sm_80 (A100), sm_90 (H100, H200) and sm_120 (consumer Blackwell; by CUDA's
//! binary compatibility within a major version it also runs on sm_121, the DGX Spark's
//! GB10), and PTX for newer GPUs, so no request waits for a driver JIT where it can be
//! helped.

use std::path::PathBuf;
use std::process::Command;

/// The CUDA backend's kernel sources.
const KERNELS: &str = "src/backend/cuda/kernels";

fn main() {
    println!("cargo:rerun-if-changed={KERNELS}");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CUDA_ROOT").map(|r| PathBuf::from(r).join("bin/nvcc")))
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("ferrite.fatbin");
    let status = Command::new(&nvcc)
        .args(["-fatbin", "-O3", "-std=c++17"])
        .args(["-gencode", "arch=compute_80,code=sm_80"])
        .args(["-gencode", "arch=compute_90,code=sm_90"])
        .args(["-gencode", "arch=compute_120,code=sm_120"])
        .args(["-gencode", "arch=compute_90,code=compute_90"])
        .arg(format!("{KERNELS}/ferrite.cu"))
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("running {}: {e} (set NVCC or CUDA_ROOT)", nvcc.display()));
    assert!(status.success(), "nvcc failed on {KERNELS}/ferrite.cu");
}
