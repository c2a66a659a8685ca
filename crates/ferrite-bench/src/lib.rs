//! ferrite-bench: a closed-loop serving benchmark for any OpenAI-compatible endpoint.

pub mod client;
pub mod dataset;
pub mod report;
pub mod run;
pub mod stats;
