//! Command-line flags shared by the subcommands, named as vLLM names them.

use clap::Args;
use ferrite_core::prefix_hash::HashAlgo;
use ferrite_core::sampling::SamplingParams;
use ferrite_core::spec_decode::{Speculation, SpeculativeConfig};
use ferrite_model::kv_dtype::KvCacheDtype;
use ferrite_model::loader::WeightFormat;
use ferrite_model::loader::{DeviceKind, EngineArgs, LoadFormat, RunnerKind};
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct EngineFlags {
    /// A GGUF file, a Hugging Face folder (config.json, *.safetensors), or a Hugging Face id
    /// read from the local Hugging Face cache: `org/name`, or `org/name:Q4_K_M` for one GGUF
    /// file of the repository.
    #[arg(value_name = "MODEL", required_unless_present = "model_flag")]
    model_arg: Option<PathBuf>,
    /// The model, as a flag (vLLM's `--model`), instead of the positional MODEL.
    #[arg(
        long = "model",
        id = "model_flag",
        value_name = "MODEL",
        conflicts_with = "model_arg"
    )]
    model_flag: Option<PathBuf>,
    /// Branch, tag or commit when MODEL is a Hugging Face id.
    #[arg(long)]
    pub revision: Option<String>,
    /// The Hugging Face cache folder a MODEL id is read from and downloaded into (vLLM's flag; default:
    /// `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`).
    #[arg(long)]
    pub download_dir: Option<PathBuf>,
    /// Longest prompt + output in tokens (default: the model's context length).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Most requests in one step.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one step, shared by prefill chunks and decodes.
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Share of device memory for weights, activations and the KV cache (default: 0.9 of a
    /// GPU's memory; on CPU, 0.25 of RAM).
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Size the KV cache directly, in bytes (overrides --gpu-memory-utilization).
    #[arg(long)]
    pub kv_cache_memory: Option<u64>,
    /// Seed of the engine's random draws for requests without their own seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Threads that run the model (default: the cores this process may use; with several
    /// ranks on one host, its cores shared among them).
    #[arg(long, short = 't', value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// Ranks each layer is split across (heads, MLP width and vocabulary), one process
    /// each, started by `mpirun` (ferrite starts it on this host when not under it).
    #[arg(long, alias = "tp", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub tensor_parallel_size: u16,
    /// Stages the layers are split into, one process (or tensor-parallel group) each; across
    /// hosts, run under `mpirun` with a host file.
    #[arg(long, alias = "pp", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub pipeline_parallel_size: u16,
    /// `native`: quantized weights repacked for ferrite's int8 kernels (on the CPU, what
    /// `auto` picks); `f32`: dequantized to f32 at load (exact activations, 4-8x the memory,
    /// ~7x slower decode).
    /// On CUDA, for GGUF: `native` keeps the blocks (candle's quantized matmuls), `f32`
    /// dequantizes to bf16 (faster), `auto` takes bf16 if it needs at most half the GPU.
    #[arg(long, default_value = "auto", value_parser = parse_weight_format)]
    pub weight_format: WeightFormat,
    /// vLLM's compute type: `auto` (the device's: the int8 path on the CPU, bf16 on CUDA, f16
    /// weights with f32 activations through wgpu),
    /// `float32`/`float` (CPU: f32 weights, as `--weight-format f32`), `bfloat16` (CUDA).
    /// ferrite computes in no float16 type: `float16`/`half` are refused.
    #[arg(long, default_value = "auto", value_parser = parse_dtype)]
    pub dtype: String,
    /// Reuse the KV blocks of earlier requests with the same prefix (on by default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Hash of cached blocks: sha256 (collision-resistant) or builtin (cheap, hits checked
    /// token by token).
    #[arg(long, default_value = "sha256", value_parser = HashAlgo::parse)]
    pub prefix_caching_hash_algo: HashAlgo,
    /// Where the model runs: cpu, cuda[:N] (a build with `--features cuda`), or a GPU through
    /// wgpu: metal (macOS), vulkan, wgpu (the platform's API), each with `:N` for the N-th adapter.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceKind,
    /// `auto`: weights from the model file; `dummy`: random weights from the model's config
    /// alone (benchmarks; `MODEL` may then be a Hugging Face `config.json`).
    #[arg(long, default_value = "auto")]
    pub load_format: LoadFormat,
    /// CUDA: never replay decode steps from captured CUDA graphs.
    #[arg(long)]
    pub enforce_eager: bool,
    /// A request's tokens and logprobs do not depend on what else runs beside it: CUDA takes
    /// ferrite's batch-invariant matmul for every step and unsplit attention (slower than
    /// cuBLAS; bf16 weights). The CPU kernels are batch-invariant always.
    #[arg(long)]
    pub batch_invariant: bool,
    /// Speculative decoding, as vLLM's JSON: `{"method": "ngram", "num_speculative_tokens":
    /// 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 8}`
    /// (drafts from the request's own tokens), or `{"method": "draft_model", "model":
    /// "draft.gguf", "num_speculative_tokens": 3}` (a smaller model with the same tokenizer,
    /// its K/V in the target's blocks), or `{"method": "mtp", "num_speculative_tokens": 1}`
    /// (the checkpoint's own multi-token-prediction head: Qwen3-Next, Qwen3.5); drafts are
    /// verified in the next step.
    #[arg(long, value_parser = parse_speculative_config)]
    pub speculative_config: Option<Speculation>,
    /// What the model serves (vLLM's flag): `generate`, `pooling` (embeddings, scores), or
    /// `auto`: pooling for encoders (BERT) and sentence-transformers embedding models.
    #[arg(long, default_value = "auto")]
    pub runner: RunnerKind,
    /// The longest a step with running decodes should take, in ms (their inter-token
    /// latency): prefill chunks beside decodes are cut to fit, from a cost model fitted at
    /// start-up and refitted from every step; 0 turns it off (chunks take the whole
    /// --max-num-batched-tokens). Default: 2x what the step's decodes alone take, at
    /// least 20 ms.
    #[arg(long)]
    pub max_step_ms: Option<f64>,
    /// How the KV cache stores K and V: `auto` (the device's: fp16 on the CPU, bf16 on
    /// CUDA), `fp16`, `bf16`, or 8 bits with a scale per token and head, `fp8` (e4m3) and
    /// `int8`: 1.9x the tokens in the same memory (CUDA stores bf16, fp8 and int8); `fp32`
    /// (CPU): exact, with `--dtype float32` the exact path end to end.
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: KvCacheDtype,
}

