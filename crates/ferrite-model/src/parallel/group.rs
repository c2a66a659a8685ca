//! The ranks of one parallel model: world rank 0 leads (it runs the scheduler and sends
//! every command), the others follow; each knows its pipeline stage and its place in the
//! stage's tensor-parallel group.

use super::comm::Communicator;
use super::shard::{PipelineStage, TensorParallel};
use crate::step::PackedStep;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::sync::Arc;

#[derive(Clone)]
pub struct Group {
    /// Every rank, stage by stage: rank `stage * tp.size + tp.rank`.
    pub world: Arc<dyn Communicator>,
    /// This stage's tensor-parallel ranks.
    pub tensor: Arc<dyn Communicator>,
    pub tp: TensorParallel,
    pub pp: PipelineStage,
    /// Ranks on this host (they share its cores and memory).
    pub local_ranks: usize,
    /// This rank's place among them (which GPU it takes).
    pub local_rank: usize,
}

/// What the leader has every rank do, in order.
#[derive(Debug, Serialize, Deserialize)]
pub enum Command<'a> {
    AllocateCache { blocks: usize, block_size: usize },
    AllocateState { slots: usize },
    Step(Box<Cow<'a, PackedStep>>),
    Stop,
}

impl Group {
    /// The group of `world` split into `stages` pipeline stages, `tensor` being this
    /// rank's stage (its ranks in tensor-parallel order).
    pub fn new(
        world: Arc<dyn Communicator>,
        tensor: Arc<dyn Communicator>,
        stages: usize,
        (local_rank, local_ranks): (usize, usize),
    ) -> Result<Self> {
        let tp = TensorParallel {
            rank: tensor.rank(),
            size: tensor.size(),
        };
        if tp.size * stages != world.size() {
            bail!(
                "{} ranks for tensor-parallel size {} x pipeline-parallel size {stages}",
                world.size(),
                tp.size
            );
        }
        let pp = PipelineStage {
            stage: world.rank() / tp.size,
            stages,
        };
        Ok(Self {
            world,
            tensor,
            tp,
            pp,
            local_ranks: local_ranks.max(1),
            local_rank,
        })
    }

    pub fn leads(&self) -> bool {
        self.world.rank() == 0
    }

    /// The world rank of tensor-parallel rank `rank` of `stage`.
    pub fn world_rank(&self, stage: usize, rank: usize) -> usize {
        stage * self.tp.size + rank
    }

    /// Sends `c` from the leader to every rank.
    pub fn command(&self, c: &Command) -> Result<()> {
        let mut bytes = serde_json::to_vec(c)?;
        self.world.broadcast(0, &mut bytes)
    }

    /// The leader's next command (on a follower).
    pub fn next_command(&self) -> Result<Command<'static>> {
        let mut bytes = Vec::new();
        self.world.broadcast(0, &mut bytes)?;
        serde_json::from_slice(&bytes).context("a command from the leading rank")
    }
}
