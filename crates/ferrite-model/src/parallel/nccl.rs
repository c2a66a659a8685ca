//! The GPU communicator (cargo feature `nccl`): NCCL through cudarc's bindings, one process
//! per GPU as `mpirun` starts them; MPI carries NCCL's unique id to every rank and the
//! leader's commands. Collectives run on ferrite's one stream, in its order, so they need no
//! synchronisation of their own and can be captured in a CUDA graph.
//! NVLink multicast (NVLS) stays off: on shared hosts it can take the GPUs out of service.

use super::comm::Communicator;
use anyhow::{bail, Result};
use candle_core::cuda::cudarc::driver::CudaStream;
use candle_core::cuda::cudarc::nccl::{result, sys};
use std::ffi::c_void;

/// One NCCL communicator over the ranks of a group, on one stream.
pub struct Nccl {
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
    rank: usize,
}

// SAFETY: the communicator is used from the engine's thread only, one call at a time, as
// NCCL requires; the handle itself is a plain pointer NCCL owns.
unsafe impl Send for Nccl {}
unsafe impl Sync for Nccl {}

impl Nccl {
    /// Every rank of `ranks` (the group's host communicator) joins one NCCL communicator:
    /// rank 0 makes the unique id, the others receive it over `ranks`.
    pub fn join(ranks: &dyn Communicator, stream: &CudaStream) -> Result<Self> {
        // SAFETY: set before NCCL reads its environment (at the first communicator).
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
        }
        let mut id = match ranks.rank() {
            0 => result::get_uniqueid()
                .map_err(|e| anyhow::anyhow!("ncclGetUniqueId: {e:?}"))?
                .internal
                .iter()
                .map(|&c| c as u8)
                .collect(),
            _ => Vec::new(),
        };
        ranks.broadcast(0, &mut id)?;
        let Ok(bytes) = <[u8; 128]>::try_from(id.as_slice()) else {
            bail!("an NCCL unique id of {} bytes", id.len());
        };
        let id = sys::ncclUniqueId {
            internal: bytes.map(|b| b as std::ffi::c_char),
        };
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL before it is read; every rank calls this with the
        // same id and size.
        let comm = unsafe {
            result::comm_init_rank(
                comm.as_mut_ptr(),
                ranks.size() as i32,
                id,
                ranks.rank() as i32,
            )
            .map_err(|e| anyhow::anyhow!("ncclCommInitRank: {e:?}"))?;
            comm.assume_init()
        };
        Ok(Self {
            comm,
            stream: stream.cu_stream() as sys::cudaStream_t,
            rank: ranks.rank(),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// `count` f32 at `ptr` (device memory) become their sum over every rank, in place.
    pub fn all_reduce_sum(&self, ptr: u64, count: usize) -> Result<()> {
        let buf = ptr as *mut c_void;
        // SAFETY: `ptr` holds `count` f32 on this rank's GPU, alive until the stream reaches
        // this call (ferrite frees tensors in stream order).
        unsafe {
            result::all_reduce(
                buf,
                buf,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                self.stream,
            )
        }
        .map_err(|e| anyhow::anyhow!("ncclAllReduce: {e:?}"))?;
        Ok(())
    }

    /// `count` f32 at `ptr` to rank `to`.
    pub fn send(&self, ptr: u64, count: usize, to: usize) -> Result<()> {
        // SAFETY: as in `all_reduce_sum`.
        unsafe {
            result::send(
                ptr as *const c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                to as i32,
                self.comm,
                self.stream,
            )
        }
        .map_err(|e| anyhow::anyhow!("ncclSend: {e:?}"))?;
        Ok(())
    }

    /// `count` f32 from rank `from` into `ptr`.
    pub fn recv(&self, ptr: u64, count: usize, from: usize) -> Result<()> {
        // SAFETY: as in `all_reduce_sum`.
        unsafe {
            result::recv(
                ptr as *mut c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                from as i32,
                self.comm,
                self.stream,
            )
        }
        .map_err(|e| anyhow::anyhow!("ncclRecv: {e:?}"))?;
        Ok(())
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: the communicator is not used after this.
        if let Err(e) = unsafe { result::comm_destroy(self.comm) } {
            tracing::warn!("ncclCommDestroy: {e:?}");
        }
    }
}
