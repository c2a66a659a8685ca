//! `ferrite serve`: the OpenAI-compatible HTTP server.

use crate::args::EngineFlags;
use crate::start::{start, Started};
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use ferrite_model::chat_template::ChatTemplate;
use ferrite_model::tokenizer::ModelTokenizer;
use ferrite_server::metrics::Metrics;
use ferrite_server::reasoning::ReasoningParser;
use ferrite_server::state::AppState;
use ferrite_server::tools::ToolParser;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineFlags,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Name clients use in `model` (default: the model file's stem).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on /v1 routes.
    #[arg(long, env = "FERRITE_API_KEY")]
    pub api_key: Option<String>,
    /// Chat template: a file path or the template text (default: the GGUF's).
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Let the model decide when to call tools (needs --tool-call-parser).
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// How tool calls are read from model output: hermes, llama3_json, mistral, pythonic
    /// (also gemma3's tool_code blocks), qwen3_coder.
    #[arg(long)]
    pub tool_call_parser: Option<String>,
    /// Where the model's thinking goes: deepseek_r1 or qwen3 put the text inside
    /// `<think>...</think>` into `reasoning_content`.
    #[arg(long)]
    pub reasoning_parser: Option<String>,
    /// Origins browsers may call the API from (CORS), as vLLM takes them: a JSON list
    /// (`'["https://a.example"]'`) or comma-separated; `*` (the default) allows any.
    #[arg(long, default_value = "*")]
    pub allowed_origins: String,
    /// Methods browsers may use (CORS), a JSON list or comma-separated; `*` allows any.
    #[arg(long, default_value = "*")]
    pub allowed_methods: String,
    /// Request headers browsers may send (CORS); `*` allows any.
    #[arg(long, default_value = "*")]
    pub allowed_headers: String,
    /// Let browsers send cookies and credentials (CORS).
    #[arg(long)]
    pub allow_credentials: bool,
    /// The path prefix a reverse proxy serves the API under (vLLM's `--root-path`): routes
    /// answer under it as well as without it.
    #[arg(long)]
    pub root_path: Option<String>,
    /// Log each request as it arrives and as it finishes (vLLM's flag; off by default).
    #[arg(long, overrides_with = "disable_log_requests")]
    pub enable_log_requests: bool,
    /// Do not log requests (the default; vLLM's older flag).
    #[arg(long)]
    pub disable_log_requests: bool,
    /// Seconds a shutdown (SIGINT/SIGTERM) waits for in-flight requests and open connections
    /// before exiting anyway; a second signal exits at once.
    #[arg(long, alias = "shutdown-timeout", default_value_t = 30.0)]
    pub drain_timeout: f64,
    /// Most engine requests waiting for their first step; past it a call gets 503 with
    /// `Retry-After` (SGLang's name). High by default: bursts queue, they are not refused.
    #[arg(long, default_value_t = 4096)]
    pub max_queued_requests: usize,
    /// Seconds one model step may run before `/health` calls the engine wedged (503).
    #[arg(long, default_value_t = 300.0, value_parser = seconds)]
    pub health_step_timeout: f64,
    /// Seconds an HTTP connection with no request in flight stays open (vLLM's
    /// VLLM_HTTP_TIMEOUT_KEEP_ALIVE, also 5).
    #[arg(long, default_value_t = 5.0, value_parser = seconds)]
    pub timeout_keep_alive: f64,
    /// Seconds a client has to send a request's headers once it starts.
    #[arg(long, default_value_t = 10.0, value_parser = seconds)]
    pub header_read_timeout: f64,
    /// `vllm` (the default) uses vLLM's sampling defaults; GGUF files carry no generation config.
    #[arg(long, default_value = "vllm")]
    pub generation_config: String,
    /// Server-wide sampling defaults as JSON, vLLM's keys: `temperature`, `top_p`, `top_k`,
    /// `min_p`, `repetition_penalty` (a request's own value wins) and `max_new_tokens` (caps
    /// every request's `max_tokens`).
    #[arg(long, value_name = "JSON")]
    pub override_generation_config: Option<String>,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let (tool_parser, reasoning_parser) = parsers(&args)?;
    if args.generation_config != "vllm" && args.generation_config != "auto" {
        bail!("--generation-config: only `vllm` and `auto` are supported for GGUF models");
    }
    let sampling_defaults = match &args.override_generation_config {
        Some(json) => {
            ferrite_server::generation_config::sampling_defaults(json).map_err(|e| anyhow!(e))?
        }
        None => Default::default(),
    };
    let cors = ferrite_server::cors(&ferrite_server::Cors {
        origins: ferrite_server::flag_list(&args.allowed_origins),
        methods: ferrite_server::flag_list(&args.allowed_methods),
        headers: ferrite_server::flag_list(&args.allowed_headers),
        credentials: args.allow_credentials,
    })?;
    let started = start(&args.engine)?;
    let tok = started.tokenizer.clone();
    let template = chat_template(&args, &tok)?;
    let model_name = args.served_model_name.clone().unwrap_or_else(|| {
        args.engine
            .model()
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let grammars = grammars(&started);
    let state = Arc::new(AppState {
        engine: started.engine.clone(),
        tokenizer: tok.clone(),
        template,
        model_name: model_name.clone(),
        model_root: args.engine.model().display().to_string(),
        api_key: args.api_key.clone(),
        metrics: Metrics::default(),
        tool_parser,
        reasoning_parser,
        enable_auto_tool_choice: args.enable_auto_tool_choice,
        sampling_defaults,
        grammars,
        draining: AtomicBool::new(false),
        max_queued_requests: args.max_queued_requests,
        step_timeout: std::time::Duration::from_secs_f64(args.health_step_timeout),
        log_requests: args.enable_log_requests && !args.disable_log_requests,
        created: ferrite_server::protocol::now(),
        responses: Default::default(),
        embedder: started
            .pooling
            .as_ref()
            .map(|p| ferrite_server::state::Embedder {
                normalize: p.normalize,
                cross_encoder: p.pairs,
            }),
    });
    serve_http(args, state, cors, model_name)
}

/// Serves `state` over HTTP until a signal drains it.
fn serve_http(
    args: ServeArgs,
    state: Arc<AppState>,
    cors: ferrite_server::CorsLayer,
    model_name: String,
) -> Result<()> {
    // Two runtime threads: HTTP and tokenization must not take the compute cores.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        tracing::info!("serving `{model_name}` at http://{addr}/v1");
        tokio::spawn(ferrite_server::log_stats_periodically(
            state.clone(),
            std::time::Duration::from_secs(10),
        ));
        let shutdown_state = state.clone();
        let force = Arc::new(tokio::sync::Notify::new());
        let timeout = std::time::Duration::from_secs_f64(args.drain_timeout.max(0.0));
        let root_path = args.root_path.clone();
        let timeouts = ferrite_server::connection::Timeouts {
            idle: std::time::Duration::from_secs_f64(args.timeout_keep_alive),
            header: std::time::Duration::from_secs_f64(args.header_read_timeout),
        };
        let serve = ferrite_server::connection::serve(
            listener,
            ferrite_server::with_root_path(ferrite_server::router(state), root_path.as_deref())?
                .layer(cors),
            timeouts,
            drain_on_signal(shutdown_state.clone(), force.clone(), timeout),
        );
        tokio::select! {
            _ = serve => tracing::info!("drained; exiting"),
            _ = force.notified() => tracing::warn!("exiting before the drain finished"),
        }
        shutdown_state.engine.shutdown();
        Ok(())
    })
}

