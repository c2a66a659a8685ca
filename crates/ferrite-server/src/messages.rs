//! `POST /v1/messages`: Anthropic's Messages API (what Claude Code and the `anthropic` SDK
//! speak), served by the chat pipeline: the request becomes a chat request (system, content
//! blocks, `tool_use` / `tool_result`, tools and `tool_choice`), and the reply's reasoning,
//! text and tool calls come back as `thinking`, `text` and `tool_use` blocks, whole or as
//! Anthropic's stream of events. Errors are Anthropic's JSON.

use crate::chat::{self, Started};
use crate::error::ApiError;
use crate::generation::collect;
use crate::protocol::{random_id, ChatCompletionRequest, Usage};
use crate::reply::ReplyEvent;
use crate::state::SharedState;
use crate::tools::ToolEvent;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrite_core::request::FinishReason;
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use tokio::sync::mpsc;

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub messages: Vec<Value>,
    pub system: Option<Value>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// `{"type": "enabled" | "adaptive" | "disabled"}`: disabled turns a thinking model's
    /// thinking off; the others leave it as the model does by default.
    pub thinking: Option<Value>,
}

/// Anthropic's error body and status for an error of the chat pipeline.
pub fn error(e: ApiError) -> Response {
    let kind = match e.status.as_u16() {
        400 | 405 | 415 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        503 => "overloaded_error",
        _ => "api_error",
    };
    let body = json!({"type": "error", "error": {"type": kind, "message": e.message}});
    (e.status, Json(body)).into_response()
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

/// Text of a `system` or `tool_result` content: a string or text blocks.
fn text_of(v: &Value, what: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| match b.get("type").and_then(Value::as_str) {
                Some("text") => Ok(b.get("text").and_then(Value::as_str).unwrap_or_default()),
                t => Err(bad(format!(
                    "{what}: blocks of type `{}` are not supported (text only)",
                    t.unwrap_or("(none)")
                ))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|t| t.join("\n")),
        Value::Null => Ok(String::new()),
        _ => Err(bad(format!("{what} must be a string or a list of blocks"))),
    }
}

/// One Anthropic message as chat messages: tool results become `tool` turns, `tool_use`
/// blocks the assistant's `tool_calls`.
fn chat_messages(m: &Value, role: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => {
            return Err(bad(
                "messages: content must be a string or a list of blocks",
            ))
        }
    };
    let (mut text, mut calls) = (String::new(), Vec::new());
    for b in blocks {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => {
                text.push_str(b.get("text").and_then(Value::as_str).unwrap_or_default())
            }
            // Earlier thinking is not shown to the model again, as Anthropic's API does.
            Some("thinking" | "redacted_thinking") if role == "assistant" => {}
            Some("tool_use") if role == "assistant" => calls.push(json!({
                "id": b.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {
                    "name": b.get("name").cloned().unwrap_or(Value::Null),
                    "arguments": b.get("input").cloned().unwrap_or(json!({})).to_string(),
                },
            })),
            Some("tool_result") if role == "user" => {
                let mut content = text_of(b.get("content").unwrap_or(&Value::Null), "tool_result")?;
                if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    content = format!("Error: {content}");
                }
                out.push(json!({
                    "role": "tool",
                    "tool_call_id": b.get("tool_use_id").cloned().unwrap_or(Value::Null),
                    "content": content,
                }));
            }
            t => {
                return Err(bad(format!(
                    "messages: {role} content blocks of type `{}` are not supported",
                    t.unwrap_or("(none)")
                )))
            }
        }
    }
    if role == "assistant" {
        out.push(json!({"role": "assistant", "content": text, "tool_calls": calls}));
    } else if !text.is_empty() {
        out.push(json!({"role": "user", "content": text}));
    }
    Ok(())
}

