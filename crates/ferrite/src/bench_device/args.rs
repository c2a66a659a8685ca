//! `ferrite bench device`'s flags.

use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct DeviceBenchArgs {
    /// A Hugging Face config.json; weights are random (`--load-format dummy`).
    pub config: PathBuf,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Decode batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    pub batch: Vec<usize>,
    /// K/V length of every request in the decode measurement.
    #[arg(long, default_value_t = 1024)]
    pub context: usize,
    /// Prompt length of the prefill measurement (one request, one step).
    #[arg(long, default_value_t = 4608)]
    pub prompt_tokens: usize,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 20)]
    pub repeats: usize,
    /// Draft lengths of the speculative verify-step table (each request 1 + k rows).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    pub verify_k: Vec<usize>,
    /// Time the batch-invariant kernels (`ferrite serve --batch-invariant`): every matmul
    /// of the steps (and of the small-row tables) through them, attention unsplit.
    #[arg(long)]
    pub batch_invariant: bool,
}
