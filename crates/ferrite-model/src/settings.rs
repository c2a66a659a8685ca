//! Plain settings shared by the CLI, the loader and the backends: where the model runs, how
//! its weights are obtained and kept, and what it is run for. No module below the CLI's
//! settings asks `engine_args` for them.

use crate::kv_dtype::KvCacheDtype;

/// Where the model runs (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
    /// A GPU through wgpu (WGSL kernels): Metal on macOS, Vulkan elsewhere; the N-th adapter
    /// of that API.
    Wgpu(GpuApi, usize),
}

/// Which of wgpu's graphics APIs `--device` asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuApi {
    /// `wgpu[:N]`: the platform's own (Metal on macOS, Vulkan elsewhere).
    Native,
    Vulkan,
    Metal,
}

impl GpuApi {
    pub fn name(self) -> &'static str {
        match self {
            Self::Native => "wgpu",
            Self::Vulkan => "vulkan",
            Self::Metal => "metal",
        }
    }
}

/// What each device takes where the user says nothing, and what it computes in: a new
/// backend states its own here, beside its variant.
impl DeviceKind {
    /// The backend's name in messages.
    pub fn backend_name(self) -> &'static str {
        match self {
            Self::Cpu => "CPU",
            Self::Cuda(_) => "CUDA",
            Self::Wgpu(..) => "wgpu",
        }
    }

    /// `--gpu-memory-utilization` where none is given: on the CPU the "device" is the whole
    /// machine's RAM, shared with everything else; a dedicated GPU takes vLLM's default.
    pub fn default_memory_utilization(self) -> f64 {
        match self {
            Self::Cpu => 0.25,
            Self::Cuda(_) | Self::Wgpu(..) => 0.9,
        }
    }

    /// How `--kv-cache-dtype auto` stores K/V here.
    pub fn auto_kv_dtype(self) -> KvCacheDtype {
        match self {
            Self::Cpu => KvCacheDtype::Fp16,
            Self::Cuda(_) => KvCacheDtype::Bf16,
            // WGSL has no bf16.
            Self::Wgpu(..) => KvCacheDtype::Fp16,
        }
    }

    /// The `--dtype` values beside `auto` this backend computes in, and what `auto` is.
    pub fn dtypes(self) -> (&'static [&'static str], &'static str) {
        match self {
            Self::Cpu => (
                &["float32", "float"],
                "auto: int8 activations; float32: f32",
            ),
            Self::Cuda(_) => (&["bfloat16"], "auto or bfloat16"),
            Self::Wgpu(..) => (&[], "auto: f16 weights, f32 activations"),
        }
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (name, index) = match s.split_once(':') {
            Some((name, n)) => (name, n.parse().ok()),
            None => (s, Some(0)),
        };
        let api = |a| index.map(|i| Self::Wgpu(a, i));
        let device = match name {
            "cpu" if index == Some(0) && !s.contains(':') => Some(Self::Cpu),
            "cuda" => index.map(Self::Cuda),
            "wgpu" => api(GpuApi::Native),
            "vulkan" => api(GpuApi::Vulkan),
            "metal" => api(GpuApi::Metal),
            _ => None,
        };
        device.ok_or_else(|| {
            format!("unknown device `{s}` (cpu, cuda[:N], metal[:N], vulkan[:N], wgpu[:N])")
        })
    }
}

/// How weights are obtained (`--load-format`, as in vLLM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadFormat {
    /// From the model file.
    Auto,
    /// Random weights of the model's config, drawn on the device (benchmarks of large
    /// shapes on hosts without the checkpoint).
    Dummy,
}

impl std::str::FromStr for LoadFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "dummy" => Ok(Self::Dummy),
            _ => Err(format!("unknown load format `{s}` (auto, dummy)")),
        }
    }
}

/// How weights are kept in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// On the CPU, `Native` whatever the model's size: the path the benchmarks and the oracle
    /// tests run (teacher-forced against transformers: top-1 agreement 98% on SmolLM2, above
    /// llama.cpp's 96.4% on the same GGUF, and 7x faster to decode than `F32`).
    #[default]
    Auto,
    /// Quantized weights repacked for the int8 kernels (activations quantized per block of
    /// 32, to 8 bits or, for the inputs rounding shows in, 16); float weights as f32.
    Native,
    /// Everything dequantized to f32 at load: exact weights and activations, 4-8x the memory.
    F32,
}

impl WeightFormat {
    /// `Auto` as the CPU backend resolves it.
    pub fn resolve_cpu(self) -> Self {
        match self {
            WeightFormat::Auto => WeightFormat::Native,
            f => f,
        }
    }
}

/// `--runner`: generation, or pooling (embeddings, scores).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunnerKind {
    /// Pooling for encoders and for checkpoints described as sentence-transformers
    /// embedding models (`modules.json` with a Pooling module); generation otherwise.
    Auto,
    Generate,
    Pooling,
}

impl std::str::FromStr for RunnerKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "generate" => Ok(Self::Generate),
            "pooling" => Ok(Self::Pooling),
            _ => Err(format!("unknown runner `{s}` (auto, generate, pooling)")),
        }
    }
}
