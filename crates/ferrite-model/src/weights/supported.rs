//! What the loader can honour, checked before anything is loaded: a quantized checkpoint whose
//! scales the loader would ignore, or a tensor type it would misread, is refused at start with
//! a message naming it, never loaded into wrong answers.

use anyhow::{bail, Result};
use candle_core::safetensors::MmapedSafetensors;
use safetensors::Dtype;
use serde_json::Value;
use std::path::Path;

const SAFETENSORS_TYPES: &str = "F32, F16, BF16 or F64";

pub const GGUF_TYPES: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K";

/// A Hugging Face `config.json` that declares a quantization format (`quantization_config`:
/// FP8, AWQ, GPTQ, compressed-tensors, bitsandbytes...; `quantization`: MLX) is refused:
/// the loader reads plain F32/F16/BF16 tensors only.
pub fn check_hf_config(json: &Value, path: &Path) -> Result<()> {
    for key in ["quantization_config", "quantization"] {
        let Some(q) = json.get(key).filter(|q| !q.is_null()) else {
            continue;
        };
        let method = q
            .get("quant_method")
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| (key == "quantization").then(|| mlx_name(q)))
            .unwrap_or_else(|| "an unnamed format".into());
        bail!(
            "{}: the checkpoint is quantized ({key}: {method}), a format this build cannot load; \
             it loads GGUF files (quantized or not) and safetensors of {SAFETENSORS_TYPES} \
             tensors: use the model's unquantized checkpoint or a GGUF of it",
            path.display()
        );
    }
    Ok(())
}

/// MLX's `{"group_size": 64, "bits": 4}`, as its users call it.
fn mlx_name(q: &Value) -> String {
    match q.get("bits").and_then(Value::as_u64) {
        Some(bits) => format!("MLX {bits}-bit"),
        None => "MLX".into(),
    }
}

/// Every tensor of a safetensors checkpoint has a type the loader widens exactly: an FP8 or
/// packed-integer weight (a quantized checkpoint without its config) is refused.
pub fn check_safetensors(files: &MmapedSafetensors, dir: &Path) -> Result<()> {
    for (name, view) in files.tensors() {
        let dtype = view.dtype();
        let float = matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64);
        // Integer buffers (BERT's `position_ids`) are not read; integer weights are packed codes.
        let quantized_name = [
            ".weight",
            "_scale",
            "_scale_inv",
            ".scales",
            ".qzeros",
            ".biases",
        ]
        .iter()
        .any(|s| name.ends_with(s));
        if !float && (quantized_name || !is_integer(dtype)) {
            bail!(
                "{}: tensor `{name}` is {dtype:?}, a type this build cannot load (quantized \
                 checkpoints are not supported); safetensors weights must be {SAFETENSORS_TYPES}",
                dir.display()
            );
        }
    }
    Ok(())
}

fn is_integer(d: Dtype) -> bool {
    matches!(
        d,
        Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::U16
            | Dtype::I16
            | Dtype::U32
            | Dtype::I32
            | Dtype::U64
            | Dtype::I64
    )
}

/// llama.cpp's name of a GGUF tensor type number candle cannot read.
pub fn ggml_type_name(t: u32) -> Option<&'static str> {
    Some(match t {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}
