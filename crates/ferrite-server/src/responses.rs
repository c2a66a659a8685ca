//! `POST /v1/responses`: OpenAI's Responses API (what Codex speaks), served by the chat
//! pipeline. Input items (messages, `function_call`, `function_call_output`) and the
//! conversation of `previous_response_id` become a chat request; the reply comes back as
//! `reasoning`, `message` and `function_call` output items, whole or as the Responses event
//! stream. Conversations are kept in memory for the server's lifetime (the last
//! [`crate::conversations::KEPT_RESPONSES`]), so a client can continue one by id.

use crate::chat::{self, Started};
use crate::error::ApiError;
use crate::generation::{collect, Choice};
use crate::protocol::{now, random_id, ChatCompletionRequest, Usage};
use crate::reply::ReplyEvent;
use crate::responses_tools::{chat_tools, flat_name, namespaces, split_name};
use crate::state::SharedState;
use crate::tools::ToolEvent;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use tokio::sync::mpsc;

#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    pub input: Value,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    #[serde(default)]
    pub stream: bool,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub previous_response_id: Option<String>,
    pub store: Option<bool>,
    pub text: Option<Value>,
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

/// Text of a message's content: a string or `input_text` / `output_text` parts.
fn text_of(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p.get("type").and_then(Value::as_str) {
                Some("input_text" | "output_text" | "text") => {
                    Ok(p.get("text").and_then(Value::as_str).unwrap_or_default())
                }
                t => Err(ApiError::unknown_type(
                    "input content parts",
                    t,
                    "text: input_text, output_text",
                )
                .with_param("input")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|t| t.concat()),
        _ => Err(bad(
            "input: a message's content must be a string or a list of parts",
        )),
    }
}

/// Input items as chat messages; a run of `function_call` items is one assistant turn.
fn input_messages(input: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let items = match input {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(items) => items,
        _ => return Err(bad("`input` must be a string or a list of items").with_param("input")),
    };
    for item in items {
        match item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message")
        {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("user");
                let content = text_of(item.get("content").unwrap_or(&Value::Null))?;
                match (role, out.last_mut()) {
                    // Consecutive user messages are one turn (Codex sends its environment
                    // and the prompt apart): templates that alternate roles refuse two.
                    ("user", Some(last)) if last["role"] == "user" => {
                        let joined =
                            format!("{}\n\n{content}", last["content"].as_str().unwrap_or(""));
                        last["content"] = json!(joined);
                    }
                    _ => out.push(json!({"role": role, "content": content})),
                }
            }
            "function_call" => {
                let call = json!({"id": item.get("call_id"), "type": "function", "function": {
                    "name": flat_name(item), "arguments": item.get("arguments").and_then(Value::as_str).unwrap_or("{}"),
                }});
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" && m["tool_calls"].is_array() => {
                        m["tool_calls"].as_array_mut().unwrap().push(call)
                    }
                    _ => {
                        out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}))
                    }
                }
            }
            "function_call_output" => out.push(json!({
                "role": "tool",
                "tool_call_id": item.get("call_id"),
                "content": match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => text_of(other)?,
                    None => String::new(),
                },
            })),
            // Earlier reasoning is not shown to the model again.
            "reasoning" => {}
            t => {
                return Err(bad(format!("input: items of type `{t}` are not supported"))
                    .with_param("input"))
            }
        }
    }
    Ok(())
}

