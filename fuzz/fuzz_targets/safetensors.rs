//! Any bytes as the `model.safetensors` of a Hugging Face folder (the tiny Qwen3's config): the
//! CPU loader loads it or returns an error; it never panics, aborts or hangs.
#![no_main]

use ferrite_model::loader::{load_cpu_decoder, LoadFormat, WeightFormat};
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

fn folder() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ferrite-fuzz-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/oracle/tiny/qwen3/config.json");
        std::fs::copy(config, dir.join("config.json")).unwrap();
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = folder();
    std::fs::write(dir.join("model.safetensors"), data).unwrap();
    let _ = load_cpu_decoder(dir, LoadFormat::Auto, WeightFormat::F32, None, Some(64), &mut |_, _| {});
});
