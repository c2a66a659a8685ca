//! Tool-call parsers: they turn the model's text into OpenAI `tool_calls` as it streams. One
//! state machine ([`CallStream`]) serves streamed and whole responses alike — a whole response
//! is the stream's events folded — so both always agree. Calls are found anywhere in the output
//! (at the start only for the formats that have no marker: llama3_json, pythonic lists); a
//! call's name goes out once it is complete, its arguments as they grow. Text that does not
//! parse as a call stays content, never an empty message.

mod body;
pub mod forced;
mod json;
mod pythonic;
mod xml;

use crate::protocol::{FunctionCall, ToolCall};
use body::{Body, BodyState};
use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolParser {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2.5 / 3).
    Hermes,
    /// A bare JSON object `{"name": ..., "parameters": {...}}` at the start of the output, or
    /// several separated by `;` (Llama 3.x).
    Llama3Json,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}`
    /// (Mistral).
    Mistral,
    /// `[name(key=value, ...), ...]` at the start of the output (Llama 3.2 / 4), or one or more
    /// calls in a ```` ```tool_code ```` block anywhere (Gemma 3).
    Pythonic,
    /// `<tool_call><function=name><parameter=key>value</parameter>...</function></tool_call>`
    /// (Qwen3-Coder), values typed by the tool's schema.
    Qwen3Coder,
}

impl ToolParser {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "hermes" | "qwen" | "qwen2_5" => Some(ToolParser::Hermes),
            "llama3_json" | "llama3" | "llama" => Some(ToolParser::Llama3Json),
            "mistral" => Some(ToolParser::Mistral),
            "pythonic" | "llama4_pythonic" | "gemma3" => Some(ToolParser::Pythonic),
            "qwen3_coder" | "qwen3_xml" => Some(ToolParser::Qwen3Coder),
            _ => None,
        }
    }

    pub const NAMES: &'static str = "hermes, llama3_json, mistral, pythonic (gemma3), qwen3_coder";

    /// How to call a function in this format, for a template without a tools section.
    pub fn instructions(self) -> &'static str {
        match self {
            ToolParser::Hermes => {
                "To call a function, answer with <tool_call>{\"name\": <function name>, \"arguments\": <arguments object>}</tool_call>, one block per call."
            }
            ToolParser::Llama3Json => {
                "To call a function, answer with only a JSON object {\"name\": <function name>, \"parameters\": <arguments object>}."
            }
            ToolParser::Mistral => {
                "To call functions, answer with [TOOL_CALLS][{\"name\": <function name>, \"arguments\": <arguments object>}, ...]."
            }
            ToolParser::Pythonic => {
                "To call functions, answer with only a Python list of calls: [function_name(argument=value, ...), ...]."
            }
            ToolParser::Qwen3Coder => {
                "To call a function, answer with <tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call>, one block per call."
            }
        }
    }

    /// Splits complete model output into content and tool calls.
    pub fn parse(self, text: &str, tools: &[Value]) -> (Option<String>, Vec<ToolCall>) {
        let mut stream = CallStream::new(self, tools);
        let mut events = stream.push(text);
        events.extend(stream.finish());
        fold(events)
    }

    /// Where a call can begin in `rest`, the text after the last consumed byte; `at_start`:
    /// nothing but whitespace came before it.
    fn find_start(self, rest: &str, at_start: bool) -> Start {
        match self {
            ToolParser::Hermes | ToolParser::Qwen3Coder => marker(rest, "<tool_call>"),
            ToolParser::Mistral => marker(rest, "[TOOL_CALLS]"),
            ToolParser::Llama3Json => {
                leading(rest, at_start, &["<|python_tag|>"], '{').unwrap_or(Start::None { hold: 0 })
            }
            ToolParser::Pythonic => match leading(rest, at_start, &[], '[') {
                Some(s @ Start::Found { .. }) => s,
                _ => marker(rest, "```tool_code"),
            },
        }
    }

    /// The calls of a body (the text after its start), as far as it goes.
    fn parse_body(self, body: &str, tools: &[Value], at_end: bool) -> Body {
        match self {
            ToolParser::Hermes => json::hermes(body, at_end),
            ToolParser::Llama3Json => json::llama3(body, at_end),
            ToolParser::Mistral => json::mistral(body, at_end),
            ToolParser::Pythonic => pythonic::body(body, at_end),
            ToolParser::Qwen3Coder => xml::body(body, tools, at_end),
        }
    }
}

/// What [`CallStream`] reports, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    Content(String),
    /// Call `index` begins: its id and complete name, arguments to follow.
    Start {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments (their concatenation is a JSON object).
    Args {
        index: usize,
        text: String,
    },
}

/// Folds events into a whole message's content and calls.
pub fn fold(events: Vec<ToolEvent>) -> (Option<String>, Vec<ToolCall>) {
    let mut content: Option<String> = None;
    let mut calls: Vec<ToolCall> = Vec::new();
    for e in events {
        match e {
            ToolEvent::Content(t) => content.get_or_insert_with(String::new).push_str(&t),
            ToolEvent::Start { id, name, .. } => calls.push(ToolCall {
                id,
                kind: "function",
                function: FunctionCall {
                    name,
                    arguments: String::new(),
                },
            }),
            ToolEvent::Args { index, text } => calls[index].function.arguments.push_str(&text),
        }
    }
    (content, calls)
}

/// Where a call starts in the unconsumed text.
#[derive(Debug, PartialEq, Eq)]
enum Start {
    /// Content up to `at`, the call's body from `body` on.
    Found { at: usize, body: usize },
    /// No call yet; the last `hold` bytes may still become the start of one.
    None { hold: usize },
}

