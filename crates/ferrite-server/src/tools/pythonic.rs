//! Python-call syntax: `[get_weather(city="Paris"), now()]` (Llama 3.2 / 4), or calls in a
//! ```` ```tool_code ```` block (Gemma 3). Keyword arguments are Python literals (strings,
//! numbers, True / False / None, lists, dicts, tuples), turned into a JSON object when the
//! call's `)` arrives; the name goes out at its `(`.

use super::body::{Body, BodyState, PartialCall};
use serde_json::{Map, Number, Value};

/// A body: `[call, ...]`, or (in a tool_code block) calls up to the closing fence.
pub(super) fn body(text: &str, at_end: bool) -> Body {
    let mut p = Parser {
        s: text.as_bytes(),
        text,
        i: 0,
    };
    p.ws();
    let fenced = p.s.get(p.i) != Some(&b'[');
    if !fenced {
        p.i += 1;
    }
    let mut calls = Vec::new();
    let mut valid = 0;
    loop {
        p.ws();
        let end = if fenced { "```" } else { "]" };
        if !calls.is_empty() || fenced {
            if text[p.i..].starts_with(end) {
                return done(calls, p.i + end.len());
            }
            if p.i == p.s.len() || end.starts_with(&text[p.i..]) {
                return open(calls, at_end, valid);
            }
        }
        match p.call() {
            Ok(Some((call, done_call))) => {
                let finished = done_call;
                calls.push(call);
                if !finished {
                    return open(calls, at_end, valid);
                }
                valid = p.i;
                p.ws();
                if p.s.get(p.i) == Some(&b',') {
                    p.i += 1;
                }
            }
            Ok(None) => return open(calls, at_end, valid),
            Err(()) => {
                return Body {
                    calls,
                    state: BodyState::Invalid { valid },
                }
            }
        }
    }
}

fn done(calls: Vec<PartialCall>, n: usize) -> Body {
    Body {
        calls,
        state: BodyState::Done(n),
    }
}

/// The text ended: still open, or, at the end of the output, what parsed is all there is.
fn open(calls: Vec<PartialCall>, at_end: bool, valid: usize) -> Body {
    let state = if at_end && calls.iter().all(|c| !c.args.is_empty()) && !calls.is_empty() {
        BodyState::Done(valid)
    } else {
        BodyState::Open
    };
    Body { calls, state }
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
}

/// `Err`: not Python; `Ok(None)`: the text ends first.
type Parsed<T> = Result<Option<T>, ()>;

impl Parser<'_> {
    fn ws(&mut self) {
        self.i = super::json::skip_ws(self.s, self.i);
    }

    fn ident(&mut self) -> Parsed<String> {
        let start = self.i;
        while self.i < self.s.len()
            && (self.s[self.i].is_ascii_alphanumeric() || b"_.".contains(&self.s[self.i]))
        {
            self.i += 1;
        }
        if self.i == self.s.len() {
            return Ok(None);
        }
        if start == self.i || self.s[start].is_ascii_digit() {
            return Err(());
        }
        Ok(Some(self.text[start..self.i].to_string()))
    }

    fn expect(&mut self, c: u8) -> Parsed<()> {
        self.ws();
        match self.s.get(self.i) {
            None => Ok(None),
            Some(&x) if x == c => {
                self.i += 1;
                Ok(Some(()))
            }
            _ => Err(()),
        }
    }

    /// `name(key=value, ...)`: the call, and whether its `)` came.
    fn call(&mut self) -> Parsed<(PartialCall, bool)> {
        let Some(name) = self.ident()? else {
            return Ok(None);
        };
        if self.expect(b'(')?.is_none() {
            return Ok(None);
        }
        let mut call = PartialCall {
            name: Some(name),
            args: String::new(),
        };
        let mut args = Map::new();
        loop {
            self.ws();
            match self.s.get(self.i) {
                None => return Ok(Some((call, false))),
                Some(b')') => {
                    self.i += 1;
                    call.args = Value::Object(args).to_string();
                    return Ok(Some((call, true)));
                }
                Some(b',') => self.i += 1,
                _ => {}
            }
            self.ws();
            let Some(key) = self.ident()? else {
                return Ok(Some((call, false)));
            };
            if self.expect(b'=')?.is_none() {
                return Ok(Some((call, false)));
            }
            match self.value()? {
                Some(v) => {
                    args.insert(key, v);
                }
                None => return Ok(Some((call, false))),
            }
        }
    }

    fn value(&mut self) -> Parsed<Value> {
        self.ws();
        let Some(&c) = self.s.get(self.i) else {
            return Ok(None);
        };
        match c {
            b'"' | b'\'' => self.string(c),
            b'[' | b'(' => {
                let close = if c == b'[' { b']' } else { b')' };
                self.i += 1;
                let mut items = Vec::new();
                loop {
                    self.ws();
                    match self.s.get(self.i) {
                        None => return Ok(None),
                        Some(&x) if x == close => {
                            self.i += 1;
                            return Ok(Some(Value::Array(items)));
                        }
                        Some(b',') => self.i += 1,
                        _ => match self.value()? {
                            Some(v) => items.push(v),
                            None => return Ok(None),
                        },
                    }
                }
            }
            b'{' => {
                self.i += 1;
                let mut map = Map::new();
                loop {
                    self.ws();
                    match self.s.get(self.i) {
                        None => return Ok(None),
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Some(Value::Object(map)));
                        }
                        Some(b',') => self.i += 1,
                        _ => {
                            let Some(k) = self.value()? else {
                                return Ok(None);
                            };
                            if self.expect(b':')?.is_none() {
                                return Ok(None);
                            }
                            let Some(v) = self.value()? else {
                                return Ok(None);
                            };
                            let k = match k {
                                Value::String(s) => s,
                                other => other.to_string(),
                            };
                            map.insert(k, v);
                        }
                    }
                }
            }
            _ => {
                let start = self.i;
                while self.i < self.s.len()
                    && (self.s[self.i].is_ascii_alphanumeric() || b"+-._".contains(&self.s[self.i]))
                {
                    self.i += 1;
                }
                if self.i == self.s.len() {
                    return Ok(None);
                }
                let word = &self.text[start..self.i];
                Ok(Some(match word {
                    "True" | "true" => Value::Bool(true),
                    "False" | "false" => Value::Bool(false),
                    "None" | "null" => Value::Null,
                    w => {
                        if let Ok(i) = w.parse::<i64>() {
                            Value::Number(i.into())
                        } else {
                            let f: f64 = w.parse().map_err(|_| ())?;
                            Value::Number(Number::from_f64(f).ok_or(())?)
                        }
                    }
                }))
            }
        }
    }

    /// A quoted string with Python's common escapes.
    fn string(&mut self, quote: u8) -> Parsed<Value> {
        let mut out = String::new();
        let mut j = self.i + 1;
        let mut chars = self.text[j..].char_indices();
        while let Some((k, ch)) = chars.next() {
            match ch {
                '\\' => {
                    let Some((_, e)) = chars.next() else {
                        return Ok(None);
                    };
                    out.push(match e {
                        'n' => '\n',
                        't' => '\t',
                        'r' => '\r',
                        '0' => '\0',
                        other => other,
                    });
                }
                c if c as u32 == quote as u32 => {
                    j += k + 1;
                    self.i = j;
                    return Ok(Some(Value::String(out)));
                }
                c => out.push(c),
            }
        }
        Ok(None)
    }
}
