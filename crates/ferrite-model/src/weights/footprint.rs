//! What a checkpoint's weights take once the CPU backend has loaded them, read from its
//! header alone (no tensor data): the figure `ferrite plan` states and the start-up line
//! measures (`Decoder::weight_bytes`), tested to agree on every family.

use super::WeightSource;
use crate::backend::cpu::linear::matrix_bytes;
use crate::settings::WeightFormat;
use candle_core::quantized::GgmlDType;

/// A stored tensor as the loader would see it: name, dims (`[rows, cols]`, experts first
/// when stacked), block type (safetensors load as f32).
struct Stored {
    name: String,
    dims: Vec<usize>,
    dtype: GgmlDType,
}

fn stored(src: &WeightSource) -> Vec<Stored> {
    match src {
        WeightSource::Gguf { file, .. } => file
            .content
            .tensor_infos
            .iter()
            .map(|(name, t)| Stored {
                name: name.clone(),
                dims: t.shape.dims().to_vec(),
                dtype: t.ggml_dtype,
            })
            .collect(),
        WeightSource::Safetensors {
            files,
            language_model,
            ..
        } => files
            .tensors()
            .into_iter()
            .filter_map(|(name, t)| {
                // A multimodal checkpoint's language model is all a family reads.
                let name = match language_model {
                    true if name.starts_with("lm_head.") => name,
                    true => format!("model.{}", name.strip_prefix("model.language_model.")?),
                    false => name,
                };
                Some(Stored {
                    name,
                    dims: t.shape().to_vec(),
                    dtype: GgmlDType::F32,
                })
            })
            .collect(),
        WeightSource::Dummy => Vec::new(),
    }
}

/// Tensors a family reads as vectors or not at all: norms, biases, the recurrent layers'
/// conv kernels and decays.
fn not_a_matrix(t: &Stored) -> bool {
    t.dims.len() < 2 || t.name.contains("conv1d") || t.name.contains("position_ids")
}

/// A multi-token-prediction head's tensors, which serving does not load (yet).
fn is_mtp(name: &str) -> bool {
    name.starts_with("mtp.") || name.starts_with("model.mtp")
}

fn is_embedding(name: &str) -> bool {
    name == "token_embd.weight" || name == "model.embed_tokens.weight"
}

fn is_head(name: &str) -> bool {
    name == "output.weight" || name == "lm_head.weight"
}

/// Mixture-of-experts routers and shared-expert gates, kept in f32 whatever the format.
fn is_router(name: &str) -> bool {
    name.contains("ffn_gate_inp")
        || name.ends_with(".mlp.gate.weight")
        || name.ends_with("block_sparse_moe.gate.weight")
        || name.ends_with("shared_expert_gate.weight")
}

fn raw_bytes(t: &Stored) -> usize {
    t.dims.iter().product::<usize>() / t.dtype.block_size() * t.dtype.type_size()
}

/// Bytes of `src`'s matrices on the CPU backend in `format` (as `Decoder::weight_bytes`
/// counts them: the embedding table as stored, every matrix as its linear keeps it, a tied
/// LM head once more as a matrix).
pub fn cpu_weight_bytes(src: &WeightSource, format: WeightFormat) -> usize {
    let format = format.resolve_cpu();
    let tensors = stored(src);
    let mut total = 0;
    // An encoder's pooler is read only under a classifier (a cross-encoder's head).
    let classifier = tensors.iter().any(|t| t.name == "classifier.weight");
    for t in &tensors {
        if (t.name.contains("pooler.") && !classifier) || is_mtp(&t.name) {
            continue;
        }
        if is_router(&t.name) {
            // GGUF keeps a shared-expert gate as a vector: one row.
            total += t.dims.iter().product::<usize>() * 4;
            continue;
        }
        if not_a_matrix(t) {
            continue;
        }
        let (rows, cols) = (t.dims[t.dims.len() - 2], t.dims[t.dims.len() - 1]);
        let copies: usize = t.dims[..t.dims.len() - 2].iter().product();
        total += if is_embedding(&t.name) {
            raw_bytes(t)
        } else {
            copies * matrix_bytes(t.dtype, rows, cols, format)
        };
    }
    if !tensors.iter().any(|t| is_head(&t.name)) {
        if let Some(e) = tensors.iter().find(|t| is_embedding(&t.name)) {
            total += matrix_bytes(e.dtype, e.dims[0], e.dims[1], format);
        }
    }
    total
}