/// The chat request this Messages request asks for.
fn to_chat(req: &MessagesRequest) -> Result<ChatCompletionRequest, ApiError> {
    let max_tokens = req
        .max_tokens
        .ok_or_else(|| bad("`max_tokens` is required").with_param("max_tokens"))?;
    // System text from `system` and from system-role messages, in order (Claude Code sends
    // environment notes as a system message after the user's turn).
    let mut system = Vec::new();
    if let Some(s) = &req.system {
        system.push(text_of(s, "system")?);
    }
    let mut turns = Vec::new();
    for m in &req.messages {
        match m.get("role").and_then(Value::as_str) {
            Some("system") => system.push(text_of(
                m.get("content").unwrap_or(&Value::Null),
                "messages: a system message's content",
            )?),
            Some(role @ ("user" | "assistant")) => chat_messages(m, role, &mut turns)?,
            Some(role) => {
                return Err(bad(format!(
                    "messages: role must be user, assistant or system, got `{role}`"
                )))
            }
            None => return Err(bad("messages: every message needs a `role`")),
        }
    }
    let system: Vec<String> = system
        .iter()
        .map(|s| without_billing_header(s))
        .filter(|s| !s.is_empty())
        .collect();
    let mut messages = Vec::new();
    if !system.is_empty() {
        messages.push(json!({"role": "system", "content": system.join("\n\n")}));
    }
    messages.extend(turns);
    let tools = req
        .tools
        .as_deref()
        .map(chat_tools)
        .transpose()?
        .filter(|t| !t.is_empty());
    let template_kwargs = match req
        .thinking
        .as_ref()
        .map(|t| t.get("type").and_then(Value::as_str))
    {
        None | Some(Some("enabled" | "adaptive")) => None,
        Some(Some("disabled")) => Some(json!({"enable_thinking": false})),
        Some(t) => {
            return Err(bad(format!(
                "thinking.type must be enabled, adaptive or disabled, got {}",
                t.map_or("nothing".into(), |t| format!("`{t}`"))
            ))
            .with_param("thinking"))
        }
    };
    let mut parallel = None;
    let tool_choice = match &req.tool_choice {
        None => None,
        Some(c) => {
            if c.get("disable_parallel_tool_use").and_then(Value::as_bool) == Some(true) {
                parallel = Some(false);
            }
            Some(match c.get("type").and_then(Value::as_str) {
                Some("auto") => json!("auto"),
                Some("any") => json!("required"),
                Some("none") => json!("none"),
                Some("tool") => json!({"type": "function", "function": {"name": c.get("name")}}),
                t => {
                    return Err(ApiError::unknown_type(
                        "tool_choice values",
                        t,
                        "auto, any, none, tool",
                    )
                    .with_param("tool_choice"))
                }
            })
        }
    };
    let chat = json!({
        "model": req.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": template_kwargs,
    });
    serde_json::from_value(chat).map_err(|e| bad(format!("invalid request: {e}")))
}

/// System text without Claude Code's `x-anthropic-billing-header: ...` line: Anthropic's API
/// consumes it (it is no text for the model), and its per-request values at the very start
/// of the prompt would defeat the prefix cache.
fn without_billing_header(text: &str) -> String {
    if !text.contains(BILLING_HEADER) {
        return text.to_string();
    }
    text.lines()
        .filter(|l| !l.trim_start().starts_with(BILLING_HEADER))
        .collect::<Vec<_>>()
        .join("\n")
}

const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// Anthropic's tools as chat tools. Tools the server would run (web search, code execution:
/// a `type` and no `input_schema`) are left out with a log line, as the model cannot call them
/// here.
fn chat_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    for t in tools {
        let name = t.get("name").and_then(Value::as_str);
        let kind = t.get("type").and_then(Value::as_str).unwrap_or("custom");
        match (name, t.get("input_schema")) {
            (Some(name), Some(schema)) => out.push(json!({"type": "function", "function": {
                "name": name,
                "description": t.get("description").cloned().unwrap_or(json!("")),
                "parameters": schema,
            }})),
            _ if kind != "custom" => {
                tracing::info!("tools: `{kind}` is a server tool ferrite does not run; left out")
            }
            _ => {
                return Err(
                    bad("tools: a custom tool needs a `name` and an `input_schema`")
                        .with_param("tools"),
                )
            }
        }
    }
    Ok(out)
}

/// Anthropic's `stop_reason` and `stop_sequence`.
fn stop_reason(
    called: bool,
    finish: Option<FinishReason>,
    stop: Option<&str>,
) -> (&'static str, Value) {
    match (finish, stop) {
        // A reply cut by `max_tokens` says so, calls or not (its last call may be cut).
        (Some(FinishReason::Length), _) => ("max_tokens", Value::Null),
        _ if called => ("tool_use", Value::Null),
        (_, Some(s)) => ("stop_sequence", json!(s)),
        _ => ("end_turn", Value::Null),
    }
}

/// Anthropic's usage: `input_tokens` are the prompt tokens the prefix cache did not serve.
fn usage(u: &Usage) -> Value {
    let cached = u.prompt_tokens_details.cached_tokens;
    json!({"input_tokens": u.prompt_tokens - cached, "cache_read_input_tokens": cached,
           "cache_creation_input_tokens": 0, "output_tokens": u.completion_tokens})
}

pub async fn messages(state: SharedState, req: MessagesRequest) -> Response {
    match run(state, req).await {
        Ok(r) => r,
        Err(e) => error(e),
    }
}

