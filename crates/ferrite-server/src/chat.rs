//! `POST /v1/chat/completions`: chat template, tool calls, whole or streamed responses.

use crate::error::ApiError;
use crate::generation::{
    check_model, check_n, check_prompt_logprobs, collect, model_sampling_params,
    prompt_logprobs_json, start_choices, Choice,
};
use crate::prompt_work::{check_text_len, off_runtime};
use crate::protocol::*;
use crate::reasoning::ReasoningParser;
use crate::reply::{ReplyEvent, ReplyStream};
use crate::sse::{sse_response, ChunkSink, WrapChunk};
use crate::state::{AppState, SharedState};
use crate::structured;
use crate::tools::{forced, ToolEvent, ToolParser};
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrite_core::output::TokenLogprob;
use ferrite_core::request::FinishReason;
use ferrite_grammar::Reasoning;
use ferrite_tokenizer::chat_template::open_final_message;
use minijinja::Value as JinjaValue;
use serde_json::Value;
use std::sync::Arc;

/// The roles of OpenAI's chat API (`function`: its legacy tool role).
const ROLES: &[&str] = &[
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// Messages as the template sees them: text parts joined, other parts refused.
pub fn normalize_messages(messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("`messages` must not be empty").with_param("messages"));
    }
    messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            let obj = m
                .as_object_mut()
                .ok_or_else(|| ApiError::bad_request("each message must be an object"))?;
            match obj.get("role").and_then(Value::as_str) {
                Some(r) if ROLES.contains(&r) => {}
                Some(r) => {
                    return Err(ApiError::bad_request(format!(
                        "unknown message role `{r}` (one of {})",
                        ROLES.join(", ")
                    ))
                    .with_param("messages"))
                }
                None => {
                    return Err(ApiError::bad_request("each message needs a string `role`")
                        .with_param("messages"))
                }
            }
            // An assistant turn that only calls tools sends `content: null`; templates
            // concatenate strings (vLLM renders it as empty too).
            if obj.get("content").is_none_or(Value::is_null) {
                obj.insert("content".into(), Value::String(String::new()));
            }
            // Templates read a call's arguments as a mapping; OpenAI sends a JSON string.
            if let Some(Value::Array(calls)) = obj.get_mut("tool_calls") {
                for c in calls {
                    let args = c.pointer_mut("/function/arguments");
                    if let Some(a) = args {
                        if let Some(v) = a.as_str().and_then(|s| serde_json::from_str(s).ok()) {
                            *a = v;
                        }
                    }
                }
            }
            if let Some(Value::Array(parts)) = obj.get("content") {
                let mut text = String::new();
                for p in parts {
                    match (
                        p.get("type").and_then(Value::as_str),
                        p.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        (Some("text"), None) => {
                            return Err(ApiError::bad_request(
                                "a content part of type `text` needs a string `text`",
                            )
                            .with_param("messages"))
                        }
                        (t, _) => {
                            return Err(ApiError::unknown_type(
                                "content parts",
                                t,
                                "text: this model reads text only",
                            )
                            .with_param("messages"))
                        }
                    }
                }
                obj.insert("content".into(), Value::String(text));
            }
            Ok(m)
        })
        .collect()
}

/// For a template without a tools section: the tools and how to call them, in the parser's
/// format, prepended to the system turn (as llama.cpp does), with a log line saying so.
fn tools_fallback(
    messages: &mut Vec<Value>,
    req: &ChatCompletionRequest,
    parser: Option<ToolParser>,
) {
    let tools = req.tools.iter().flatten();
    let list: Vec<String> = tools
        .filter_map(|t| t.get("function").map(Value::to_string))
        .collect();
    let how = parser.unwrap_or(ToolParser::Hermes).instructions();
    let text = format!(
        "You can call these functions:\n<tools>\n{}\n</tools>\n{how}",
        list.join("\n")
    );
    tracing::info!("the chat template has no tools section: tools sent in a system turn instead");
    match messages.first_mut() {
        Some(m) if m.get("role").and_then(Value::as_str) == Some("system") => {
            let old = m.get("content").and_then(Value::as_str).unwrap_or_default();
            m["content"] = Value::String(format!("{text}\n\n{old}"));
        }
        _ => messages.insert(0, serde_json::json!({"role": "system", "content": text})),
    }
}

