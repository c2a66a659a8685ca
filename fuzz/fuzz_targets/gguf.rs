//! Any bytes as a GGUF model file: the whole CPU loader (header, config, tensor layout, weights)
//! either loads it or returns an error; it never panics, aborts or hangs.
#![no_main]

use ferrite_model::loader::{load_cpu_decoder, LoadFormat, WeightFormat};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("ferrite-fuzz-{}.gguf", std::process::id()));
    std::fs::write(&path, data).unwrap();
    let _ = load_cpu_decoder(&path, LoadFormat::Auto, WeightFormat::F32, None, Some(64), &mut |_, _| {});
});