async fn run(state: SharedState, req: MessagesRequest) -> Result<Response, ApiError> {
    let stream = req.stream;
    let mut started = chat::start(&state, to_chat(&req)?).await?;
    let choice = started.choices.pop().expect("one choice");
    let id = random_id("msg");
    if stream {
        return Ok(stream_reply(state, started, choice, id));
    }
    let f = collect(&state, choice).await?;
    let (reasoning, content, calls) = started.reply(&state, &f.text);
    let mut blocks = Vec::new();
    if let Some(r) = reasoning {
        blocks.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if let Some(c) = content.filter(|c| !c.is_empty()) {
        blocks.push(json!({"type": "text", "text": c}));
    }
    for c in &calls {
        let input: Value = serde_json::from_str(&c.function.arguments).unwrap_or(json!({}));
        blocks
            .push(json!({"type": "tool_use", "id": c.id, "name": c.function.name, "input": input}));
    }
    let finish = match f.finish_reason {
        "length" => Some(FinishReason::Length),
        _ => None,
    };
    let (reason, sequence) = stop_reason(!calls.is_empty(), finish, f.stop_str.as_deref());
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": state.model_name,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(&f.usage),
    }))
    .into_response())
}

/// The content block being streamed.
#[derive(PartialEq)]
enum Open {
    None,
    Thinking,
    Text,
    Tool(usize),
}

/// Anthropic's events, in order: `message_start`, per block `content_block_start`, deltas,
/// `content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`.
struct Events {
    tx: mpsc::Sender<(&'static str, Value)>,
    open: Open,
    blocks: usize,
}

impl Events {
    async fn send(&self, name: &'static str, data: Value) -> Result<(), ApiError> {
        self.tx
            .send((name, data))
            .await
            .map_err(|_| ApiError::bad_request("client disconnected"))
    }

    /// Makes `want` the open block, closing the one before; `start`: its opening block.
    async fn switch(&mut self, want: Open, start: Value) -> Result<(), ApiError> {
        if self.open == want {
            return Ok(());
        }
        self.close().await?;
        self.send(
            "content_block_start",
            json!({"type": "content_block_start", "index": self.blocks, "content_block": start}),
        )
        .await?;
        self.open = want;
        Ok(())
    }

    async fn close(&mut self) -> Result<(), ApiError> {
        if self.open != Open::None {
            self.send(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.blocks}),
            )
            .await?;
            self.blocks += 1;
            self.open = Open::None;
        }
        Ok(())
    }

    async fn delta(&self, delta: Value) -> Result<(), ApiError> {
        self.send(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.blocks, "delta": delta}),
        )
        .await
    }

    async fn event(&mut self, e: ReplyEvent) -> Result<bool, ApiError> {
        match e {
            ReplyEvent::Reasoning(r) => {
                let start = json!({"type": "thinking", "thinking": "", "signature": ""});
                self.switch(Open::Thinking, start).await?;
                self.delta(json!({"type": "thinking_delta", "thinking": r}))
                    .await?;
            }
            ReplyEvent::Tool(ToolEvent::Content(t)) => {
                self.switch(Open::Text, json!({"type": "text", "text": ""}))
                    .await?;
                self.delta(json!({"type": "text_delta", "text": t})).await?;
            }
            ReplyEvent::Tool(ToolEvent::Start { index, id, name }) => {
                let start = json!({"type": "tool_use", "id": id, "name": name, "input": {}});
                self.switch(Open::Tool(index), start).await?;
                return Ok(true);
            }
            ReplyEvent::Tool(ToolEvent::Args { text, .. }) => {
                self.delta(json!({"type": "input_json_delta", "partial_json": text}))
                    .await?;
            }
        }
        Ok(false)
    }
}

fn stream_reply(
    state: SharedState,
    started: Started,
    mut choice: crate::generation::Choice,
    id: String,
) -> Response {
    let (tx, rx) = mpsc::channel::<(&'static str, Value)>(64);
    crate::sse::spawn_feeding(&tx.clone(), async move {
        let mut ev = Events {
            tx,
            open: Open::None,
            blocks: 0,
        };
        let run = async {
            ev.send(
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": id, "type": "message", "role": "assistant", "model": state.model_name,
                    "content": [], "stop_reason": null, "stop_sequence": null, "usage": usage(&Usage::default()),
                }}),
            )
            .await?;
            let mut reply = started.stream(&state);
            let mut called = false;
            while let Some(o) = choice.next(&state).await {
                let o = o?;
                for e in reply.push(&o.text, o.finish_reason.is_some()) {
                    called |= ev.event(e).await?;
                }
                if o.finish_reason.is_some() {
                    ev.close().await?;
                    let (reason, sequence) =
                        stop_reason(called, o.finish_reason, o.stop_str.as_deref());
                    ev.send(
                        "message_delta",
                        json!({"type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage(&Usage::of(&o))}),
                    )
                    .await?;
                    return ev
                        .send("message_stop", json!({"type": "message_stop"}))
                        .await;
                }
            }
            Err(ApiError::internal(
                "the engine ended the request without finishing it",
            ))
        };
        if let Err(e) = run.await {
            let body =
                json!({"type": "error", "error": {"type": "api_error", "message": e.message}});
            let _ = ev.tx.send(("error", body)).await;
        }
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        let (name, data) = rx.recv().await?;
        Some((
            Ok::<_, Infallible>(Event::default().event(name).data(data.to_string())),
            rx,
        ))
    });
    (StatusCode::OK, Sse::new(body)).into_response()
}