/// The chat request, and the conversation so far (without the reply).
fn to_chat(
    state: &SharedState,
    req: &ResponsesRequest,
) -> Result<(ChatCompletionRequest, Vec<Value>), ApiError> {
    let mut conversation = match &req.previous_response_id {
        Some(id) => state.responses.get(id).ok_or_else(|| {
            ApiError::not_found(format!(
                "no response `{id}` (responses are kept in memory while the server runs)"
            ))
        })?,
        None => Vec::new(),
    };
    input_messages(&req.input, &mut conversation)?;
    // Instructions, then system and developer messages, in order, are the system text.
    let mut system: Vec<String> = req.instructions.iter().cloned().collect();
    let mut turns = Vec::new();
    for m in &conversation {
        match m["role"].as_str() {
            Some("system" | "developer") => {
                system.push(m["content"].as_str().unwrap_or_default().to_string())
            }
            _ => turns.push(m.clone()),
        }
    }
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
    let tool_choice = req.tool_choice.as_ref().map(|c| match c.get("name") {
        Some(name) => json!({"type": "function", "function": {"name": name}}),
        None => c.clone(),
    });
    let response_format = match req.text.as_ref().and_then(|t| t.get("format")) {
        None => None,
        Some(f) => match f.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(json!({"type": "json_object"})),
            Some("json_schema") => Some(json!({"type": "json_schema", "json_schema": {
                "name": f.get("name"), "schema": f.get("schema"), "strict": f.get("strict"),
            }})),
            t => {
                return Err(ApiError::unknown_type(
                    "text.format values",
                    t,
                    "text, json_object, json_schema",
                )
                .with_param("text"))
            }
        },
    };
    let chat = json!({
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format,
    });
    let chat = serde_json::from_value(chat).map_err(|e| bad(format!("invalid request: {e}")))?;
    Ok((chat, conversation))
}

/// An output item being built: what the whole response lists, and what the stream sends.
enum Item {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: String,
        /// As the model called it: a namespace's functions by their flat names.
        name: String,
        namespace: Option<String>,
        arguments: String,
    },
}

impl Item {
    fn id(&self) -> &str {
        match self {
            Item::Reasoning { id, .. } | Item::Message { id, .. } | Item::Call { id, .. } => id,
        }
    }

