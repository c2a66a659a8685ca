//! Start-up flags of the real binary: devices and load formats it cannot serve fail at once
//! with a message that says what to do.

use std::process::Command;

fn ferrite(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(args)
        .output()
        .expect("run ferrite");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
#[cfg(not(feature = "cuda"))]
fn cuda_device_without_the_feature_says_how_to_build_it() {
    let (ok, err) = ferrite(&[
        "generate",
        "missing.gguf",
        "--prompt",
        "hi",
        "--device",
        "cuda",
    ]);
    assert!(!ok);
    assert!(err.contains("built without CUDA support"), "{err}");
    assert!(err.contains("--features cuda"), "{err}");
}

#[test]
fn unknown_device_is_a_usage_error() {
    let (ok, err) = ferrite(&["generate", "m.gguf", "--prompt", "hi", "--device", "tpu"]);
    assert!(!ok);
    assert!(
        err.contains("unknown device `tpu` (cpu, cuda, cuda:N)"),
        "{err}"
    );
}

#[test]
fn dummy_weights_need_a_gpu() {
    let (ok, err) = ferrite(&[
        "generate",
        "config.json",
        "--prompt",
        "hi",
        "--load-format",
        "dummy",
    ]);
    assert!(!ok);
    assert!(
        err.contains("--load-format dummy needs --device cuda"),
        "{err}"
    );
}

#[test]
fn hugging_face_folders_need_a_gpu() {
    let dir = std::env::temp_dir();
    let (ok, err) = ferrite(&["generate", dir.to_str().unwrap(), "--prompt", "hi"]);
    assert!(!ok);
    assert!(
        err.contains(
            "the CPU backend loads GGUF files; Hugging Face checkpoints need --device cuda"
        ),
        "{err}"
    );
}
