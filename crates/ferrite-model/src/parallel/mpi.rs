//! The CPU communicator: MPI (Open MPI, through the `mpi` crate), one process per rank as
//! `mpirun` starts them, on one host or across hosts by its host file.

use super::comm::Communicator as Collectives;
use super::group::Group;
use anyhow::{bail, Result};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;
use std::sync::{Arc, Mutex};

/// MPI, once started; ended by [`finish`].
struct Started(Universe);
// SAFETY: the universe is only dropped (MPI_Finalize) through the mutex below, once.
unsafe impl Send for Started {}

static UNIVERSE: Mutex<Option<Started>> = Mutex::new(None);

/// Whether `mpirun` started this process (its world may hold other ranks).
pub fn launched() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() || std::env::var_os("PMI_SIZE").is_some()
}

/// The group [`group`] made.
static GROUP: Mutex<Option<Group>> = Mutex::new(None);

/// Starts MPI and splits its world into `stages` pipeline stages of `tensor_parallel`
/// ranks each (once: later calls give the same group).
pub fn group(tensor_parallel: usize, stages: usize) -> Result<Group> {
    let mut made = GROUP.lock().expect("MPI group");
    if let Some(g) = made.as_ref() {
        if (g.tp.size, g.pp.stages) != (tensor_parallel, stages) {
            bail!(
                "this process is already a rank of a {} x {} split",
                g.tp.size,
                g.pp.stages
            );
        }
        return Ok(g.clone());
    }
    let world = {
        let mut u = UNIVERSE.lock().expect("MPI state");
        if u.is_none() {
            let Some((universe, threading)) = mpi::initialize_with_threading(Threading::Multiple)
            else {
                bail!("MPI was started already in this process");
            };
            if threading < Threading::Serialized {
                bail!("this MPI library gives threads {threading:?} access; ferrite needs serialized calls from any thread");
            }
            *u = Some(Started(universe));
        }
        u.as_ref().expect("started above").0.world()
    };
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    if size != tensor_parallel * stages {
        bail!(
            "tensor-parallel size {tensor_parallel} x pipeline-parallel size {stages} needs {} ranks; mpirun started {size} (`mpirun -n {}`)",
            tensor_parallel * stages,
            tensor_parallel * stages
        );
    }
    let stage = rank / tensor_parallel;
    let tensor = world
        .split_by_color_with_key(Color::with_value(stage as i32), rank as i32)
        .expect("every rank has a colour");
    let host = world.split_shared(rank as i32);
    let g = Group::new(
        Arc::new(Mpi::new(world)),
        Arc::new(Mpi::new(tensor)),
        stages,
        (host.rank() as usize, host.size() as usize),
    )?;
    *made = Some(g.clone());
    Ok(g)
}

/// Ends MPI, after every rank's last collective and before the process exits.
pub fn finish() {
    GROUP.lock().expect("MPI group").take();
    UNIVERSE.lock().expect("MPI state").take();
}

/// One MPI communicator; its calls are serialized (any thread may make them).
struct Mpi {
    inner: Mutex<Inner>,
    rank: usize,
    size: usize,
}

struct Inner {
    /// Freed on drop unless MPI has ended (a group outliving [`finish`]).
    comm: std::mem::ManuallyDrop<SimpleCommunicator>,
    /// The send side of an all-reduce (MPI reduces from one buffer into another).
    scratch: Vec<f32>,
}

// SAFETY: MPI runs with serialized (or multiple) thread support and every call on the
// communicator holds the mutex.
unsafe impl Send for Mpi {}
unsafe impl Sync for Mpi {}

impl Mpi {
    fn new(comm: SimpleCommunicator) -> Self {
        Self {
            rank: comm.rank() as usize,
            size: comm.size() as usize,
            inner: Mutex::new(Inner {
                comm: std::mem::ManuallyDrop::new(comm),
                scratch: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("an MPI call panicked")
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !mpi::environment::is_finalized() {
            // SAFETY: dropped once, here.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.comm) }
        }
    }
}

impl Collectives for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let mut g = self.lock();
        let Inner { comm, scratch } = &mut *g;
        scratch.clear();
        scratch.extend_from_slice(buf);
        comm.all_reduce_into(&scratch[..], buf, SystemOperation::sum());
        Ok(())
    }

    fn gather(&self, root: usize, local: &[f32], out: &mut [f32]) -> Result<()> {
        let g = self.lock();
        let process = g.comm.process_at_rank(root as i32);
        if self.rank == root {
            if out.len() != local.len() * self.size {
                bail!(
                    "gathering {} x {} values into {}",
                    self.size,
                    local.len(),
                    out.len()
                );
            }
            process.gather_into_root(local, out);
        } else {
            process.gather_into(local);
        }
        Ok(())
    }

    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()> {
        let g = self.lock();
        let process = g.comm.process_at_rank(root as i32);
        let mut len = bytes.len() as u64;
        process.broadcast_into(&mut len);
        bytes.resize(len as usize, 0);
        process.broadcast_into(&mut bytes[..]);
        Ok(())
    }

    fn send(&self, to: usize, buf: &[f32]) -> Result<()> {
        self.lock().comm.process_at_rank(to as i32).send(buf);
        Ok(())
    }

    fn abort(&self, code: i32) -> ! {
        // Not through the lock: the failed call may hold it.
        SimpleCommunicator::world().abort(code)
    }

    fn recv(&self, from: usize, buf: &mut [f32]) -> Result<()> {
        let status = self
            .lock()
            .comm
            .process_at_rank(from as i32)
            .receive_into(buf);
        let got = status.count(f32::equivalent_datatype()) as usize;
        if got != buf.len() {
            bail!("rank {from} sent {got} values, {} expected", buf.len());
        }
        Ok(())
    }
}
