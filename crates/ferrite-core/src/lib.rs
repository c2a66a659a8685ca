//! ferrite-core: requests, the V1 scheduler, the KV block pool, output processing and the
//! engine loop. Nothing here knows about tensors; the model runner sits behind [`engine::Executor`].

pub mod block_pool;
pub mod constraint;
pub mod detokenizer;
pub mod engine;
pub mod kv_cache_manager;
pub mod kv_layout;
pub mod output;
pub mod prefix_hash;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod spec_decode;
pub mod state_checkpoints;
pub mod state_pool;
pub mod step_cost;
pub mod stop;
