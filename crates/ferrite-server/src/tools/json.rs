//! The JSON call formats: Hermes (`<tool_call>` blocks), Llama 3 (bare objects), Mistral
//! (`[TOOL_CALLS]` arrays). A call object is scanned by hand so a partial one still yields its
//! name and the raw text of its arguments so far: those bytes are the model's own, so streamed
//! fragments and the whole response's arguments are the same string.

use super::body::{Body, BodyState, PartialCall};

/// How far a JSON value starting at `i` reaches.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Scan {
    /// It ends before byte `.0`.
    Done(usize),
    /// The text ends inside it.
    More,
    Bad,
}

pub(super) fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && s[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// A JSON string starting at `i` (its opening quote).
fn scan_string(s: &[u8], i: usize) -> Scan {
    let mut j = i + 1;
    while j < s.len() {
        match s[j] {
            b'\\' => j += 2,
            b'"' => return Scan::Done(j + 1),
            _ => j += 1,
        }
    }
    Scan::More
}

/// Any JSON value at `i` (no leading whitespace).
pub(super) fn scan_value(s: &[u8], i: usize) -> Scan {
    let Some(&c) = s.get(i) else {
        return Scan::More;
    };
    match c {
        b'"' => scan_string(s, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < s.len() {
                match s[j] {
                    b'"' => match scan_string(s, j) {
                        Scan::Done(e) => {
                            j = e;
                            continue;
                        }
                        other => return other,
                    },
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Scan::Done(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            Scan::More
        }
        b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
            let mut j = i;
            while j < s.len() && (s[j].is_ascii_alphanumeric() || b"+-.".contains(&s[j])) {
                j += 1;
            }
            if j == s.len() {
                Scan::More
            } else {
                Scan::Done(j)
            }
        }
        _ => Scan::Bad,
    }
}

/// One call object `{"name": ..., "arguments" | "parameters": ...}` at `i`: the call so far
/// and where the object ends.
pub(super) fn call_object(text: &str, i: usize) -> (PartialCall, Scan) {
    let s = text.as_bytes();
    let mut call = PartialCall::default();
    if s.get(i) != Some(&b'{') {
        return (call, if i >= s.len() { Scan::More } else { Scan::Bad });
    }
    let mut j = i + 1;
    let mut args_key = false;
    loop {
        j = skip_ws(s, j);
        match s.get(j) {
            None => return (call, Scan::More),
            Some(b'}') => {
                if call.name.is_none() {
                    return (call, Scan::Bad);
                }
                if !args_key {
                    call.args = "{}".into();
                }
                return (call, Scan::Done(j + 1));
            }
            Some(b',') => j = skip_ws(s, j + 1),
            _ => {}
        }
        let key_end = match scan_string(s, j) {
            _ if s.get(j) != Some(&b'"') => {
                return (call, if j >= s.len() { Scan::More } else { Scan::Bad })
            }
            Scan::Done(e) => e,
            other => return (call, other),
        };
        let key: String = serde_json::from_str(&text[j..key_end]).unwrap_or_default();
        j = skip_ws(s, key_end);
        match s.get(j) {
            None => return (call, Scan::More),
            Some(b':') => j = skip_ws(s, j + 1),
            _ => return (call, Scan::Bad),
        }
        let start = j;
        let scan = scan_value(s, start);
        let is_args = key == "arguments" || key == "parameters";
        match (&scan, key.as_str()) {
            (Scan::Bad, _) => return (call, Scan::Bad),
            (Scan::Done(e), "name") => match serde_json::from_str::<String>(&text[start..*e]) {
                Ok(n) => call.name = Some(n),
                Err(_) => return (call, Scan::Bad),
            },
            (Scan::Done(e), _) if is_args => {
                args_key = true;
                call.args = if s[start] == b'"' {
                    // Arguments sent as a JSON string: the string's text.
                    serde_json::from_str(&text[start..*e]).unwrap_or_default()
                } else {
                    text[start..*e].to_string()
                };
            }
            (Scan::More, _) if is_args && start < s.len() && s[start] != b'"' => {
                call.args = text[start..].to_string();
                return (call, Scan::More);
            }
            (Scan::More, _) => return (call, Scan::More),
            (Scan::Done(_), _) => {}
        }
        let Scan::Done(e) = scan else { unreachable!() };
        j = e;
    }
}

/// `{...}</tool_call>`; the end marker may be missing at the end of the output.
pub(super) fn hermes(body: &str, at_end: bool) -> Body {
    const END: &str = "</tool_call>";
    let s = body.as_bytes();
    let i = skip_ws(s, 0);
    let (call, scan) = call_object(body, i);
    let state = match scan {
        Scan::Bad => BodyState::Invalid { valid: 0 },
        Scan::More => BodyState::Open,
        Scan::Done(e) => {
            let j = skip_ws(s, e);
            let rest = &body[j..];
            if rest.starts_with(END) {
                BodyState::Done(j + END.len())
            } else if END.starts_with(rest) && !at_end {
                BodyState::Open
            } else {
                BodyState::Done(e)
            }
        }
    };
    Body {
        calls: vec![call],
        state,
    }
}

/// Objects one after another, separated by whitespace or `;`.
pub(super) fn llama3(body: &str, at_end: bool) -> Body {
    sequence(body, at_end, b';', None)
}

/// `[obj, obj]`, or `name[ARGS]{...}` (the newer tokenizers' form).
pub(super) fn mistral(body: &str, at_end: bool) -> Body {
    let s = body.as_bytes();
    let i = skip_ws(s, 0);
    match s.get(i) {
        None => Body {
            calls: vec![],
            state: BodyState::Open,
        },
        Some(b'[') => sequence(body, at_end, b',', Some(i)),
        Some(_) => named_args(body, i),
    }
}

/// `name[ARGS]{...}`.
fn named_args(body: &str, i: usize) -> Body {
    const TAG: &str = "[ARGS]";
    let s = body.as_bytes();
    let Some(tag) = body[i..].find(TAG).map(|t| i + t) else {
        let open = body[i..]
            .chars()
            .all(|c| c.is_alphanumeric() || "_-.[ARGS".contains(c));
        return Body {
            calls: vec![],
            state: if open {
                BodyState::Open
            } else {
                BodyState::Invalid { valid: 0 }
            },
        };
    };
    let name = body[i..tag].trim().to_string();
    let start = skip_ws(s, tag + TAG.len());
    let mut call = PartialCall {
        name: Some(name),
        args: String::new(),
    };
    let state = match scan_value(s, start) {
        Scan::Done(e) if s[start] == b'{' => {
            call.args = body[start..e].to_string();
            BodyState::Done(e)
        }
        Scan::More if start < s.len() && s[start] == b'{' => {
            call.args = body[start..].to_string();
            BodyState::Open
        }
        Scan::More => BodyState::Open,
        _ => BodyState::Invalid { valid: 0 },
    };
    Body {
        calls: vec![call],
        state,
    }
}

/// Call objects separated by `sep` (and whitespace); inside `[...]` when `open` is the
/// bracket's offset.
fn sequence(body: &str, at_end: bool, sep: u8, open: Option<usize>) -> Body {
    let s = body.as_bytes();
    let mut calls = Vec::new();
    let mut j = open.map_or(0, |o| o + 1);
    let mut valid = 0;
    loop {
        j = skip_ws(s, j);
        if open.is_some() && s.get(j) == Some(&b']') && !calls.is_empty() {
            return Body {
                calls,
                state: BodyState::Done(j + 1),
            };
        }
        let (call, scan) = call_object(body, j);
        match scan {
            Scan::Done(e) => {
                calls.push(call);
                valid = e;
                j = skip_ws(s, e);
                match s.get(j) {
                    Some(&c) if c == sep => j += 1,
                    Some(b'{') if open.is_none() => {}
                    Some(b']') if open.is_some() => {}
                    None if !at_end => {
                        return Body {
                            calls,
                            state: BodyState::Open,
                        }
                    }
                    _ => {
                        return Body {
                            calls,
                            state: if open.is_some() {
                                BodyState::Invalid { valid }
                            } else {
                                BodyState::Done(valid)
                            },
                        }
                    }
                }
            }
            Scan::More => {
                calls.push(call);
                return Body {
                    calls,
                    state: BodyState::Open,
                };
            }
            Scan::Bad => {
                return Body {
                    calls,
                    state: BodyState::Invalid { valid },
                }
            }
        }
    }
}
