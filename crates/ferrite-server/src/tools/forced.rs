//! The grammar that forces tool calls for `tool_choice` `required` (any of the tools: one
//! call, or with `parallel_tool_calls` up to [`MAX_FORCED_CALLS`]) or a named function (exactly
//! one call of it), in the parser's own call format, the arguments following each tool's
//! schema (vLLM does the same).

use super::ToolParser;
use ferrite_grammar::Spec;
use serde_json::{json, Value};

/// Most calls a `required` tool choice may make in one reply: a small model offered more
/// goes on calling until its token budget runs out.
pub const MAX_FORCED_CALLS: usize = 4;

/// `None` for `auto` and `none`.
pub fn spec(parser: ToolParser, tools: &[Value], choice: &Value, parallel: bool) -> Option<Spec> {
    let named = choice.pointer("/function/name").and_then(Value::as_str);
    if named.is_none() && choice != "required" {
        return None;
    }
    let offered: Vec<(&str, Value)> = tools
        .iter()
        .filter_map(|t| {
            let f = t.get("function")?;
            let name = f.get("name")?.as_str()?;
            let params = f
                .get("parameters")
                .cloned()
                .unwrap_or(json!({"type": "object"}));
            (named.is_none_or(|n| n == name)).then_some((name, params))
        })
        .collect();
    let (prefix, call, sep, suffix) = match parser {
        ToolParser::Hermes => (
            "",
            json_call(&offered, "arguments", "<tool_call>\n", "\n</tool_call>"),
            "\n",
            "",
        ),
        ToolParser::Llama3Json => ("", json_call(&offered, "parameters", "", ""), "; ", ""),
        ToolParser::Mistral => (
            "[TOOL_CALLS][",
            json_call(&offered, "arguments", "", ""),
            ", ",
            "]",
        ),
        ToolParser::Pythonic => ("[", alternatives(&offered, pythonic_call), ", ", "]"),
        ToolParser::Qwen3Coder => ("", alternatives(&offered, xml_call), "\n", ""),
    };
    let more = match (named, parallel) {
        (None, true) => MAX_FORCED_CALLS - 1,
        _ => 0,
    };
    // call (sep call (sep call)?)? ...: a bounded number of calls, each optional after the first.
    let mut rest = String::new();
    for _ in 0..more {
        rest = format!("({} call {rest})?", lit(sep));
    }
    // A newline after a call is how these formats go on to the next one, and how models
    // end a turn: allowed after the last call too, so that the model may end after any call
    // rather than be held to a further one.
    let end = match sep {
        "\n" => format!("{}?", lit(sep)),
        _ => lit(suffix),
    };
    let start = format!("start: {} call {rest} {end}", lit(prefix));
    Some(Spec::Lark(format!("{start}\ncall: {call}\n")))
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    if s.is_empty() {
        return String::new();
    }
    serde_json::to_string(s).expect("a string serializes")
}

/// One JSON object `{"name": ..., key: arguments}` of any offered tool, inside `open`/`close`.
fn json_call(offered: &[(&str, Value)], key: &str, open: &str, close: &str) -> String {
    let calls: Vec<Value> = offered
        .iter()
        .map(|(name, params)| {
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, key: params},
                "required": ["name", key],
                "additionalProperties": false,
            })
        })
        .collect();
    let call = json!({
        "anyOf": calls,
        "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
    });
    format!("{} %json {call} {}", lit(open), lit(close))
}

fn alternatives(offered: &[(&str, Value)], one: fn(&str, &Value) -> String) -> String {
    let alts: Vec<String> = offered
        .iter()
        .map(|(n, p)| format!("({})", one(n, p)))
        .collect();
    alts.join(" | ")
}

/// The schema's properties, required ones first (in order), then whether each is required.
fn params(schema: &Value) -> Vec<(String, Value, bool)> {
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut out: Vec<(String, Value, bool)> = schema
        .get("properties")
        .and_then(Value::as_object)
        .map(|p| {
            p.iter()
                .map(|(k, v)| (k.clone(), v.clone(), required.contains(&k.as_str())))
                .collect()
        })
        .unwrap_or_default();
    out.sort_by_key(|(_, _, req)| !req);
    out
}

/// `name(key=value, ...)`: values as JSON literals (the pythonic parser reads JSON's
/// true/false/null too); optional keyword arguments follow the required ones.
fn pythonic_call(name: &str, schema: &Value) -> String {
    let arg = |sep: &str, k: &str, v: &Value| {
        format!("{} %json {}", lit(&format!("{sep}{k}=")), value_schema(v))
    };
    let ps = params(schema);
    let args = match ps.iter().position(|p| !p.2) {
        // No required argument: the first optional one opens the list.
        Some(0) => {
            let rest: Vec<String> = ps[1..]
                .iter()
                .map(|(k, v, _)| format!("({})?", arg(", ", k, v)))
                .collect();
            match ps.first() {
                Some((k, v, _)) => format!("({} {})?", arg("", k, v), rest.join(" ")),
                None => String::new(),
            }
        }
        _ => {
            let items: Vec<String> = ps
                .iter()
                .enumerate()
                .map(|(i, (k, v, req))| {
                    let a = arg(if i == 0 { "" } else { ", " }, k, v);
                    if *req {
                        a
                    } else {
                        format!("({a})?")
                    }
                })
                .collect();
            items.join(" ")
        }
    };
    format!("{} {args} \")\"", lit(&format!("{name}(")))
}

/// `<function=name>` with a `<parameter=key>` block per argument: strings raw (no `<`), other
/// types as JSON.
fn xml_call(name: &str, schema: &Value) -> String {
    let mut body = String::new();
    for (k, v, req) in params(schema) {
        let value = raw_value(&v).unwrap_or_else(|| format!("%json {}", value_schema(&v)));
        let block = format!(
            "{} {value} {}",
            lit(&format!("<parameter={k}>\n")),
            lit("\n</parameter>\n")
        );
        body.push_str(&if req {
            format!(" {block}")
        } else {
            format!(" ({block})?")
        });
    }
    format!(
        "{}{body} {}",
        lit(&format!("<tool_call>\n<function={name}>\n")),
        lit("</function>\n</tool_call>")
    )
}

/// A string parameter as Qwen3-Coder writes it: raw text (no `<`, within `maxLength`), or one
/// of its enum's strings; `None` for other types (written as JSON).
fn raw_value(v: &Value) -> Option<String> {
    if let Some(e) = v.get("enum").and_then(Value::as_array) {
        let words: Option<Vec<String>> = e.iter().map(|w| w.as_str().map(lit)).collect();
        return words.map(|w| format!("({})", w.join(" | ")));
    }
    if v.get("type").and_then(Value::as_str) != Some("string") {
        return None;
    }
    Some(match v.get("maxLength").and_then(Value::as_u64) {
        Some(n) => format!("/[^<]{{1,{}}}/", n.max(1)),
        None => "/[^<]+/".into(),
    })
}

/// A property's schema for `%json`, compact and on one line.
fn value_schema(v: &Value) -> String {
    let mut v = v.clone();
    if let Some(o) = v.as_object_mut() {
        o.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    v.to_string()
}