/// Which parser applies, after checking `tool_choice` against the server's flags.
fn tool_mode(
    state: &AppState,
    req: &ChatCompletionRequest,
) -> Result<(Option<ToolParser>, bool), ApiError> {
    let has_tools = req.tools.as_ref().is_some_and(|t| !t.is_empty());
    let choice = req.tool_choice.clone().unwrap_or(Value::String(
        if has_tools { "auto" } else { "none" }.into(),
    ));
    if choice == "none" || !has_tools {
        return Ok((None, false));
    }
    if choice == "auto" && !(state.enable_auto_tool_choice && state.tool_parser.is_some()) {
        return Err(ApiError::bad_request(
            "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set",
        )
        .with_param("tool_choice"));
    }
    let parser = state.tool_parser.ok_or_else(|| {
        ApiError::bad_request("tool calls need the server started with --tool-call-parser")
            .with_param("tool_choice")
    })?;
    if let Some(name) = choice.pointer("/function/name").and_then(Value::as_str) {
        let known = req
            .tools
            .iter()
            .flatten()
            .any(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name));
        if !known {
            return Err(ApiError::bad_request(format!(
                "tool_choice names `{name}`, which is not in `tools`"
            ))
            .with_param("tool_choice"));
        }
    } else if choice != "auto" && choice != "required" {
        return Err(ApiError::bad_request(
            "`tool_choice` must be none, auto, required or a named function",
        )
        .with_param("tool_choice"));
    }
    Ok((Some(parser), true))
}

/// Whether the prompt's last reasoning block is closed (a template that turns thinking off
/// writes an empty `<think></think>`): then the output has none.
fn closed_in_prompt(state: &AppState, prompt: &[u32]) -> bool {
    let tail = &prompt[prompt.len().saturating_sub(64)..];
    let text = state.tokenizer.decode(tail, false).unwrap_or_default();
    match (text.rfind("<think>"), text.rfind("</think>")) {
        (open, Some(close)) => open.is_none_or(|o| o < close),
        _ => false,
    }
}

pub fn render_prompt(
    state: &AppState,
    req: &ChatCompletionRequest,
    with_tools: bool,
) -> Result<Vec<u32>, ApiError> {
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::bad_request("the model has no chat template; pass --chat-template")
    })?;
    let mut messages = normalize_messages(&req.messages)?;
    if with_tools && !template.renders_tools() {
        tools_fallback(&mut messages, req, state.tool_parser);
    }
    let mut extra = serde_json::Map::new();
    if let Some(kw) = &req.chat_template_kwargs {
        extra.extend(kw.clone());
    }
    if with_tools {
        extra.insert(
            "tools".into(),
            Value::Array(req.tools.clone().unwrap_or_default()),
        );
        if let Some(tc) = &req.tool_choice {
            extra.insert("tool_choice".into(), tc.clone());
        }
    }
    let open = req.continue_final_message;
    if open && req.add_generation_prompt == Some(true) {
        return Err(ApiError::bad_request(
            "continue_final_message and add_generation_prompt cannot both be true: the first \
             continues the last message, the second starts a new assistant turn",
        )
        .with_param("continue_final_message"));
    }
    let add_gen = req.add_generation_prompt.unwrap_or(!open);
    let mut text = template.render(&messages, add_gen, JinjaValue::from_serialize(&extra))?;
    if open {
        let last = messages.last().and_then(|m| m["content"].as_str());
        text = open_final_message(&text, last.unwrap_or_default())
            .map_err(|e| ApiError::from(e).with_param("continue_final_message"))?;
    }
    check_text_len(state, &text)?;
    let ids = state.tokenizer.encode(&text, false)?;
    Ok(ids)
}

