//! Structured output from the request: OpenAI's `response_format`, vLLM's `structured_outputs`
//! and its legacy `guided_*` fields, read into one grammar spec and compiled off the runtime.
//! Exactly one source may be given; anything that does not compile is a 400 naming it.

use crate::error::ApiError;
use crate::prompt_work::off_runtime;
use crate::protocol::CommonParams;
use crate::state::SharedState;
use ferrite_grammar::{Grammar, Spec};
use serde_json::Value;

fn bad(msg: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad_request(msg.into()).with_param(param)
}

/// The request field a nested name belongs to (`structured_outputs.json` -> `structured_outputs`).
fn field(param: &str) -> &'static str {
    const FIELDS: [&str; 6] = [
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ];
    let top = param.split('.').next().unwrap_or(param);
    FIELDS
        .into_iter()
        .find(|f| *f == top)
        .unwrap_or("response_format")
}

/// A schema given as an object, or as a string holding one (vLLM accepts both).
fn schema(v: &Value, param: &str) -> Result<Value, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| bad(format!("`{param}` is not valid JSON: {e}"), field(param))),
        other => Err(bad(
            format!("`{param}` must be a JSON schema object, got {other}"),
            field(param),
        )),
    }
}

fn string(v: &Value, param: &str) -> Result<String, ApiError> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| bad(format!("`{param}` must be a string, got {v}"), field(param)))
}

fn choice(v: &Value, param: &str) -> Result<Vec<String>, ApiError> {
    let list = v.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
        bad(
            format!("`{param}` must be a non-empty list of strings"),
            field(param),
        )
    })?;
    list.iter().map(|s| string(s, param)).collect()
}

/// OpenAI's `response_format`: `text`, `json_object`, or `json_schema` with its `schema`.
fn response_format(rf: &Value) -> Result<Option<Spec>, ApiError> {
    const P: &str = "response_format";
    let kind = rf
        .get("type")
        .ok_or_else(|| bad("`response_format` needs a `type`", P))?;
    match kind.as_str() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Spec::JsonObject)),
        Some("json_schema") => {
            let js = rf.get("json_schema").ok_or_else(|| {
                bad("`response_format` of type `json_schema` needs `json_schema`", P)
            })?;
            if js.get("name").and_then(Value::as_str).is_none() {
                return Err(bad("`response_format.json_schema` needs a `name`", P));
            }
            let s = js
                .get("schema")
                .ok_or_else(|| bad("`response_format.json_schema` needs a `schema`", P))?;
            Ok(Some(Spec::JsonSchema(schema(s, "response_format.json_schema.schema")?)))
        }
        Some(other) => Err(bad(
            format!(
                "`response_format.type` must be `text`, `json_object` or `json_schema`, got `{other}`"
            ),
            P,
        )),
        None => Err(bad(
            format!("`response_format.type` must be a string, got {kind}"),
            P,
        )),
    }
}

/// vLLM's `structured_outputs`: one of `json`, `regex`, `choice`, `grammar`, `json_object`.
fn structured_outputs(so: &Value) -> Result<Option<Spec>, ApiError> {
    const P: &str = "structured_outputs";
    let o = so
        .as_object()
        .ok_or_else(|| bad("`structured_outputs` must be an object", P))?;
    let mut specs = Vec::new();
    for (k, v) in o {
        if v.is_null() {
            continue;
        }
        let p = format!("structured_outputs.{k}");
        match k.as_str() {
            "json" => specs.push(Spec::JsonSchema(schema(v, &p)?)),
            "regex" => specs.push(Spec::Regex(string(v, &p)?)),
            "choice" => specs.push(Spec::Choice(choice(v, &p)?)),
            "grammar" => specs.push(Spec::Lark(string(v, &p)?)),
            "json_object" if v.as_bool() == Some(true) => specs.push(Spec::JsonObject),
            "json_object" => {}
            // Options of the vLLM dataclass that change nothing here.
            "disable_fallback" | "disable_any_whitespace" | "disable_additional_properties"
            | "whitespace_pattern" | "backend" => {}
            other => {
                return Err(bad(
                    format!("`structured_outputs.{other}` is not supported (json, regex, choice, grammar, json_object)"),
                    P,
                ))
            }
        }
    }
    match specs.len() {
        0 => Ok(None),
        1 => Ok(specs.pop()),
        _ => Err(bad(
            "`structured_outputs` takes one of json, regex, choice, grammar, json_object",
            P,
        )),
    }
}

/// The request's one grammar spec, if it asks for structured output.
pub fn spec(c: &CommonParams) -> Result<Option<Spec>, ApiError> {
    let mut found: Vec<(&str, Spec)> = Vec::new();
    if let Some(rf) = &c.response_format {
        if let Some(s) = response_format(rf)? {
            found.push(("response_format", s));
        }
    }
    if let Some(so) = &c.structured_outputs {
        if let Some(s) = structured_outputs(so)? {
            found.push(("structured_outputs", s));
        }
    }
    if let Some(v) = &c.guided_json {
        found.push(("guided_json", Spec::JsonSchema(schema(v, "guided_json")?)));
    }
    if let Some(v) = &c.guided_regex {
        found.push(("guided_regex", Spec::Regex(string(v, "guided_regex")?)));
    }
    if let Some(v) = &c.guided_choice {
        found.push(("guided_choice", Spec::Choice(choice(v, "guided_choice")?)));
    }
    if let Some(v) = &c.guided_grammar {
        found.push(("guided_grammar", Spec::Lark(string(v, "guided_grammar")?)));
    }
    match found.len() {
        0 | 1 => Ok(found.pop().map(|(_, s)| s)),
        _ => {
            let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
            Err(bad(
                format!(
                    "only one structured-output field may be given, got {}",
                    names.join(", ")
                ),
                names[1],
            ))
        }
    }
}

/// `spec` compiled against the model's vocabulary, off the runtime (a large schema takes
/// milliseconds); `None` without one.
pub async fn compile(state: &SharedState, spec: Option<Spec>) -> Result<Option<Grammar>, ApiError> {
    let Some(spec) = spec else { return Ok(None) };
    off_runtime(state, move |s| {
        let g = s.grammars.as_ref().map_err(|e| {
            ApiError::bad_request(format!(
                "structured output is unavailable for this model: {e}"
            ))
        })?;
        g.compile(&spec).map(Some).map_err(|e| {
            ApiError::bad_request(format!(
                "the structured-output constraint does not compile: {e:#}"
            ))
        })
    })
    .await
}
