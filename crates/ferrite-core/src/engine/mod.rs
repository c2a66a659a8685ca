//! The engine loop: schedule, execute, update, stream — on a thread of its own, driven by
//! commands from any number of async clients through [`EngineHandle`]. `core` runs the steps
//! and turns their results into request outputs; `handle` is the thread and its clients.

mod contract;
mod core;
mod handle;

pub use self::core::EngineCore;
pub use contract::{EngineError, EngineStats, ExecError, Executor, ITERATION_TOKEN_BUCKETS};
pub use handle::{EngineHandle, EngineInfo, RequestStream};
