//! ferrite-server: the OpenAI-compatible HTTP API over the engine.

pub mod chat;
pub mod completions;
pub mod connection;
pub mod conversations;
pub mod embeddings;
pub mod error;
pub mod generation;
pub mod generation_config;
pub mod messages;
pub mod metrics;
pub mod prompt_work;
pub mod protocol;
pub mod reasoning;
pub mod reply;
pub mod responses;
pub mod responses_tools;
pub mod sse;
pub mod state;
pub mod structured;
pub mod tools;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use error::ApiError;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use state::SharedState;
use std::sync::atomic::Ordering;

/// Largest request body accepted (413 beyond).
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// Parses a JSON body, turning serde's message into an OpenAI 400 and an oversized body
/// into an OpenAI-shaped 413.
fn parse<T: DeserializeOwned>(body: &Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.as_ref().map_err(|r| ApiError {
        status: r.status(),
        message: format!("{} (limit {MAX_BODY_BYTES} bytes)", r.body_text()),
        kind: "BadRequestError",
        param: None,
    })?;
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

/// CORS as vLLM's `--allowed-origins`, `--allowed-methods`, `--allowed-headers` and
/// `--allow-credentials` set it (each list `*` by default), so browser front-ends can call
/// the API. With credentials, a `*` answers with what the request asked for (as Starlette
/// does: browsers refuse a literal `*` beside credentials).
pub struct Cors {
    pub origins: Vec<String>,
    pub methods: Vec<String>,
    pub headers: Vec<String>,
    pub credentials: bool,
}

/// vLLM's list flags: a JSON list (`'["a", "b"]'`) or comma-separated.
pub fn flag_list(v: &str) -> Vec<String> {
    serde_json::from_str(v).unwrap_or_else(|_| {
        v.split(',')
            .map(|o| o.trim().to_string())
            .filter(|o| !o.is_empty())
            .collect()
    })
}

/// The CORS layer [`cors`] builds, for the binary that serves it.
pub use tower_http::cors::CorsLayer;

pub fn cors(c: &Cors) -> anyhow::Result<CorsLayer> {
    use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin, Any};
    let any = |l: &[String]| l.iter().any(|o| o == "*");
    let values = |flag: &str, l: &[String]| {
        l.iter()
            .map(|o| {
                o.parse::<header::HeaderValue>()
                    .map_err(|e| anyhow::anyhow!("--{flag}: `{o}` is not valid: {e}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()
    };
    let origin = match (any(&c.origins), c.credentials) {
        (true, false) => AllowOrigin::any(),
        (true, true) => AllowOrigin::mirror_request(),
        (false, _) => AllowOrigin::list(values("allowed-origins", &c.origins)?),
    };
    let methods = match (any(&c.methods), c.credentials) {
        (true, false) => AllowMethods::from(Any),
        (true, true) => AllowMethods::mirror_request(),
        (false, _) => {
            let list = c.methods.iter().map(|m| {
                m.parse::<axum::http::Method>()
                    .map_err(|e| anyhow::anyhow!("--allowed-methods: `{m}`: {e}"))
            });
            AllowMethods::list(list.collect::<anyhow::Result<Vec<_>>>()?)
        }
    };
    let headers = match (any(&c.headers), c.credentials) {
        (true, false) => AllowHeaders::from(Any),
        (true, true) => AllowHeaders::mirror_request(),
        (false, _) => {
            let list = c.headers.iter().map(|h| {
                h.parse::<header::HeaderName>()
                    .map_err(|e| anyhow::anyhow!("--allowed-headers: `{h}`: {e}"))
            });
            AllowHeaders::list(list.collect::<anyhow::Result<Vec<_>>>()?)
        }
    };
    Ok(CorsLayer::new()
        .allow_origin(origin)
        .allow_methods(methods)
        .allow_headers(headers)
        .allow_credentials(c.credentials))
}

/// The routes also under `root` (`--root-path`), for a proxy that forwards the prefix.
pub fn with_root_path(router: Router, root: Option<&str>) -> anyhow::Result<Router> {
    let Some(root) = root
        .map(|r| r.trim_end_matches('/'))
        .filter(|r| !r.is_empty())
    else {
        return Ok(router);
    };
    anyhow::ensure!(
        root.starts_with('/'),
        "--root-path `{root}` must start with `/`"
    );
    // The chat page also at `/PREFIX/`, where a browser's address bar usually ends.
    Ok(Router::new()
        .nest(root, router.clone())
        .route(&format!("{root}/"), get(ui))
        .merge(router))
}

/// The chat page.
async fn ui() -> axum::response::Html<&'static str> {
    axum::response::Html(include_str!("ui.html"))
}

pub fn router(state: SharedState) -> Router {
    let v1 = Router::new()
        .route(
            "/v1/chat/completions",
            post(
                |State(s): State<SharedState>, body: Result<Bytes, BytesRejection>| async move {
                    chat::chat_completions(s, parse(&body)?).await
                },
            ),
        )
        .route(
            "/v1/completions",
            post(
                |State(s): State<SharedState>, body: Result<Bytes, BytesRejection>| async move {
                    completions::completions(s, parse(&body)?).await
                },
            ),
        )
        .route(
            "/v1/messages",
            post(
                |State(s): State<SharedState>, body: Result<Bytes, BytesRejection>| async move {
                    match parse(&body) {
                        Ok(req) => messages::messages(s, req).await,
                        Err(e) => messages::error(e),
                    }
                },
            ),
        )
        .route(
            "/v1/responses",
            post(
                |State(s): State<SharedState>, body: Result<Bytes, BytesRejection>| async move {
                    responses::responses(s, parse(&body)?).await
                },
            ),
        )
        .route(
            "/v1/embeddings",
            post(
                |State(s): State<SharedState>, body: Result<Bytes, BytesRejection>| async move {
                    embeddings::embeddings(s, parse(&body)?).await
                },
            ),
        )
        .merge(scoring_routes())
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(v1)
        // A chat page served from the binary (llama.cpp's server has one): it speaks the API
        // above from the browser, so it needs nothing the API does not give.
        .route("/", get(ui))
        .route("/health", get(health))
        .route(
            "/version",
            get(|| async { Json(json!({"version": env!("CARGO_PKG_VERSION")})) }),
        )
        .route("/metrics", get(metrics))
        .route(
            "/openapi.json",
            get(|| async {
                // The API described for generic clients and fuzzers (kept by hand).
                (
                    [(header::CONTENT_TYPE, "application/json")],
                    include_str!("openapi.json"),
                )
            }),
        )
        .fallback(|| async { ApiError::not_found("no such route") })
        .method_not_allowed_fallback(
            |method: axum::http::Method, uri: axum::http::Uri| async move {
                let e = ApiError::method_not_allowed(&method);
                // Anthropic's clients read their own error shape.
                match uri.path() {
                    "/v1/messages" => messages::error(e),
                    _ => e.into_response(),
                }
            },
        )
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// vLLM's score route and its rerank routes (Jina's `/v1/rerank`, Cohere's `/v2/rerank`).
fn scoring_routes() -> Router<SharedState> {
    let score = post(
        |State(s): State<SharedState>, body: Result<Bytes, BytesRejection>| async move {
            embeddings::score(s, parse(&body)?).await
        },
    );
    let rerank = post(
        |State(s): State<SharedState>, body: Result<Bytes, BytesRejection>| async move {
            embeddings::rerank(s, parse(&body)?).await
        },
    );
    Router::new()
        .route("/score", score.clone())
        .route("/v1/score", score)
        .route("/rerank", rerank.clone())
        .route("/v1/rerank", rerank.clone())
        .route("/v2/rerank", rerank)
}

async fn auth(State(s): State<SharedState>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        // OpenAI clients send `Authorization: Bearer`, Anthropic's `x-api-key`.
        let h = req.headers();
        let given = h
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()));
        if given != Some(key.as_str()) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn health(State(s): State<SharedState>) -> Response {
    let st = s.engine.stats();
    let stuck = st
        .step_started
        .map(|t| t.elapsed())
        .filter(|&d| d > s.step_timeout);
    if let Some(d) = stuck {
        return ApiError::unavailable(format!(
            "the engine is wedged: its step has run for {:.0} s (--health-step-timeout {:.0})",
            d.as_secs_f64(),
            s.step_timeout.as_secs_f64()
        ))
        .into_response();
    }
    if st.alive && !s.draining.load(Ordering::Relaxed) {
        StatusCode::OK.into_response()
    } else {
        ApiError::unavailable("the engine is not running").into_response()
    }
}

async fn models(State(s): State<SharedState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": s.model_name, "object": "model", "created": s.created, "owned_by": "ferrite",
        "root": s.model_root, "parent": null, "max_model_len": s.engine.info().max_model_len,
    }]}))
}