/// A start marker anywhere in `rest`.
fn marker(rest: &str, m: &str) -> Start {
    if let Some(at) = rest.find(m) {
        return Start::Found {
            at,
            body: at + m.len(),
        };
    }
    Start::None {
        hold: partial_suffix(rest, m),
    }
}

/// The length of the longest suffix of `s` that is a proper prefix of `marker`: text that
/// may still become the marker and so is held back.
pub(crate) fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && marker.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

/// A call at the very start of the output: one of `tags` (the body after it), or `open` (the
/// body from it on). `None` once the output has begun otherwise.
fn leading(rest: &str, at_start: bool, tags: &[&str], open: char) -> Option<Start> {
    if !at_start {
        return None;
    }
    let t = rest.trim_start();
    let at = rest.len() - t.len();
    for tag in tags {
        if t.starts_with(tag) {
            return Some(Start::Found {
                at,
                body: at + tag.len(),
            });
        }
    }
    if t.starts_with(open) {
        return Some(Start::Found { at, body: at });
    }
    (t.is_empty() || tags.iter().any(|tag| tag.starts_with(t)))
        .then_some(Start::None { hold: rest.len() })
}

/// A body being streamed: where it starts and what of it went out.
struct OpenBody {
    marker_at: usize,
    start: usize,
    /// Bytes of each started call's arguments already sent.
    sent: Vec<usize>,
}

/// The parser over one choice's output, fed its text deltas.
pub struct CallStream {
    parser: ToolParser,
    tools: Vec<Value>,
    text: String,
    /// Bytes of `text` handled for good.
    pos: usize,
    body: Option<OpenBody>,
    calls: usize,
    /// Whitespace held back: sent with the next content, dropped when a call starts.
    blank: String,
    /// Whether content other than whitespace went out.
    wrote: bool,
}

impl CallStream {
    pub fn new(parser: ToolParser, tools: &[Value]) -> Self {
        Self {
            parser,
            tools: tools.to_vec(),
            text: String::new(),
            pos: 0,
            body: None,
            calls: 0,
            blank: String::new(),
            wrote: false,
        }
    }

    pub fn push(&mut self, delta: &str) -> Vec<ToolEvent> {
        self.text.push_str(delta);
        let mut out = Vec::new();
        self.advance(false, &mut out);
        out
    }

    /// The end of the output: whatever was held goes out.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        self.advance(true, &mut out);
        if self.calls == 0 && !self.blank.is_empty() {
            out.push(ToolEvent::Content(std::mem::take(&mut self.blank)));
        }
        out
    }

    /// Content, its trailing whitespace held back (so a call right after it leaves no stray
    /// newline, however the text was cut into deltas).
    fn content(&mut self, t: &str, out: &mut Vec<ToolEvent>) {
        let body = t.trim_end();
        if body.is_empty() {
            self.blank.push_str(t);
            return;
        }
        let text = std::mem::take(&mut self.blank) + body;
        self.blank = t[body.len()..].to_string();
        self.wrote = true;
        match out.last_mut() {
            Some(ToolEvent::Content(c)) => c.push_str(&text),
            _ => out.push(ToolEvent::Content(text)),
        }
    }

    fn advance(&mut self, at_end: bool, out: &mut Vec<ToolEvent>) {
        loop {
            let Some(b) = &mut self.body else {
                let rest = &self.text[self.pos..];
                match self.parser.find_start(rest, !self.wrote && self.calls == 0) {
                    Start::Found { at, body } => {
                        let text = rest[..at].to_string();
                        self.content(&text, out);
                        self.body = Some(OpenBody {
                            marker_at: self.pos + at,
                            start: self.pos + body,
                            sent: Vec::new(),
                        });
                        self.pos += body;
                        continue;
                    }
                    Start::None { hold } => {
                        let hold = if at_end { 0 } else { hold };
                        let end = self.text.len() - hold;
                        let text = self.text[self.pos..end].to_string();
                        self.pos = end;
                        self.content(&text, out);
                        return;
                    }
                }
            };
            let parsed = self
                .parser
                .parse_body(&self.text[b.start..], &self.tools, at_end);
            for (i, c) in parsed.calls.iter().enumerate() {
                if i == b.sent.len() {
                    let Some(name) = &c.name else { break };
                    self.blank.clear();
                    out.push(ToolEvent::Start {
                        index: self.calls + i,
                        id: format!("call_{:024x}", rand::random::<u128>() >> 32),
                        name: name.clone(),
                    });
                    b.sent.push(0);
                }
                if c.args.len() > b.sent[i] {
                    out.push(ToolEvent::Args {
                        index: self.calls + i,
                        text: c.args[b.sent[i]..].to_string(),
                    });
                    b.sent[i] = c.args.len();
                }
            }
            let started = b.sent.len();
            let (marker_at, start) = (b.marker_at, b.start);
            let end = match parsed.state {
                BodyState::Open if !at_end => return,
                // The output ended inside a body: what was sent stands.
                BodyState::Open => self.text.len(),
                BodyState::Done(n) => start + n,
                BodyState::Invalid { valid } => start + valid,
            };
            self.body = None;
            self.calls += started;
            if started == 0 {
                // Not a call after all: the marker is content, and scanning goes on after it.
                let text = self.text[marker_at..start.max(marker_at + 1)].to_string();
                self.pos = start.max(marker_at + 1);
                self.content(&text, out);
                self.wrote = true;
            } else {
                self.pos = end;
            }
        }
    }
}

#[cfg(test)]
mod tests;
