//! Qwen3-Coder's XML calls:
//! `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`.
//! Values are raw text, typed by the tool's JSON schema (a string unless the schema says
//! number, integer, boolean, object or array and the text parses as one). The arguments object
//! grows a parameter at a time: `{"k": v`, `, "k2": v2`, then `}` at `</function>`.

use super::body::{param_type, Body, BodyState, PartialCall};
use serde_json::Value;

pub(super) fn body(text: &str, tools: &[Value], at_end: bool) -> Body {
    const FUNC: &str = "<function=";
    const PARAM: &str = "<parameter=";
    const PARAM_END: &str = "</parameter>";
    const FUNC_END: &str = "</function>";
    const END: &str = "</tool_call>";
    let t = text.trim_start();
    let mut i = text.len() - t.len();
    let open = |calls: Vec<PartialCall>| Body {
        calls,
        state: BodyState::Open,
    };
    let invalid = || Body {
        calls: vec![],
        state: BodyState::Invalid { valid: 0 },
    };
    if !text[i..].starts_with(FUNC) {
        return if FUNC.starts_with(&text[i..]) {
            open(vec![])
        } else {
            invalid()
        };
    }
    i += FUNC.len();
    let Some(close) = text[i..].find('>') else {
        return open(vec![]);
    };
    let name = text[i..i + close].trim().to_string();
    i += close + 1;
    let mut call = PartialCall {
        name: Some(name.clone()),
        args: "{".into(),
    };
    let mut first = true;
    loop {
        let rest = text[i..].trim_start();
        i = text.len() - rest.len();
        if rest.starts_with(FUNC_END) {
            call.args.push('}');
            i += FUNC_END.len();
            let rest = text[i..].trim_start();
            let j = text.len() - rest.len();
            let state = if rest.starts_with(END) {
                BodyState::Done(j + END.len())
            } else if END.starts_with(rest) && !at_end {
                BodyState::Open
            } else {
                BodyState::Done(i)
            };
            return Body {
                calls: vec![call],
                state,
            };
        }
        if !rest.starts_with(PARAM) {
            let partial = PARAM.starts_with(rest) || FUNC_END.starts_with(rest);
            return if partial {
                Body {
                    calls: vec![call_so_far(call, first)],
                    state: BodyState::Open,
                }
            } else {
                invalid()
            };
        }
        let key_at = i + PARAM.len();
        let (Some(k), Some(v_end)) = (text[key_at..].find('>'), text[key_at..].find(PARAM_END))
        else {
            return Body {
                calls: vec![call_so_far(call, first)],
                state: BodyState::Open,
            };
        };
        if k > v_end {
            return invalid();
        }
        let key = text[key_at..key_at + k].trim();
        let raw = &text[key_at + k + 1..key_at + v_end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let value = typed(raw, param_type(tools, &name, key));
        if !first {
            call.args.push_str(", ");
        }
        first = false;
        call.args += &format!("{}: {}", Value::String(key.into()), value);
        i = key_at + v_end + PARAM_END.len();
    }
}

/// A call whose parameters are still coming: its object opened once one is there.
fn call_so_far(mut call: PartialCall, first: bool) -> PartialCall {
    if first {
        call.args.clear();
    }
    call
}

fn typed(raw: &str, ty: Option<&str>) -> Value {
    let parsed = || serde_json::from_str::<Value>(raw.trim()).ok();
    let keep = |v: &Value| match ty {
        Some("string") => false,
        Some("integer") => v.is_i64() || v.is_u64(),
        Some("number") => v.is_number(),
        Some("boolean") => v.is_boolean(),
        Some("object") => v.is_object(),
        Some("array") => v.is_array(),
        Some("null") => v.is_null(),
        // No type (an enum, say): the text as JSON when it is JSON.
        _ => true,
    };
    match parsed() {
        Some(v) if keep(&v) => v,
        _ if ty == Some("boolean") => match raw.trim() {
            "True" => Value::Bool(true),
            "False" => Value::Bool(false),
            _ => Value::String(raw.into()),
        },
        _ => Value::String(raw.into()),
    }
}
