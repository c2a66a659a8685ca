//! Tool-call parsers: they turn the model's text into OpenAI `tool_calls`, whole or streamed.
//! Malformed output degrades to plain content, never to an empty message.

use crate::protocol::{FunctionCall, ToolCall};
use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolParser {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen).
    Hermes,
    /// A bare JSON object `{"name": ..., "parameters": {...}}`, or several separated by `;`
    /// (Llama 3.x).
    Llama3Json,
}

impl ToolParser {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "hermes" | "qwen" | "qwen2_5" => Some(ToolParser::Hermes),
            "llama3_json" | "llama3" | "llama" => Some(ToolParser::Llama3Json),
            _ => None,
        }
    }

    pub const NAMES: &'static str = "hermes, llama3_json";

    /// Splits complete model output into content and tool calls.
    pub fn parse(self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        if self.prefix_state(text) != Prefix::Call {
            return (Some(text.to_string()), Vec::new());
        }
        let calls = match self {
            ToolParser::Hermes => parse_hermes(text),
            ToolParser::Llama3Json => parse_llama3(text),
        };
        match calls {
            Some((content, calls)) if !calls.is_empty() => (content, calls),
            _ => (Some(text.to_string()), Vec::new()),
        }
    }

    /// How the text so far can end: calls are recognized only at the start of the output,
    /// the same rule for streamed and whole responses.
    pub fn prefix_state(self, text: &str) -> Prefix {
        let t = text.trim_start();
        let markers: &[&str] = match self {
            ToolParser::Hermes => &["<tool_call>"],
            ToolParser::Llama3Json => &["{", "<|python_tag|>"],
        };
        if markers.iter().any(|m| t.starts_with(m)) {
            Prefix::Call
        } else if t.is_empty() || markers.iter().any(|m| m.starts_with(t)) {
            Prefix::Undecided
        } else {
            Prefix::Content
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefix {
    Undecided,
    Call,
    Content,
}

fn call_from(v: &Value, index: usize) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    let arguments = match args {
        Some(Value::String(s)) => s.clone(),
        Some(a) => serde_json::to_string(a).ok()?,
        None => "{}".to_string(),
    };
    Some(ToolCall {
        id: format!("call_{:024x}{index}", rand::random::<u128>() >> 32),
        kind: "function",
        function: FunctionCall { name, arguments },
    })
}

fn parse_hermes(text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
    let first = text.find("<tool_call>")?;
    let content = text[..first].trim();
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(start) = rest.find("<tool_call>") {
        let body_start = start + "<tool_call>".len();
        let (body, next) = match rest[body_start..].find("</tool_call>") {
            Some(end) => (
                &rest[body_start..body_start + end],
                &rest[body_start + end + 12..],
            ),
            None => (&rest[body_start..], ""),
        };
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        calls.push(call_from(&v, calls.len())?);
        rest = next;
    }
    Some(((!content.is_empty()).then(|| content.to_string()), calls))
}

fn parse_llama3(text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
    let t = text.trim().trim_start_matches("<|python_tag|>").trim();
    if !t.starts_with('{') {
        return None;
    }
    // Several calls come back to back, or joined by ';'.
    let values: Vec<Value> = match serde_json::Deserializer::from_str(t)
        .into_iter::<Value>()
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(v) => v,
        Err(_) => t
            .split(';')
            .map(|part| serde_json::from_str(part.trim()))
            .collect::<Result<_, _>>()
            .ok()?,
    };
    let calls = values
        .iter()
        .enumerate()
        .map(|(i, v)| call_from(v, i))
        .collect::<Option<Vec<_>>>()?;
    Some((None, calls))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hermes_calls_at_the_start() {
        let (content, calls) = ToolParser::Hermes.parse(
            "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>",
        );
        assert_eq!(content, None);
        let prose = "Let me check <tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>";
        assert_eq!(
            ToolParser::Hermes.parse(prose),
            (Some(prose.to_string()), vec![])
        );
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(calls[0].function.arguments, r#"{"city":"Paris"}"#);
        assert_eq!(calls[1].function.arguments, "{}");
        assert_ne!(calls[0].id, calls[1].id);
    }

    #[test]
    fn malformed_output_stays_content() {
        for text in [
            "<tool_call>{not json</tool_call>",
            "<tool_call>{\"x\": 1}</tool_call>",
            "plain",
        ] {
            let (content, calls) = ToolParser::Hermes.parse(text);
            assert!(calls.is_empty());
            assert_eq!(content.as_deref(), Some(text));
        }
    }

    #[test]
    fn llama3_json_calls() {
        let (content, calls) = ToolParser::Llama3Json
            .parse(r#"{"name": "search", "parameters": {"q": "rust"}}; {"name": "open", "parameters": {"id": 3}}"#);
        assert!(content.is_none());
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].function.arguments, r#"{"id":3}"#);
        let (content, calls) = ToolParser::Llama3Json.parse("{\"oops\": 1}");
        assert!(calls.is_empty() && content.is_some());
    }
}
