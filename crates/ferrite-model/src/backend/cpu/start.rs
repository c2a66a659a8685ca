//! Start-up on the CPU: memory is the host's (shared among the ranks there), a step's
//! memory is the process's peak resident set while it runs.

use super::CpuBackend;
use crate::engine_args::EngineArgs;
use crate::memory;
use crate::models::Model;
use crate::parallel::Group;
use crate::pooling::Pooling;
use crate::start::Startup;
use crate::step::{PackedStep, StepModel};
use crate::weights::WeightSource;
use anyhow::Result;

pub struct CpuStart {
    /// This rank's part of the host's memory.
    memory: u64,
}

impl Startup for CpuStart {
    type Backend = CpuBackend;

    fn open(_args: &EngineArgs, group: Option<&Group>) -> Result<Self> {
        let local_ranks = group.map_or(1, |g| g.local_ranks) as u64;
        Ok(Self {
            memory: memory::physical_memory_bytes()? / local_ranks,
        })
    }

    fn check(args: &EngineArgs, _pooling: Option<&Pooling>) -> Result<()> {
        if args.batch_invariant {
            tracing::info!("--batch-invariant: the CPU kernels are batch-invariant already (a token's result never depends on what shares its step)");
        }
        Ok(())
    }

    fn memory_bytes(&self) -> u64 {
        self.memory
    }

    fn backend(
        &mut self,
        args: &EngineArgs,
        _weights: &WeightSource,
        group: Option<Group>,
    ) -> Result<CpuBackend> {
        Ok(match group {
            Some(g) => {
                // Ranks on one host share its cores.
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                let threads = args.threads.unwrap_or((cores / g.local_ranks).max(1));
                CpuBackend::new(args.weight_format, Some(threads)).in_group(g)
            }
            None => CpuBackend::new(args.weight_format, args.threads),
        })
    }

    fn draft_backend(&self, args: &EngineArgs, main: &CpuBackend) -> Result<CpuBackend> {
        Ok(main.sharing_threads(args.weight_format))
    }

    fn measure_step(model: &mut Model<CpuBackend>, step: &PackedStep) -> Result<u64> {
        let before = memory::rss_bytes();
        let measured = memory::reset_peak_rss();
        model.forward(step)?;
        let peak = memory::peak_rss_bytes();
        Ok(match measured && peak > before {
            true => peak - before,
            // Without a resettable peak counter, estimate from the buffers a step allocates.
            false => memory::activation_estimate(&model.config, step.input_ids.len()),
        })
    }
}
