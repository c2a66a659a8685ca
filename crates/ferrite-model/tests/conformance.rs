//! The backend conformance suite (`suite/mod.rs`) on the CPU backend's default path: int8
//! weights and activations (Q8_0 blocks repacked, f32 matrices kept), f16 K/V by default,
//! against the same backend with f32 weights and f32 K/V.

mod common;
mod suite;

use ferrite_model::backend::cpu::CpuBackend;
use ferrite_model::kv_dtype::KvCacheDtype;
use ferrite_model::settings::WeightFormat;
use suite::{failures, families, run, FamilyBound, Tolerances};

/// What the int8 path's rounding allows: activations in 8 bits per block of 32 (16 for
/// `Fine` inputs), K/V in the stored type.
const INT8_PATH: Tolerances = Tolerances {
    linear: 3e-2,
    attention: |kv| match kv {
        KvCacheDtype::Fp32 => 1e-5,
        KvCacheDtype::Fp16 | KvCacheDtype::Auto => 2e-3,
        KvCacheDtype::Bf16 => 1e-2,
        KvCacheDtype::Int8 => 2e-2,
        KvCacheDtype::Fp8 => 6e-2,
    },
    moe: 3e-2,
    gated_delta: 1e-5,
    pointwise: 1e-5,
};

#[test]
fn the_int8_path_conforms() {
    let out = run(&|| CpuBackend::new(WeightFormat::Native, None), &INT8_PATH);
    let bad = failures(&out);
    assert!(
        bad.is_empty(),
        "{:?}",
        bad.iter()
            .map(|o| (&o.case, o.error, o.tolerance))
            .collect::<Vec<_>>()
    );
    // The CPU serves every op and every KV type.
    assert!(out.iter().all(|o| o.error.is_some()));
}

/// Every family's tiny checkpoint through a whole prompt step on the default path. The
/// checkpoints are f32, which the int8 path keeps as f32: what differs here is the f16 K/V.
#[test]
fn every_family_conforms_on_the_default_path() {
    let bound = |_: &str| FamilyBound {
        error: 1e-2,
        skip: 0,
    };
    let out = families(&|| CpuBackend::new(WeightFormat::Native, None), &bound);
    assert!(failures(&out).is_empty());
    assert!(out.iter().all(|o| o.error.is_some()));
}
