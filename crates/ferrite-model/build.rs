//! With the `cuda` feature: compiles `kernels/ferrite.cu` (which includes the kernel files of each op) into one fat binary holding machine
//! code for sm_80 and sm_90 and PTX for newer GPUs, so no request waits for a driver JIT.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=kernels");
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
        .args(["-gencode", "arch=compute_90,code=compute_90"])
        .arg("kernels/ferrite.cu")
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("running {}: {e} (set NVCC or CUDA_ROOT)", nvcc.display()));
    assert!(status.success(), "nvcc failed on kernels/ferrite.cu");
}
