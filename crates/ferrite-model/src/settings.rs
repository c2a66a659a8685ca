//! Plain settings shared by the CLI, the loader and the backends: where the model runs, how
//! its weights are obtained and kept, and what it is run for. No module below the CLI's
//! settings asks `engine_args` for them.

/// Where the model runs (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl std::str::FromStr for DeviceKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("unknown device `{s}` (cpu, cuda, cuda:N)")),
        }
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
