//! The Responses API's tools as chat tools. A `namespace` tool's functions are offered to the
//! model under flat names, `{namespace}__{name}` (the flattening Codex itself uses where a
//! boundary cannot keep the split), and the model's calls go back as `function_call` items
//! with `name` and `namespace` apart. Tools the server would run (web search, file search,
//! code interpreter...) are left out with a log line: the model cannot call them here.

use crate::error::ApiError;
use serde_json::{json, Value};

const DELIMITER: &str = "__";

/// The chat tools of a request's `tools`.
pub fn chat_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    for t in tools {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => out.push(function(t, None)?),
            Some("namespace") => {
                let ns = name(t, "a namespace tool")?;
                let inner = t.get("tools").and_then(Value::as_array).ok_or_else(|| {
                    bad(format!("tools: namespace `{ns}` needs a list of `tools`"))
                })?;
                for f in inner {
                    match f.get("type").and_then(Value::as_str) {
                        Some("function") => out.push(function(f, Some(ns))?),
                        other => left_out(other, Some(ns)),
                    }
                }
            }
            None => return Err(bad("tools: every tool needs a `type`")),
            other => left_out(other, None),
        }
    }
    Ok(out)
}

/// The names of a request's namespace tools.
pub fn namespaces(tools: Option<&[Value]>) -> Vec<String> {
    tools
        .unwrap_or_default()
        .iter()
        .filter(|t| t.get("type").and_then(Value::as_str) == Some("namespace"))
        .filter_map(|t| Some(t.get("name")?.as_str()?.to_string()))
        .collect()
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message).with_param("tools")
}

fn name<'a>(t: &'a Value, what: &str) -> Result<&'a str, ApiError> {
    t.get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad(format!("tools: {what} needs a `name`")))
}

fn left_out(kind: Option<&str>, ns: Option<&str>) {
    let kind = kind.unwrap_or("(no type)");
    let place = ns
        .map(|n| format!(" in namespace `{n}`"))
        .unwrap_or_default();
    tracing::info!("tools: `{kind}`{place} is a tool ferrite does not run; left out");
}

fn function(t: &Value, ns: Option<&str>) -> Result<Value, ApiError> {
    let name = name(t, "a function tool")?;
    let name = match ns {
        Some(ns) => format!("{ns}{DELIMITER}{name}"),
        None => name.to_string(),
    };
    Ok(json!({"type": "function", "function": {
        "name": name,
        "description": t.get("description").cloned().unwrap_or(json!("")),
        "parameters": t.get("parameters").cloned().unwrap_or(json!({"type": "object"})),
    }}))
}

/// The name the model knows a function by (an input `function_call` item's).
pub fn flat_name(item: &Value) -> Value {
    match (
        item.get("namespace").and_then(Value::as_str),
        item.get("name").and_then(Value::as_str),
    ) {
        (Some(ns), Some(name)) => json!(format!("{ns}{DELIMITER}{name}")),
        _ => item.get("name").cloned().unwrap_or(Value::Null),
    }
}

/// A called name split back into its namespace (one of the request's) and function name.
pub fn split_name<'a>(called: &'a str, namespaces: &'a [String]) -> (Option<&'a str>, &'a str) {
    for ns in namespaces {
        if let Some(f) = called
            .strip_prefix(ns.as_str())
            .and_then(|r| r.strip_prefix(DELIMITER))
        {
            return (Some(ns), f);
        }
    }
    (None, called)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_flatten_and_split_back() {
        let tools = json!([
            {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
            {"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [
                {"type": "function", "name": "spawn_agent", "description": "spawn"}]},
            {"type": "web_search", "external_web_access": false},
        ]);
        let chat = chat_tools(tools.as_array().unwrap()).unwrap();
        let ns = namespaces(tools.as_array().map(Vec::as_slice));
        let names: Vec<_> = chat.iter().map(|t| t["function"]["name"].clone()).collect();
        assert_eq!(
            names,
            [json!("exec_command"), json!("multi_agent_v1__spawn_agent")]
        );
        assert_eq!(ns, ["multi_agent_v1"]);
        assert_eq!(
            split_name("multi_agent_v1__spawn_agent", &ns),
            (Some("multi_agent_v1"), "spawn_agent")
        );
        assert_eq!(split_name("exec_command", &ns), (None, "exec_command"));
        let item =
            json!({"type": "function_call", "namespace": "multi_agent_v1", "name": "spawn_agent"});
        assert_eq!(flat_name(&item), json!("multi_agent_v1__spawn_agent"));
    }

    #[test]
    fn a_tool_without_a_type_or_name_is_refused() {
        assert!(chat_tools(&[json!({"name": "f"})]).is_err());
        assert!(chat_tools(&[json!({"type": "function"})]).is_err());
        assert!(chat_tools(&[json!({"type": "namespace", "name": "n"})]).is_err());
    }
}