    /// The item as the API lists it; `done`: complete (else as first announced).
    fn json(&self, done: bool) -> Value {
        let status = if done { "completed" } else { "in_progress" };
        match self {
            Item::Reasoning { id, text } => json!({"type": "reasoning", "id": id, "summary": [],
                "content": if done { json!([{"type": "reasoning_text", "text": text}]) } else { json!([]) }}),
            Item::Message { id, text } => {
                json!({"type": "message", "id": id, "status": status, "role": "assistant",
                "content": if done { json!([output_text(text)]) } else { json!([]) }})
            }
            Item::Call {
                id,
                call_id,
                name,
                namespace,
                arguments,
            } => {
                let mut call = json!({"type": "function_call", "id": id,
                "call_id": call_id, "name": name, "arguments": if done { arguments.as_str() } else { "" },
                "status": status});
                if let Some(ns) = namespace {
                    let ns = std::slice::from_ref(ns);
                    call["name"] = json!(split_name(name, ns).1);
                    call["namespace"] = json!(ns[0]);
                }
                call
            }
        }
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

/// Folds reply events into items, in order; returns the index of an item each event opened.
fn fold(items: &mut Vec<Item>, e: &ReplyEvent, namespaces: &[String]) -> Option<usize> {
    let opened = items.len();
    match (e, items.last_mut()) {
        (ReplyEvent::Reasoning(r), Some(Item::Reasoning { text, .. })) => text.push_str(r),
        (ReplyEvent::Reasoning(r), _) => items.push(Item::Reasoning {
            id: random_id("rs"),
            text: r.clone(),
        }),
        (ReplyEvent::Tool(ToolEvent::Content(c)), Some(Item::Message { text, .. })) => {
            text.push_str(c)
        }
        (ReplyEvent::Tool(ToolEvent::Content(c)), _) => items.push(Item::Message {
            id: random_id("msg"),
            text: c.clone(),
        }),
        (ReplyEvent::Tool(ToolEvent::Start { id, name, .. }), _) => items.push(Item::Call {
            id: random_id("fc"),
            call_id: id.clone(),
            name: name.clone(),
            namespace: split_name(name, namespaces).0.map(str::to_string),
            arguments: String::new(),
        }),
        (ReplyEvent::Tool(ToolEvent::Args { text, .. }), Some(Item::Call { arguments, .. })) => {
            arguments.push_str(text)
        }
        (ReplyEvent::Tool(ToolEvent::Args { .. }), _) => {}
    }
    (items.len() > opened).then_some(opened)
}

/// The response object.
fn response(
    state: &SharedState,
    req: &ResponsesRequest,
    id: &str,
    created: u64,
    items: &[Item],
    done: Option<(&str, &Usage)>,
) -> Value {
    let (status, incomplete, usage) = match done {
        None => ("in_progress", Value::Null, Value::Null),
        Some((finish, u)) => (
            if finish == "length" {
                "incomplete"
            } else {
                "completed"
            },
            if finish == "length" {
                json!({"reason": "max_output_tokens"})
            } else {
                Value::Null
            },
            json!({"input_tokens": u.prompt_tokens,
                   "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                   "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": u.total_tokens}),
        ),
    };
    json!({
        "id": id, "object": "response", "created_at": created, "status": status,
        "model": state.model_name, "output": items.iter().map(|i| i.json(done.is_some())).collect::<Vec<_>>(),
        "incomplete_details": incomplete, "error": null, "usage": usage,
        "instructions": req.instructions, "previous_response_id": req.previous_response_id,
        "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "tools": req.tools.clone().unwrap_or_default(), "tool_choice": req.tool_choice.clone().unwrap_or(json!("auto")),
        "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
        "text": req.text.clone().unwrap_or(json!({"format": {"type": "text"}})),
        "store": req.store.unwrap_or(true), "metadata": {},
    })
}

/// Keeps the conversation with the reply, for `previous_response_id`.
fn keep(
    state: &SharedState,
    req: &ResponsesRequest,
    id: &str,
    mut conversation: Vec<Value>,
    items: &[Item],
) {
    if req.store == Some(false) {
        return;
    }
    let mut text = String::new();
    let mut calls = Vec::new();
    for i in items {
        match i {
            Item::Message { text: t, .. } => text.push_str(t),
            Item::Call {
                call_id,
                name,
                arguments,
                ..
            } => calls.push(json!({"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}})),
            Item::Reasoning { .. } => {}
        }
    }
    conversation.push(json!({"role": "assistant", "content": text, "tool_calls": calls}));
    state.responses.put(id.to_string(), conversation);
}

pub async fn responses(state: SharedState, req: ResponsesRequest) -> Result<Response, ApiError> {
    let (chat_req, conversation) = to_chat(&state, &req)?;
    let mut started = chat::start(&state, chat_req).await?;
    let choice = started.choices.pop().expect("one choice");
    let (id, created) = (random_id("resp"), now());
    if req.stream {
        return Ok(stream(
            state,
            req,
            started,
            choice,
            id,
            created,
            conversation,
        ));
    }
    let f = collect(&state, choice).await?;
    let mut reply = started.stream(&state);
    let mut items = Vec::new();
    let namespaces = namespaces(req.tools.as_deref());
    for e in reply.push(&f.text, true) {
        fold(&mut items, &e, &namespaces);
    }
    keep(&state, &req, &id, conversation, &items);
    let done = Some((f.finish_reason, &f.usage));
    Ok(Json(response(&state, &req, &id, created, &items, done)).into_response())
}

/// The event stream: `response.created`, `response.in_progress`, per item `output_item.added`,
/// its deltas and `output_item.done`, then `response.completed`.
fn stream(
    state: SharedState,
    req: ResponsesRequest,
    started: Started,
    mut choice: Choice,
    id: String,
    created: u64,
    conversation: Vec<Value>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Value>(64);
    crate::sse::spawn_feeding(&tx.clone(), async move {
        let mut seq = 0u64;
        let mut send = |mut e: Value| {
            e["sequence_number"] = json!(seq);
            seq += 1;
            let tx = tx.clone();
            async move {
                tx.send(e)
                    .await
                    .map_err(|_| ApiError::bad_request("client disconnected"))
            }
        };
        let run = async {
            let r = response(&state, &req, &id, created, &[], None);
            send(json!({"type": "response.created", "response": r})).await?;
            send(json!({"type": "response.in_progress", "response": r})).await?;
            let mut reply = started.stream(&state);
            let mut items: Vec<Item> = Vec::new();
            let namespaces = namespaces(req.tools.as_deref());
            while let Some(o) = choice.next(&state).await {
                let o = o?;
                for e in reply.push(&o.text, o.finish_reason.is_some()) {
                    if let Some(i) = fold(&mut items, &e, &namespaces) {
                        if i > 0 {
                            for ev in done_events(&items[i - 1], i - 1) {
                                send(ev).await?;
                            }
                        }
                        for ev in added_events(&items[i], i) {
                            send(ev).await?;
                        }
                    }
                    let i = items.len().saturating_sub(1);
                    let delta = match &e {
                        ReplyEvent::Reasoning(r) => Some(("response.reasoning_text.delta", r)),
                        ReplyEvent::Tool(ToolEvent::Content(c)) => {
                            Some(("response.output_text.delta", c))
                        }
                        ReplyEvent::Tool(ToolEvent::Args { text, .. }) => {
                            Some(("response.function_call_arguments.delta", text))
                        }
                        ReplyEvent::Tool(ToolEvent::Start { .. }) => None,
                    };
                    if let Some((kind, d)) = delta {
                        send(json!({"type": kind, "item_id": items[i].id(), "output_index": i, "content_index": 0, "delta": d})).await?;
                    }
                }
                if let Some(r) = o.finish_reason {
                    if let Some(last) = items.last() {
                        for ev in done_events(last, items.len() - 1) {
                            send(ev).await?;
                        }
                    }
                    keep(&state, &req, &id, conversation, &items);
                    let usage = Usage::of(&o);
                    let done = Some((crate::generation::finish_reason(r), &usage));
                    let r = response(&state, &req, &id, created, &items, done);
                    let kind = if r["status"] == "incomplete" {
                        "response.incomplete"
                    } else {
                        "response.completed"
                    };
                    return send(json!({"type": kind, "response": r})).await;
                }
            }
            Err(ApiError::internal(
                "the engine ended the request without finishing it",
            ))
        };
        if let Err(e) = run.await {
            let _ = tx
                .send(json!({"type": "error", "code": null, "message": e.message, "param": null}))
                .await;
        }
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        let e = rx.recv().await?;
        let name = e["type"].as_str().unwrap_or("error").to_string();
        Some((
            Ok::<_, Infallible>(Event::default().event(name).data(e.to_string())),
            rx,
        ))
    });
    Sse::new(body).into_response()
}

fn added_events(item: &Item, i: usize) -> Vec<Value> {
    let mut out = vec![
        json!({"type": "response.output_item.added", "output_index": i, "item": item.json(false)}),
    ];
    if let Item::Message { id, .. } = item {
        out.push(
            json!({"type": "response.content_part.added", "item_id": id, "output_index": i,
                        "content_index": 0, "part": output_text("")}),
        );
    }
    out
}

fn done_events(item: &Item, i: usize) -> Vec<Value> {
    let mut out = match item {
        Item::Message { id, text } => vec![
            json!({"type": "response.output_text.done", "item_id": id, "output_index": i, "content_index": 0, "text": text}),
            json!({"type": "response.content_part.done", "item_id": id, "output_index": i, "content_index": 0, "part": output_text(text)}),
        ],
        Item::Reasoning { id, text } => vec![
            json!({"type": "response.reasoning_text.done", "item_id": id,
            "output_index": i, "content_index": 0, "text": text}),
        ],
        Item::Call { id, arguments, .. } => {
            vec![json!({"type": "response.function_call_arguments.done",
            "item_id": id, "output_index": i, "arguments": arguments})]
        }
    };
    out.push(
        json!({"type": "response.output_item.done", "output_index": i, "item": item.json(true)}),
    );
    out
}