async fn metrics(State(s): State<SharedState>) -> Response {
    let body = s
        .metrics
        .render(&s.model_name, &s.engine.stats(), s.engine.info());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn tokenize(
    State(s): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let req: Value = parse(&body)?;
    let tokens = if let Some(p) = req.get("prompt").and_then(Value::as_str) {
        let add = req
            .get("add_special_tokens")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let p = p.to_string();
        prompt_work::off_runtime(&s, move |s| {
            prompt_work::check_text_len(s, &p)?;
            Ok(s.tokenizer.encode(&p, add)?)
        })
        .await?
    } else if req.get("messages").is_some() {
        let chat: protocol::ChatCompletionRequest = parse(&body)?;
        let tools = chat.tools.is_some();
        prompt_work::off_runtime(&s, move |s| chat::render_prompt(s, &chat, tools)).await?
    } else {
        return Err(ApiError::bad_request(
            "give `prompt` (a string) or `messages`",
        ));
    };
    Ok(Json(
        json!({"count": tokens.len(), "max_model_len": s.engine.info().max_model_len, "tokens": tokens}),
    ))
}

async fn detokenize(
    State(s): State<SharedState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    #[derive(serde::Deserialize)]
    struct Req {
        tokens: Vec<u32>,
    }
    let req: Req = parse(&body)?;
    let vocab = s.tokenizer.tokenizer.get_vocab_size(true) as u32;
    if let Some(bad) = req.tokens.iter().find(|&&t| t >= vocab) {
        return Err(ApiError::bad_request(format!(
            "token id {bad} is outside the vocabulary"
        )));
    }
    Ok(Json(
        json!({"prompt": s.tokenizer.decode(&req.tokens, false)?}),
    ))
}

async fn reset_prefix_cache(State(s): State<SharedState>) -> Result<StatusCode, ApiError> {
    s.engine.reset_prefix_cache()?;
    Ok(StatusCode::OK)
}

/// Logs running/waiting/KV usage/throughput every `period` while there is activity.
pub async fn log_stats_periodically(state: SharedState, period: std::time::Duration) {
    let mut last = state.engine.stats();
    let mut t = std::time::Instant::now();
    loop {
        tokio::time::sleep(period).await;
        let s = state.engine.stats();
        let dt = t.elapsed().as_secs_f64();
        let prompt = (s.prompt_tokens_total - last.prompt_tokens_total) as f64 / dt;
        let gen = (s.generation_tokens_total - last.generation_tokens_total) as f64 / dt;
        if s.num_running + s.num_waiting > 0 || prompt > 0.0 || gen > 0.0 {
            let queries = s.prefix_cache_queries - last.prefix_cache_queries;
            let hits = s.prefix_cache_hits - last.prefix_cache_hits;
            let hit_rate = if queries > 0 {
                100.0 * hits as f64 / queries as f64
            } else {
                0.0
            };
            tracing::info!(
                "Avg prompt throughput: {prompt:.1} tokens/s, Avg generation throughput: {gen:.1} tokens/s, \
                 Running: {} reqs, Waiting: {} reqs, GPU KV cache usage: {:.1}%, Prefix cache hit rate: {hit_rate:.1}%, \
                 Preemptions: {}",
                s.num_running,
                s.num_waiting,
                s.kv_usage * 100.0,
                s.num_preemptions
            );
            let drafted = s.spec.num_draft_tokens - last.spec.num_draft_tokens;
            if drafted > 0 {
                let drafts = s.spec.num_drafts - last.spec.num_drafts;
                let accepted = s.spec.num_accepted_tokens - last.spec.num_accepted_tokens;
                let per_pos: Vec<String> = s
                    .spec
                    .accepted_per_pos
                    .iter()
                    .enumerate()
                    .map(|(i, &a)| {
                        let before = last.spec.accepted_per_pos.get(i).copied().unwrap_or(0);
                        format!("{:.3}", (a - before) as f64 / drafts.max(1) as f64)
                    })
                    .collect();
                tracing::info!(
                    "SpecDecoding metrics: Mean acceptance length: {:.2}, Accepted: {accepted} tokens, \
                     Drafted: {drafted} tokens, Per-position acceptance rate: {}, Avg Draft acceptance rate: {:.1}%",
                    1.0 + accepted as f64 / drafts.max(1) as f64,
                    per_pos.join(", "),
                    100.0 * accepted as f64 / drafted as f64
                );
            }
        }
        last = s;
        t = std::time::Instant::now();
    }
}
