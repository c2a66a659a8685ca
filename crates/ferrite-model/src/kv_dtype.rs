//! `--kv-cache-dtype`: how the KV pages store K and V. The 8-bit types keep one f32 scale
//! per token and KV head (`amax / 127` for int8, `amax / 448` for fp8 e4m3), written with
//! the token, so a block never needs re-quantizing as it fills.

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// The device's own: f16 on the CPU, bf16 on CUDA.
    #[default]
    Auto,
    /// Exact K/V (the CPU only): 2x f16's memory, for exact comparisons.
    Fp32,
    Fp16,
    Bf16,
    /// fp8 e4m3 (saturating) with a scale per token and KV head.
    Fp8,
    /// int8 with a scale per token and KV head.
    Int8,
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    /// vLLM's names (`auto`, `bfloat16`, `fp8`, `fp8_e4m3`) and the short ones.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "fp32" | "float32" | "float" => Ok(Self::Fp32),
            "fp16" | "float16" | "half" => Ok(Self::Fp16),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "fp8" | "fp8_e4m3" => Ok(Self::Fp8),
            "int8" => Ok(Self::Int8),
            "fp8_e5m2" => Err("fp8_e5m2 KV is not supported; fp8 (e4m3) is".into()),
            _ => Err(format!(
                "unknown KV cache dtype `{s}` (auto, fp32, fp16, bf16, fp8, int8)"
            )),
        }
    }
}

impl KvCacheDtype {
    /// `Auto` as a device stores it (`DeviceKind::auto_kv_dtype`).
    pub fn resolve(self, auto: KvCacheDtype) -> Self {
        match self {
            Self::Auto => auto,
            d => d,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fp32 => "fp32",
            Self::Fp16 => "fp16",
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
            Self::Int8 => "int8",
        }
    }

    /// True for the types stored as 8-bit codes and a scale.
    pub fn is_8bit(self) -> bool {
        matches!(self, Self::Fp8 | Self::Int8)
    }

    /// Bytes one token's K (or V) takes for one KV head of `head_dim` (resolved types).
    pub fn head_bytes(self, head_dim: usize) -> usize {
        match self {
            Self::Fp32 => 4 * head_dim,
            Self::Auto | Self::Fp16 | Self::Bf16 => 2 * head_dim,
            Self::Fp8 | Self::Int8 => head_dim + std::mem::size_of::<f32>(),
        }
    }

    /// Bytes of one KV block: K and V of `block_size` tokens, `kv_heads` heads, over
    /// `num_layers` layers.
    pub fn block_bytes(
        self,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        num_layers: usize,
    ) -> usize {
        2 * num_layers * block_size * kv_heads * self.head_bytes(head_dim)
    }
}
