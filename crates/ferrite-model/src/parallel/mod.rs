//! Tensor and pipeline parallelism: which part of the model a rank holds, and the
//! communicator its collectives go through. Every rank runs the same family code on its
//! shard; the model code calls `all_reduce` / `send` / `recv` through the backend, which
//! holds a [`Communicator`] of whatever library serves its device (MPI on CPUs; on GPUs
//! NCCL, with MPI starting the ranks).

mod comm;
pub mod group;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod shard;

use anyhow::Result;

pub use comm::Communicator;
pub use group::Group;
pub use shard::{PipelineStage, TensorParallel};

/// This process's rank of a model split `tensor` x `stages` ways (`None`: it runs whole
/// here); the same group on every call.
pub fn join(tensor: usize, stages: usize) -> Result<Option<Group>> {
    if tensor * stages <= 1 {
        return Ok(None);
    }
    #[cfg(feature = "mpi")]
    return mpi::group(tensor, stages).map(Some);
    #[cfg(not(feature = "mpi"))]
    anyhow::bail!(
        "--tensor-parallel-size {tensor} --pipeline-parallel-size {stages}: this ferrite was built without MPI (build with `--features mpi`; it needs Debian's libopenmpi-dev, openmpi-bin and libclang-dev)"
    )
}

/// Ends the ranks' communication (MPI, if started), before the process exits.
pub fn finish() {
    #[cfg(feature = "mpi")]
    mpi::finish();
}
