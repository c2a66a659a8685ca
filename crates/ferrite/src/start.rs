//! Loads a model with a progress bar and starts the engine thread.

use crate::args::EngineFlags;
use anyhow::Result;
use ferrite_core::engine::EngineHandle;
use ferrite_model::loader::{self, LoadedEngine};
use ferrite_model::pooling::Pooling;
use ferrite_model::tokenizer::ModelTokenizer;
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::Arc;

pub struct Started {
    pub engine: EngineHandle,
    pub tokenizer: Arc<ModelTokenizer>,
    /// Rows of the logits: the vocabulary a grammar's masks cover.
    pub vocab_size: usize,
    /// An embedding model's pooling (`None`: the model generates).
    pub pooling: Option<Pooling>,
}

pub fn start(flags: &EngineFlags) -> Result<Started> {
    flags.check_dtype()?;
    loader::check_device(flags.device)?;
    // A Hugging Face id is found (or downloaded, with its own bars) before loading starts.
    let args = flags.engine_args().resolved()?;
    crate::ranks::enter(&args)?;
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
            .unwrap()
            .progress_chars("=> "),
    );
    bar.set_message(args.model.display().to_string());
    let loaded = loader::load(&args, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    let LoadedEngine {
        runner,
        tokenizer,
        scheduler,
        plan,
        config,
        pooling,
    } = loaded?;
    tracing::info!(
        "model {} ({}, {} layers, {} heads / {} KV heads), max_model_len {}, {}",
        flags.model().display(),
        config.architecture,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        scheduler.max_model_len,
        runner.describe()
    );
    tracing::info!("{plan}");
    let tokenizer = Arc::new(tokenizer);
    let engine = EngineHandle::spawn(
        scheduler,
        runner,
        Arc::new(tokenizer.tokenizer.clone()),
        tokenizer.eos_token_ids.clone(),
    );
    Ok(Started {
        engine,
        tokenizer,
        vocab_size: config.vocab_size,
        pooling,
    })
}
