//! Which part of the model a rank holds: its heads, columns and vocabulary rows (tensor
//! parallelism) and its layers (pipeline stage).

use anyhow::{bail, Result};
use std::ops::Range;

/// A rank's place in a tensor-parallel group of `size`: which heads, columns and
/// vocabulary rows it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorParallel {
    pub rank: usize,
    pub size: usize,
}

impl TensorParallel {
    pub const ALONE: Self = Self { rank: 0, size: 1 };

    pub fn is_split(&self) -> bool {
        self.size > 1
    }

    /// This rank's query heads of `n`: an equal share, so `n` must divide evenly.
    pub fn heads(&self, n: usize) -> Result<Range<usize>> {
        self.span(n, "attention heads")
    }

    /// This rank's KV heads of `n`: an equal share, or, with more ranks than KV heads, the
    /// one head its query heads read (each KV head replicated on `size / n` ranks).
    pub fn kv_heads(&self, n: usize) -> Result<Range<usize>> {
        if n.is_multiple_of(self.size) {
            return self.heads(n);
        }
        if !self.size.is_multiple_of(n) {
            bail!(
                "{n} KV heads do not split over, or replicate across, tensor-parallel size {}",
                self.size
            );
        }
        let head = self.rank / (self.size / n);
        Ok(head..head + 1)
    }

    /// This rank's equal share of `n` `what` (heads, an MLP's columns).
    pub fn span(&self, n: usize, what: &str) -> Result<Range<usize>> {
        if !n.is_multiple_of(self.size) {
            bail!(
                "{n} {what} do not split over tensor-parallel size {}",
                self.size
            );
        }
        let per = n / self.size;
        Ok(self.rank * per..(self.rank + 1) * per)
    }

    /// Rows of the vocabulary each rank holds: every rank the same count, the last padded
    /// with zero rows, so the logits gather in equal parts.
    pub fn vocab_rows(&self, vocab: usize) -> usize {
        vocab.div_ceil(self.size)
    }

    /// This rank's vocabulary rows (its end may lie past `vocab`: the padding).
    pub fn vocab(&self, vocab: usize) -> Range<usize> {
        let per = self.vocab_rows(vocab);
        self.rank * per..(self.rank + 1) * per
    }
}

/// A rank's pipeline stage of `stages`: the layers it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineStage {
    pub stage: usize,
    pub stages: usize,
}

impl PipelineStage {
    pub const ONLY: Self = Self {
        stage: 0,
        stages: 1,
    };

    pub fn is_first(&self) -> bool {
        self.stage == 0
    }

    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    /// This stage's layers of `n`: contiguous, the earlier stages taking the remainder.
    pub fn layers(&self, n: usize) -> Range<usize> {
        let (per, extra) = (n / self.stages, n % self.stages);
        let start = self.stage * per + self.stage.min(extra);
        start..start + per + usize::from(self.stage < extra)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_split_evenly_and_kv_heads_replicate_past_their_count() {
        let tp = |rank| TensorParallel { rank, size: 4 };
        assert_eq!(tp(1).heads(8).unwrap(), 2..4);
        assert!(tp(0).heads(9).is_err());
        assert_eq!(tp(3).kv_heads(8).unwrap(), 6..8);
        // 2 KV heads over 4 ranks: ranks 0-1 read head 0, ranks 2-3 head 1.
        let kv: Vec<_> = (0..4).map(|r| tp(r).kv_heads(2).unwrap()).collect();
        assert_eq!(kv, [0..1, 0..1, 1..2, 1..2]);
        assert!(tp(0).kv_heads(3).is_err());
        assert_eq!(tp(3).vocab(49153), 36867..49156);
    }

    #[test]
    fn stages_cover_every_layer_once() {
        for (n, stages) in [(30, 4), (2, 2), (7, 3)] {
            let all: Vec<usize> = (0..stages)
                .flat_map(|stage| PipelineStage { stage, stages }.layers(n))
                .collect();
            assert_eq!(all, (0..n).collect::<Vec<_>>());
        }
    }
}
