//! Server-sent events: every choice of a call is driven by one task that feeds a channel;
//! the HTTP body reads it. When the client goes away the body and its end of the channel are
//! dropped, and the task with it at once ([`spawn_feeding`]): dropping its engine streams
//! aborts the requests, also those still queued with nothing sent yet.

use crate::error::ApiError;
use crate::generation::Choice;
use crate::protocol::Usage;
use crate::state::SharedState;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::Value;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Wraps choice deltas into the endpoint's chunk object (`usage` given only for the last).
pub type WrapChunk = Arc<dyn Fn(Vec<Value>, Option<Value>) -> Value + Send + Sync>;

#[derive(Clone)]
pub struct ChunkSink {
    tx: mpsc::Sender<String>,
    wrap: WrapChunk,
    include_usage: bool,
}

impl ChunkSink {
    pub async fn send_choice(&self, choice: impl Serialize) -> Result<(), ApiError> {
        let choice = serde_json::to_value(choice).map_err(|e| ApiError::internal(e.to_string()))?;
        // With include_usage, OpenAI sends `"usage": null` on every chunk but the last.
        let usage = self.include_usage.then_some(Value::Null);
        let chunk = (self.wrap)(vec![choice], usage);
        self.tx
            .send(chunk.to_string())
            .await
            .map_err(|_| ApiError::bad_request("client disconnected"))
    }
}

/// Runs `work`, which feeds `tx`, on its own task until it ends or the receiver is dropped
/// (the client left): then `work` is dropped at once, whether or not it had anything to send.
pub fn spawn_feeding<T: Send + 'static>(
    tx: &mpsc::Sender<T>,
    work: impl Future<Output = ()> + Send + 'static,
) {
    let watch = tx.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = work => {}
            _ = watch.closed() => {}
        }
    });
}

pub fn sse_response<F, Fut>(
    state: SharedState,
    choices: Vec<Choice>,
    include_usage: bool,
    per_choice: F,
    wrap: WrapChunk,
) -> Response
where
    F: Fn(SharedState, Choice, ChunkSink) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Usage, ApiError>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<String>(64);
    let sink = ChunkSink {
        tx: tx.clone(),
        wrap: wrap.clone(),
        include_usage,
    };
    spawn_feeding(&tx.clone(), async move {
        let runs = choices
            .into_iter()
            .map(|c| per_choice(state.clone(), c, sink.clone()));
        let results = futures_util::future::join_all(runs).await;
        let mut usage: Option<Usage> = None;
        for r in results {
            match r {
                Ok(u) => {
                    usage = Some(match usage {
                        None => u,
                        Some(all) => all.and(&u),
                    })
                }
                Err(e) => {
                    let _ = tx.send(e.body().to_string()).await;
                    let _ = tx.send("[DONE]".into()).await;
                    return;
                }
            }
        }
        if include_usage {
            let usage = serde_json::to_value(usage.unwrap_or_default()).unwrap();
            let _ = tx.send(wrap(vec![], Some(usage)).to_string()).await;
        }
        let _ = tx.send("[DONE]".into()).await;
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        let data = rx.recv().await?;
        Some((Ok::<_, Infallible>(Event::default().data(data)), rx))
    });
    Sse::new(body).into_response()
}