pub fn token_logprobs(state: &AppState, lps: &[TokenLogprob]) -> ChatLogprobs {
    let text = |id: u32| state.tokenizer.token_text(id);
    ChatLogprobs {
        content: lps
            .iter()
            .map(|lp| {
                let token = text(lp.token_id);
                ChatTokenLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: lp.logprob,
                    top_logprobs: lp
                        .top
                        .iter()
                        .map(|&(id, l)| {
                            let t = text(id);
                            TopLogprob {
                                bytes: t.as_bytes().to_vec(),
                                token: t,
                                logprob: l,
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// A chat request on its way: its choices queued in the engine, and how to read their text.
pub(crate) struct Started {
    pub choices: Vec<Choice>,
    pub parser: Option<ToolParser>,
    /// Whether a grammar constrains the reply from its first token.
    pub constrained: bool,
    /// Whether `tool_choice` forces calls: text outside them can only be an unfinished
    /// call's markup (a reply cut by `max_tokens`), never content.
    pub forced: bool,
    pub req: Arc<ChatCompletionRequest>,
}

impl Started {
    pub fn tools(&self) -> &[Value] {
        self.req.tools.as_deref().unwrap_or_default()
    }

    /// A finished choice's text as (reasoning, content, tool calls).
    pub fn reply(
        &self,
        state: &AppState,
        text: &str,
    ) -> (Option<String>, Option<String>, Vec<ToolCall>) {
        let (reasoning, text) = match state.reasoning_parser {
            Some(r) => r.split(text, self.constrained),
            None => (None, text.to_string()),
        };
        let (content, calls) = match self.parser {
            Some(p) => {
                let (content, calls) = p.parse(&text, self.tools());
                (content.filter(|_| !self.forced), calls)
            }
            None => (
                (reasoning.is_none() || !text.is_empty()).then_some(text),
                vec![],
            ),
        };
        (reasoning, content, calls)
    }

    pub fn stream(&self, state: &AppState) -> ReplyStream {
        ReplyStream::new(
            state,
            self.parser,
            self.tools(),
            self.constrained,
            self.forced,
        )
    }
}

/// Validates a chat request, renders its prompt and starts its choices.
pub(crate) async fn start(
    state: &SharedState,
    req: ChatCompletionRequest,
) -> Result<Started, ApiError> {
    check_model(state, &req.common.model)?;
    let n = check_n(req.common.n)?;
    let (parser, with_tools) = tool_mode(state, &req)?;
    let top = match (req.logprobs, req.top_logprobs) {
        (true, k) => Some(k.unwrap_or(0)),
        (false, Some(_)) => {
            return Err(
                ApiError::bad_request("`top_logprobs` needs `logprobs: true`")
                    .with_param("top_logprobs"),
            )
        }
        (false, None) => None,
    };
    check_prompt_logprobs(req.common.stream, req.prompt_logprobs)?;
    let max_tokens = req.max_completion_tokens.or(req.common.max_tokens);
    let params = model_sampling_params(state, &req.common, max_tokens, top, req.prompt_logprobs)?;
    let forced = match (parser, &req.tool_choice) {
        (Some(p), Some(choice)) => forced::spec(
            p,
            req.tools.as_deref().unwrap_or(&[]),
            choice,
            req.parallel_tool_calls.unwrap_or(true),
        ),
        _ => None,
    };
    let forces_calls = forced.is_some();
    let spec = match (forced, structured::spec(&req.common)?) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "a required or named `tool_choice` cannot be combined with a structured-output constraint",
            )
            .with_param("tool_choice"))
        }
        (f, s) => f.or(s),
    };
    let mut constrained = spec.is_some();
    let grammar = structured::compile(state, spec).await?;
    let req = Arc::new(req);
    let prompt = {
        let req = req.clone();
        off_runtime(state, move |s| render_prompt(s, &req, with_tools)).await?
    };
    // With a reasoning parser the grammar starts once the reasoning block has closed, as vLLM
    // applies it; the reply then reads like an unconstrained one.
    let grammar = match (grammar, state.reasoning_parser) {
        (Some(g), Some(r)) => {
            let closed = closed_in_prompt(state, &prompt);
            let mode = match r {
                ReasoningParser::DeepSeekR1 => Reasoning::Opened,
                ReasoningParser::Qwen3 => Reasoning::Optional,
            };
            constrained = closed;
            Some(g.after_reasoning(mode, closed))
        }
        (g, _) => g,
    };
    let choices = start_choices(state, vec![prompt], &params, n, grammar.as_ref())?;
    Ok(Started {
        choices,
        parser,
        constrained,
        forced: forces_calls,
        req,
    })
}

pub async fn chat_completions(
    state: SharedState,
    req: ChatCompletionRequest,
) -> Result<Response, ApiError> {
    let mut started = start(&state, req).await?;
    let id = random_id("chatcmpl");
    let model = state.model_name.clone();
    let req = started.req.clone();
    if req.common.stream {
        let include_usage = req.common.include_usage();
        let want_lp = req.logprobs;
        let wrap: WrapChunk =
            Arc::new(move |choices, usage| chat_chunk(&id, &model, choices, usage));
        let choices = std::mem::take(&mut started.choices);
        let started = Arc::new(started);
        return Ok(sse_response(
            state.clone(),
            choices,
            include_usage,
            move |state, choice, sink| {
                let reply = started.stream(&state);
                stream_choice(state, choice, sink, reply, want_lp)
            },
            wrap,
        ));
    }
    let mut out = Vec::new();
    let mut usage: Option<Usage> = None;
    let mut prompt_logprobs = None;
    let choices = std::mem::take(&mut started.choices);
    let finished =
        futures_util::future::join_all(choices.into_iter().map(|c| collect(&state, c))).await;
    for (index, f) in finished.into_iter().enumerate() {
        let f = f?;
        usage = Some(match usage {
            None => f.usage.clone(),
            Some(u) => u.and(&f.usage),
        });
        if req.prompt_logprobs.is_some() && prompt_logprobs.is_none() {
            let lps = f.prompt_logprobs.as_deref().unwrap_or(&[]);
            prompt_logprobs = Some(prompt_logprobs_json(&state, lps));
        }
        let (reasoning, content, tool_calls) = started.reply(&state, &f.text);
        // A reply cut by `max_tokens` says so, calls or not (its last call may be cut).
        let finish = if tool_calls.is_empty() || f.finish_reason == "length" {
            f.finish_reason
        } else {
            "tool_calls"
        };
        out.push(ChatChoice {
            index,
            message: ChatMessageOut {
                role: "assistant",
                content,
                reasoning_content: reasoning,
                tool_calls,
            },
            logprobs: req.logprobs.then(|| token_logprobs(&state, &f.logprobs)),
            finish_reason: Some(finish),
        });
    }
    Ok(Json(ChatCompletion {
        id,
        object: "chat.completion",
        created: now(),
        model: state.model_name.clone(),
        choices: out,
        usage: usage.unwrap_or_default(),
        prompt_logprobs,
    })
    .into_response())
}

fn chat_chunk(id: &str, model: &str, choices: Vec<Value>, usage: Option<Value>) -> Value {
    serde_json::to_value(ChatCompletionChunk {
        id: id.to_string(),
        object: "chat.completion.chunk",
        created: now(),
        model: model.to_string(),
        choices,
        usage,
    })
    .unwrap()
}

/// Streams one choice: role first, then content and tool-call deltas in the order the model
/// wrote them (a call's id and name first, then its argument fragments), then the finish.
async fn stream_choice(
    state: SharedState,
    mut choice: Choice,
    sink: ChunkSink,
    mut reply: ReplyStream,
    want_logprobs: bool,
) -> Result<Usage, ApiError> {
    let index = choice.index;
    let chunk = |delta: ChatDelta, lp: Option<ChatLogprobs>, finish: Option<&'static str>| {
        ChatChunkChoice {
            index,
            delta,
            logprobs: lp,
            finish_reason: finish,
        }
    };
    sink.send_choice(chunk(
        ChatDelta {
            role: Some("assistant"),
            content: Some(String::new()),
            ..Default::default()
        },
        None,
        None,
    ))
    .await?;
    let mut called = false;
    while let Some(o) = choice.next(&state).await {
        let o = o?;
        let events = reply.push(&o.text, o.finish_reason.is_some());
        let mut lp =
            (want_logprobs && !o.logprobs.is_empty()).then(|| token_logprobs(&state, &o.logprobs));
        let deltas = deltas(events);
        called |= deltas.iter().any(|d| !d.tool_calls.is_empty());
        if deltas.is_empty() && lp.is_some() {
            sink.send_choice(chunk(ChatDelta::default(), lp.take(), None))
                .await?;
        }
        for d in deltas {
            sink.send_choice(chunk(d, lp.take(), None)).await?;
        }
        if let Some(r) = o.finish_reason {
            let finish = if called && r != FinishReason::Length {
                "tool_calls"
            } else {
                crate::generation::finish_reason(r)
            };
            sink.send_choice(chunk(ChatDelta::default(), None, Some(finish)))
                .await?;
            return Ok(Usage::of(&o));
        }
    }
    Err(ApiError::internal(
        "the engine ended the request without finishing it",
    ))
}

/// Events as deltas: a delta per run of reasoning or of content, a tool-calls delta per run
/// of call events (a call's start and its first fragments in one entry).
fn deltas(events: Vec<ReplyEvent>) -> Vec<ChatDelta> {
    let mut out: Vec<ChatDelta> = Vec::new();
    for e in events {
        let last = out.last_mut();
        let e = match e {
            ReplyEvent::Reasoning(r) => {
                match last {
                    Some(ChatDelta {
                        reasoning_content: Some(c),
                        ..
                    }) => c.push_str(&r),
                    _ => out.push(ChatDelta {
                        reasoning_content: Some(r),
                        ..Default::default()
                    }),
                }
                continue;
            }
            ReplyEvent::Tool(e) => e,
        };
        match e {
            ToolEvent::Content(t) if t.is_empty() => {}
            ToolEvent::Content(t) => match last {
                Some(ChatDelta {
                    content: Some(c), ..
                }) => c.push_str(&t),
                _ => out.push(ChatDelta {
                    content: Some(t),
                    ..Default::default()
                }),
            },
            ToolEvent::Start { index, id, name } => {
                let entry = ToolCallDelta {
                    index,
                    id: Some(id),
                    kind: Some("function"),
                    function: FunctionDelta {
                        name: Some(name),
                        arguments: String::new(),
                    },
                };
                match last {
                    Some(d) if d.content.is_none() && d.reasoning_content.is_none() => {
                        d.tool_calls.push(entry)
                    }
                    _ => out.push(ChatDelta {
                        tool_calls: vec![entry],
                        ..Default::default()
                    }),
                }
            }
            ToolEvent::Args { index, text } => match last {
                Some(d) if d.tool_calls.last().is_some_and(|c| c.index == index) => {
                    d.tool_calls.last_mut().unwrap().function.arguments += &text
                }
                Some(d) if !d.tool_calls.is_empty() => d.tool_calls.push(args_delta(index, text)),
                _ => out.push(ChatDelta {
                    tool_calls: vec![args_delta(index, text)],
                    ..Default::default()
                }),
            },
        }
    }
    out
}

fn args_delta(index: usize, arguments: String) -> ToolCallDelta {
    ToolCallDelta {
        index,
        id: None,
        kind: None,
        function: FunctionDelta {
            name: None,
            arguments,
        },
    }
}
