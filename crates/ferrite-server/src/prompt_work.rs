//! Tokenization and chat-template rendering off the async runtime's workers: a 30 MiB prompt
//! takes seconds of CPU, which on a worker would stall `/health` and every running stream.
//! Text too long to fit the context is refused before it is tokenized.

use crate::error::ApiError;
use crate::state::{AppState, SharedState};

/// A token is never longer than this many bytes of text in the vocabularies ferrite loads
/// (SentencePiece and byte-level BPE pieces stay far below it), so text past
/// `max_model_len` times this cannot fit.
const MAX_BYTES_PER_TOKEN: usize = 128;

/// Most engine requests one HTTP request may start (prompts x `n`).
pub const MAX_CHOICES: usize = 1024;

/// Refuses `text` that could never fit the context, without tokenizing it.
pub fn check_text_len(state: &AppState, text: &str) -> Result<(), ApiError> {
    let max_len = state.engine.info().max_model_len;
    if text.len() > max_len.saturating_mul(MAX_BYTES_PER_TOKEN) {
        return Err(ApiError::bad_request(format!(
            "the prompt is {} bytes, more than a context of {max_len} tokens can hold",
            text.len()
        )));
    }
    Ok(())
}

/// Runs `f` on tokio's blocking pool.
pub async fn off_runtime<T: Send + 'static>(
    state: &SharedState,
    f: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let state = state.clone();
    tokio::task::spawn_blocking(move || f(&state))
        .await
        .map_err(|e| ApiError::internal(format!("tokenization task failed: {e}")))?
}

/// Refuses more than [`MAX_CHOICES`] engine requests for one HTTP request.
pub fn check_choices(prompts: usize, n: usize) -> Result<(), ApiError> {
    if prompts.saturating_mul(n) > MAX_CHOICES {
        return Err(ApiError::bad_request(format!(
            "{prompts} prompts x n = {n} asks for more than {MAX_CHOICES} completions"
        ))
        .with_param("prompt"));
    }
    Ok(())
}
