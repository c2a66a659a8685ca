//! What a checkpoint's weights take once a backend has loaded them, read from its header
//! alone (no tensor data): the figure `ferrite plan` states and the start-up line measures
//! (`Model::weight_bytes`), tested to agree on every family (CPU and wgpu); and the device
//! a header plan is for.

use super::WeightSource;
use crate::backend::cpu::linear::{matrix_bytes, repacks};
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

/// What the CPU backend keeps of one stored tensor.
enum Kept<'a> {
    /// Read as stored (the embedding table) or as f32 (routers), not through a linear on
    /// the CPU; a GPU backend keeps them as its linears.
    Bytes(&'a Stored, usize),
    /// A linear's matrix (`copies` of `[rows, cols]` when experts are stacked).
    Matrix(&'a Stored),
}

/// What the CPU backend keeps of `tensors`: every tensor a family reads, a tied LM head
/// once more as a matrix.
fn kept(tensors: &[Stored]) -> Vec<Kept<'_>> {
    // An encoder's pooler is read only under a classifier (a cross-encoder's head).
    let classifier = tensors.iter().any(|t| t.name == "classifier.weight");
    let mut kept = Vec::new();
    for t in tensors {
        if (t.name.contains("pooler.") && !classifier) || is_mtp(&t.name) {
            continue;
        }
        if is_router(&t.name) {
            // GGUF keeps a shared-expert gate as a vector: one row.
            kept.push(Kept::Bytes(t, t.dims.iter().product::<usize>() * 4));
        } else if is_embedding(&t.name) {
            kept.push(Kept::Bytes(t, raw_bytes(t)));
        } else if !not_a_matrix(t) {
            kept.push(Kept::Matrix(t));
        }
    }
    if !tensors.iter().any(|t| is_head(&t.name)) {
        kept.extend(
            tensors
                .iter()
                .find(|t| is_embedding(&t.name))
                .map(Kept::Matrix),
        );
    }
    kept
}

/// How a GPU backend keeps matrices, for plans made from a header.
pub trait MatrixStore {
    /// Bytes of a `[rows, cols]` matrix stored as `dtype`.
    fn bytes(&self, dtype: GgmlDType, rows: usize, cols: usize) -> usize;
    /// How matrices of these stored types are kept, as `ferrite plan` names it.
    fn label(&self, dtypes: &[GgmlDType]) -> String;
}

/// The device a header plan is for: its memory, the most one layer's K/V pages may take (a
/// GPU's binding limit), and how a GPU keeps matrices (None: the CPU backend in the
/// engine's weight format).
pub struct PlanTarget<'a> {
    pub bytes: u64,
    pub layer_pages_limit: Option<u64>,
    pub store: Option<&'a dyn MatrixStore>,
}

/// How a backend keeps a `[rows, cols]` matrix stored as a block type: its bytes.
pub type MatrixBytes<'a> = &'a dyn Fn(GgmlDType, usize, usize) -> usize;

/// Bytes of `src`'s matrices on the CPU backend in `format` (as `Model::weight_bytes`
/// counts them: the embedding table as stored, every matrix as its linear keeps it, a tied
/// LM head once more as a matrix).
pub fn cpu_weight_bytes(src: &WeightSource, format: WeightFormat) -> usize {
    let format = format.resolve_cpu();
    weight_bytes(
        src,
        &|dtype, rows, cols| matrix_bytes(dtype, rows, cols, format),
        false,
    )
}

/// Bytes of `src`'s matrices on a GPU backend that keeps every one (the embedding table and
/// routers too) as `matrix` says.
pub fn gpu_weight_bytes(src: &WeightSource, matrix: MatrixBytes) -> usize {
    weight_bytes(src, matrix, true)
}

fn weight_bytes(src: &WeightSource, matrix: MatrixBytes, all_matrices: bool) -> usize {
    let tensors = stored(src);
    let as_matrix = |t: &Stored| {
        // A vector (GGUF's shared-expert gate) is one row.
        let (rows, cols) = match t.dims.len() {
            1 => (1, t.dims[0]),
            n => (t.dims[n - 2], t.dims[n - 1]),
        };
        let copies: usize = t.dims[..t.dims.len().saturating_sub(2)].iter().product();
        copies * matrix(t.dtype, rows, cols)
    };
    kept(&tensors)
        .iter()
        .map(|k| match k {
            Kept::Bytes(t, _) if all_matrices => as_matrix(t),
            Kept::Bytes(_, n) => *n,
            Kept::Matrix(t) => as_matrix(t),
        })
        .sum()
}

/// The block types of `src`'s matrices, in order of first appearance (safetensors' as F32).
pub fn matrix_dtypes(src: &WeightSource) -> Vec<GgmlDType> {
    let tensors = stored(src);
    let mut dtypes = Vec::new();
    for k in kept(&tensors) {
        let (Kept::Matrix(t) | Kept::Bytes(t, _)) = k;
        if !dtypes.contains(&t.dtype) {
            dtypes.push(t.dtype);
        }
    }
    dtypes
}

/// How the CPU backend keeps `src`'s matrices in `format`, as `ferrite plan` names it:
/// `f32`, or the int8 kernels with the stored block types they are repacked from.
pub fn cpu_weight_label(src: &WeightSource, format: WeightFormat) -> String {
    let format = format.resolve_cpu();
    let tensors = stored(src);
    let mut packed: Vec<String> = Vec::new();
    for k in kept(&tensors) {
        let Kept::Matrix(t) = k else { continue };
        // GGUF's spelling of the block type (candle's `Q4K` is `Q4_K`).
        let name = format!("{:?}", t.dtype).replace('K', "_K");
        if repacks(t.dtype, format) && !packed.contains(&name) {
            packed.push(name);
        }
    }
    let floats = kept(&tensors)
        .iter()
        .any(|k| matches!(k, Kept::Matrix(t) if !repacks(t.dtype, format)));
    match (packed.is_empty(), floats) {
        (true, _) => "f32".into(),
        (false, false) => format!("int8 kernels, repacked from {}", packed.join(", ")),
        (false, true) => format!("int8 kernels (from {}) and f32", packed.join(", ")),
    }
}