/// The tool-call and reasoning parsers the flags name.
fn parsers(args: &ServeArgs) -> Result<(Option<ToolParser>, Option<ReasoningParser>)> {
    let tool_parser = match &args.tool_call_parser {
        Some(name) => Some(ToolParser::from_name(name).ok_or_else(|| {
            anyhow!(
                "unknown --tool-call-parser `{name}` (known: {})",
                ToolParser::NAMES
            )
        })?),
        None => None,
    };
    let reasoning_parser = match &args.reasoning_parser {
        Some(name) => Some(ReasoningParser::from_name(name).ok_or_else(|| {
            anyhow!(
                "unknown --reasoning-parser `{name}` (known: {})",
                ReasoningParser::NAMES
            )
        })?),
        None => None,
    };
    if args.enable_auto_tool_choice && tool_parser.is_none() {
        bail!("--enable-auto-tool-choice needs --tool-call-parser");
    }
    Ok((tool_parser, reasoning_parser))
}

/// The chat template: `--chat-template`'s file or text, else the model's own.
fn chat_template(args: &ServeArgs, tok: &ModelTokenizer) -> Result<Option<ChatTemplate>> {
    let source = match &args.chat_template {
        Some(t) if std::path::Path::new(t).is_file() => {
            Some(std::fs::read_to_string(t).with_context(|| format!("reading chat template {t}"))?)
        }
        Some(t) => Some(t.clone()),
        None => tok.chat_template.clone(),
    };
    let text_of = |id: Option<u32>| id.map(|i| tok.token_text(i)).unwrap_or_default();
    source
        .map(|s| {
            ChatTemplate::new(
                &s,
                text_of(tok.bos_token_id),
                text_of(tok.eos_token_ids.first().copied()),
            )
        })
        .transpose()
}

/// Structured output's grammars for the model's vocabulary (none for an embedding model).
fn grammars(started: &Started) -> Result<Arc<ferrite_grammar::Grammars>, String> {
    let tok = &started.tokenizer;
    let t0 = std::time::Instant::now();
    match started.pooling {
        // An embedding model generates nothing for a grammar to constrain.
        Some(_) => Err("an embedding model generates no text".into()),
        None => {
            let g = ferrite_grammar::Grammars::new(
                &tok.tokenizer,
                started.vocab_size,
                &tok.eos_token_ids,
            )
            .map(Arc::new)
            .map_err(|e| format!("{e:#}"));
            match &g {
                Ok(_) => tracing::info!(
                    "structured output (llguidance) ready in {:.2} s",
                    t0.elapsed().as_secs_f64()
                ),
                Err(e) => tracing::warn!("structured output unavailable: {e}"),
            }
            g
        }
    }
}

/// A positive, finite number of seconds.
fn seconds(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a positive number of seconds")),
    }
}

/// On SIGINT or SIGTERM: refuse new requests, let in-flight ones finish, then return so the
/// server closes once their responses are sent. A second signal, or `timeout` after the
/// first (a client that never finishes its request would otherwise hold the server open),
/// wakes `force`.
async fn drain_on_signal(
    state: Arc<AppState>,
    force: Arc<tokio::sync::Notify>,
    timeout: std::time::Duration,
) {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
            _ = tokio::time::sleep(timeout) => {}
        }
        force.notify_one();
    });
    state.draining.store(true, Ordering::Relaxed);
    let s = state.engine.stats();
    tracing::info!(
        "shutting down: draining {} running and {} waiting requests",
        s.num_running,
        s.num_waiting
    );
    loop {
        let s = state.engine.stats();
        if s.num_running + s.num_waiting == 0 || !s.alive {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