fn parse_speculative_config(s: &str) -> Result<Speculation, String> {
    serde_json::from_str::<SpeculativeConfig>(s)
        .map_err(|e| format!("not a speculative config: {e}"))?
        .resolve()
}

fn parse_dtype(s: &str) -> Result<String, String> {
    match s {
        "auto" | "float32" | "float" | "bfloat16" => Ok(s.into()),
        "float16" | "half" => Err(
            "ferrite computes in no float16 type: `auto` (int8 activations on the CPU, bfloat16 \
             on CUDA), `float32` (CPU) or `bfloat16` (CUDA)"
                .into(),
        ),
        _ => Err(format!(
            "unknown dtype `{s}` (auto, float32, float, bfloat16)"
        )),
    }
}

fn parse_weight_format(s: &str) -> Result<WeightFormat, String> {
    match s {
        "auto" => Ok(WeightFormat::Auto),
        "native" => Ok(WeightFormat::Native),
        "f32" => Ok(WeightFormat::F32),
        _ => Err(format!("unknown weight format `{s}` (auto, native, f32)")),
    }
}

impl EngineFlags {
    /// `--dtype` as this device computes, folded into the weight format.
    pub fn check_dtype(&self) -> anyhow::Result<()> {
        let (dtypes, says) = self.device.dtypes();
        match self.dtype.as_str() {
            "auto" => Ok(()),
            d if !dtypes.contains(&d) => anyhow::bail!(
                "--dtype {d} is not a type the {} backend computes in ({says})",
                self.device.backend_name()
            ),
            "float32" | "float" if self.weight_format == WeightFormat::Native => anyhow::bail!(
                "--dtype {} needs f32 weights, not --weight-format native",
                self.dtype
            ),
            _ => Ok(()),
        }
    }

    /// MODEL, given as the positional or as `--model`.
    pub fn model(&self) -> &std::path::Path {
        let m = self.model_arg.as_ref().or(self.model_flag.as_ref());
        m.expect("clap requires one of them")
    }

    pub fn engine_args(&self) -> EngineArgs {
        EngineArgs {
            model: self.model().to_path_buf(),
            revision: self.revision.clone(),
            download_dir: self.download_dir.clone(),
            max_model_len: self.max_model_len,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            block_size: self.block_size,
            gpu_memory_utilization: self
                .gpu_memory_utilization
                .unwrap_or(self.device.default_memory_utilization()),
            kv_cache_memory: self.kv_cache_memory,
            seed: self.seed,
            threads: self.threads.map(usize::from),
            weight_format: match self.dtype.as_str() {
                "float32" | "float" => WeightFormat::F32,
                _ => self.weight_format,
            },
            prefix_caching: (!self.no_enable_prefix_caching)
                .then_some(self.prefix_caching_hash_algo),
            device: self.device,
            load_format: self.load_format,
            enforce_eager: self.enforce_eager,
            batch_invariant: self.batch_invariant,
            speculation: self.speculative_config.clone(),
            runner: self.runner,
            max_step_ms: self.max_step_ms,
            kv_cache_dtype: self.kv_cache_dtype,
            tensor_parallel_size: self.tensor_parallel_size.into(),
            pipeline_parallel_size: self.pipeline_parallel_size.into(),
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct SamplingFlags {
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub top_k: i64,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    #[arg(long, default_value_t = 256, allow_negative_numbers = true)]
    pub max_tokens: i64,
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub min_tokens: i64,
    /// Per-request seed (reproducible whatever else runs).
    #[arg(long = "sampling-seed")]
    pub sampling_seed: Option<u64>,
    /// Stop string; repeat for several.
    #[arg(long)]
    pub stop: Vec<String>,
    #[arg(long)]
    pub stop_token_ids: Vec<u32>,
    #[arg(long)]
    pub ignore_eos: bool,
}

impl SamplingFlags {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.sampling_seed,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            max_tokens: Some(self.max_tokens),
            min_tokens: self.min_tokens,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            ..SamplingParams::default()
        }
    }
}
