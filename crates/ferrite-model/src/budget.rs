//! The memory plan the settings imply: the KV pool sized from the device's memory once
//! weights, activations and recurrent state are counted, and the scheduler configuration
//! that hands it out.

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::engine_args::EngineArgs;
use crate::memory::{self, DraftShare, MemoryPlan, PlanInputs};
use crate::models::Model;
use anyhow::Result;
use ferrite_core::kv_layout::KvLayout;
use ferrite_core::scheduler::SchedulerConfig;

/// What a loaded model takes besides its KV pool, for [`EngineArgs::plan`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ModelBytes {
    pub weights: u64,
    pub activations: u64,
    /// One request's recurrent state (0 without linear-attention layers).
    pub state_per_slot: u64,
    /// A draft model's weights and K/V per block (speculation with a draft model).
    pub draft: Option<DraftShare>,
    /// Layers of a page this rank stores (a pipeline stage's); `None`: all.
    pub kv_slots: Option<usize>,
    /// The most bytes one layer's pages may take (a GPU's largest storage binding).
    pub layer_pages_limit: Option<u64>,
}

impl EngineArgs {
    /// Bytes of one KV block of a model with this config, `slots` layers a block.
    pub(crate) fn kv_block_bytes(&self, config: &ModelConfig, slots: usize) -> u64 {
        self.kv_cache_dtype
            .resolve(self.device.auto_kv_dtype())
            .block_bytes(self.block_size, config.num_kv_heads, config.head_dim, slots)
            as u64
    }

    /// The draft model's weights, and its K/V in each of the target's blocks.
    pub fn draft_share<B: Backend>(&self, draft: &Model<B>) -> DraftShare {
        DraftShare {
            weight_bytes: draft.weight_bytes() as u64,
            bytes_per_block: self.kv_block_bytes(&draft.config, draft.layout.slots),
        }
    }

    /// Requests that speculate at once (at most the batch size speculation pauses above):
    /// with recurrent state, each holds `k` more state slots.
    fn draft_state_sets(&self) -> usize {
        self.speculation
            .as_ref()
            .map_or(0, |s| s.disable_by_batch_size.min(self.max_num_seqs))
    }

    /// The KV pool sized from `device_bytes` of memory once weights and activations are
    /// counted, and the scheduler configuration that hands it out.
    pub(crate) fn plan(
        &self,
        config: &ModelConfig,
        max_model_len: usize,
        device_bytes: u64,
        bytes: ModelBytes,
    ) -> Result<(MemoryPlan, SchedulerConfig)> {
        let layout = KvLayout::new(&config.layer_windows);
        let draft = bytes.draft.unwrap_or(DraftShare {
            weight_bytes: 0,
            bytes_per_block: 0,
        });
        // A pipeline stage stores the pages of its own layers.
        let slots = bytes.kv_slots.unwrap_or(layout.slots);
        let bytes_per_block = self.kv_block_bytes(config, slots) + draft.bytes_per_block;
        let state_bytes_per_slot = bytes.state_per_slot;
        let layer_block = self.kv_block_bytes(config, 1).max(1);
        let plan = memory::plan(&PlanInputs {
            max_blocks: bytes
                .layer_pages_limit
                .map(|limit| (limit / layer_block) as usize),
            device_bytes,
            utilization: self.gpu_memory_utilization,
            kv_cache_memory: self.kv_cache_memory,
            weight_bytes: bytes.weights + draft.weight_bytes,
            activation_bytes: bytes.activations,
            bytes_per_block,
            kv_dtype: self.kv_cache_dtype.resolve(self.device.auto_kv_dtype()),
            block_size: self.block_size,
            max_model_len,
            max_num_seqs: self.max_num_seqs,
            kv_groups: layout.groups.clone(),
            layers_per_block: slots,
            chunk: self.max_num_batched_tokens,
            state_bytes_per_slot,
            // A hit restores the recurrent state from a checkpoint: as many as requests.
            state_checkpoints: match self.prefix_caching {
                Some(_) => self.max_num_seqs,
                None => 0,
            },
            state_draft_slots: self.draft_state_sets()
                * self.speculation.as_ref().map_or(0, |s| s.k),
            draft: bytes.draft,
        })?;
        let scheduler = SchedulerConfig {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            max_model_len,
            block_size: self.block_size,
            num_blocks: plan.num_blocks,
            prefix_caching: self.prefix_caching,
            kv_groups: layout.groups,
            state_slots: plan.state_slots,
            state_checkpoints: plan.state_checkpoints,
            whole_prompts: false,
            step_time: None,
            speculation: self.speculation.clone(),
            draft_state_sets: match plan.state_slots {
                0 => 0,
                _ => self.draft_state_sets(),
            },
        };
        Ok((plan, scheduler))
    }
}
