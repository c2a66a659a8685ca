//! How the ranks of a split model exchange activations on GPUs: NCCL between devices when
//! every rank on a host has a GPU of its own (cargo feature `nccl`), or through host memory
//! over the group's own communicator (MPI) when ranks share a GPU — NCCL refuses two ranks
//! on one device, and that is how the sharding is tested on a one-GPU machine.

#[cfg(feature = "nccl")]
use super::kernels::ptr;
use crate::parallel::Group;
use anyhow::Result;
#[cfg(feature = "nccl")]
use candle_core::DType;
use candle_core::{Device, Tensor};

pub enum Collectives {
    /// One NCCL communicator over the stage's tensor-parallel ranks, one over every rank.
    #[cfg(feature = "nccl")]
    Nccl {
        tensor: crate::parallel::nccl::Nccl,
        world: crate::parallel::nccl::Nccl,
    },
    /// Copies to the host and the group's communicators.
    Host,
}

impl Collectives {
    /// NCCL when built with it and `own_gpu` (no other rank on this GPU), else host staging.
    pub fn new(g: &Group, device: &Device, own_gpu: bool) -> Result<Self> {
        #[cfg(feature = "nccl")]
        if own_gpu {
            let stream = super::device::cuda(device)?.cuda_stream();
            // NCCL takes the communicator's GPU from the thread's current context.
            stream.context().bind_to_thread()?;
            return Ok(Self::Nccl {
                tensor: crate::parallel::nccl::Nccl::join(g.tensor.as_ref(), &stream)?,
                world: crate::parallel::nccl::Nccl::join(g.world.as_ref(), &stream)?,
            });
        }
        #[cfg(not(feature = "nccl"))]
        let _ = (g, device, own_gpu);
        Ok(Self::Host)
    }

    pub fn describe(&self) -> &'static str {
        match self {
            #[cfg(feature = "nccl")]
            Self::Nccl { .. } => "NCCL",
            Self::Host => "staged through host memory (ranks share a GPU)",
        }
    }

    /// `x` (f32) becomes the sum of every tensor-parallel rank's `x`; the result may be a new
    /// tensor.
    pub fn all_reduce(&self, g: &Group, x: &Tensor) -> Result<Option<Tensor>> {
        match self {
            #[cfg(feature = "nccl")]
            Self::Nccl { tensor, .. } => {
                tensor.all_reduce_sum(ptr(x)?, x.elem_count())?;
                Ok(None)
            }
            Self::Host => {
                let mut v = x.flatten_all()?.to_vec1::<f32>()?;
                g.tensor.all_reduce_sum(&mut v)?;
                Ok(Some(Tensor::from_vec(v, x.shape(), x.device())?))
            }
        }
    }

    /// `x` (f32) to world rank `to`.
    pub fn send(&self, g: &Group, x: &Tensor, to: usize) -> Result<()> {
        match self {
            #[cfg(feature = "nccl")]
            Self::Nccl { world, .. } => world.send(ptr(x)?, x.elem_count(), to),
            Self::Host => g.world.send(to, &x.flatten_all()?.to_vec1::<f32>()?),
        }
    }

    /// `[rows, cols]` f32 from world rank `from`.
    pub fn recv(
        &self,
        g: &Group,
        (rows, cols): (usize, usize),
        from: usize,
        device: &Device,
    ) -> Result<Tensor> {
        match self {
            #[cfg(feature = "nccl")]
            Self::Nccl { world, .. } => {
                let x = Tensor::zeros((rows, cols), DType::F32, device)?;
                world.recv(ptr(&x)?, rows * cols, from)?;
                Ok(x)
            }
            Self::Host => {
                let mut v = vec![0f32; rows * cols];
                g.world.recv(from, &mut v)?;
                Ok(Tensor::from_vec(v, (rows, cols), device)?)
            }
        }
    }
}
