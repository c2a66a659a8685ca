//! A call body as a format's parser reads it: the calls so far and whether it is done.

use serde_json::Value;

/// One call of a body as parsed so far. `args` only grows from one parse to the next.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct PartialCall {
    pub name: Option<String>,
    pub args: String,
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum BodyState {
    /// More text may extend the body.
    Open,
    /// The body ends after `n` bytes (its end marker included).
    Done(usize),
    /// Not a call body: the calls before `valid` bytes stand, the rest is content.
    Invalid { valid: usize },
}

#[derive(Debug)]
pub(super) struct Body {
    pub calls: Vec<PartialCall>,
    pub state: BodyState,
}

/// The schema type of parameter `key` of tool `name`, if the tools say.
pub(super) fn param_type<'a>(tools: &'a [Value], name: &str, key: &str) -> Option<&'a str> {
    tools
        .iter()
        .find(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name))?
        .pointer(&format!("/function/parameters/properties/{key}/type"))?
        .as_str()
}
