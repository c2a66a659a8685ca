//! The CPU backend: the Llama model and its KV cache in RAM, run on a dedicated thread pool.

use crate::kv_cache::KvCache;
use crate::llama::LlamaModel;
use crate::quant::Isa;
use crate::runner::StepModel;
use crate::step::PackedStep;
use anyhow::Result;

pub struct CpuModel {
    pub model: LlamaModel,
    pub cache: KvCache,
    /// The threads that run steps: the forward pass starts on one of them, so its parallel
    /// ops split work by stealing instead of handing every op to the pool from outside
    /// (a wake-up per op); the HTTP side and tokenization never run here.
    compute: rayon::ThreadPool,
}

impl CpuModel {
    /// `threads`: compute threads (default: the cores this process may use).
    pub fn new(model: LlamaModel, cache: KvCache, threads: Option<usize>) -> Self {
        let threads =
            threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let compute = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ferrite-compute-{i}"))
            .build()
            .expect("compute thread pool");
        Self {
            model,
            cache,
            compute,
        }
    }
}

impl StepModel for CpuModel {
    fn forward(&mut self, step: &PackedStep) -> Result<&mut [f32]> {
        let (model, cache) = (&mut self.model, &mut self.cache);
        self.compute.install(|| model.forward(step, cache))
    }

    fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    fn describe(&self) -> String {
        format!(
            "backend cpu ({} threads, weights {:?}), kernels: {}",
            self.compute.current_num_threads(),
            self.model.format,
            Isa::detect().name()
        )
    }
}
