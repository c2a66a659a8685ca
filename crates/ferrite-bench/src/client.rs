//! One streamed request against an OpenAI-compatible endpoint, timed chunk by chunk.

use crate::dataset::BenchPrompt;
use crate::stats::RequestRecord;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

#[derive(Clone)]
pub struct Target {
    pub client: reqwest::Client,
    pub base_url: String,
    pub model: Option<String>,
    pub endpoint: Endpoint,
    pub ignore_eos: bool,
    /// Token ids sent with a logit bias of -100 (the OpenAI API's ban): the model's EOS ids
    /// for `--ban-eos`.
    pub banned_token_ids: Vec<u32>,
    pub api_key: Option<String>,
}

impl Target {
    fn body(&self, p: &BenchPrompt, seed: u64) -> Value {
        let mut b = match self.endpoint {
            Endpoint::Chat => json!({"messages": p.messages}),
            Endpoint::Completions => json!({"prompt": p.text}),
        };
        let o = b.as_object_mut().unwrap();
        if let Some(m) = &self.model {
            o.insert("model".into(), json!(m));
        }
        o.insert("max_tokens".into(), json!(p.max_tokens));
        o.insert("stream".into(), json!(true));
        o.insert("stream_options".into(), json!({"include_usage": true}));
        o.insert("temperature".into(), json!(0.0));
        o.insert("seed".into(), json!(seed));
        if self.ignore_eos {
            // vLLM and ferrite read `ignore_eos`; llama.cpp's server reads `ignore_eos` too.
            o.insert("ignore_eos".into(), json!(true));
        }
        if !self.banned_token_ids.is_empty() {
            let bias: serde_json::Map<String, Value> = self
                .banned_token_ids
                .iter()
                .map(|t| (t.to_string(), json!(-100)))
                .collect();
            o.insert("logit_bias".into(), Value::Object(bias));
        }
        b
    }

    pub async fn send(&self, p: &BenchPrompt, seed: u64) -> RequestRecord {
        let route = match self.endpoint {
            Endpoint::Chat => "chat/completions",
            Endpoint::Completions => "completions",
        };
        let url = format!("{}/{route}", self.base_url.trim_end_matches('/'));
        let mut rec = RequestRecord {
            input_tokens: p.input_tokens,
            ..Default::default()
        };
        let t0 = Instant::now();
        let mut req = self.client.post(&url).json(&self.body(p, seed));
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let resp = match req.send().await {
            Ok(r) if r.status().is_success() => r,
            Ok(r) => {
                let status = r.status();
                let text = r.text().await.unwrap_or_default();
                rec.error = Some(format!(
                    "HTTP {status}: {}",
                    text.chars().take(200).collect::<String>()
                ));
                return rec;
            }
            Err(e) => {
                rec.error = Some(format!("request failed: {e}"));
                return rec;
            }
        };
        let mut stream = resp.bytes_stream();
        let mut buf = Vec::new();
        let (mut last, mut chunks, mut usage_tokens, mut done) =
            (None::<Instant>, 0usize, None, false);
        while let Some(piece) = stream.next().await {
            let piece = match piece {
                Ok(b) => b,
                Err(e) => {
                    rec.error = Some(format!("stream broke: {e}"));
                    return rec;
                }
            };
            buf.extend_from_slice(&piece);
            while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..pos + 2).collect();
                let text = String::from_utf8_lossy(&event);
                for line in text.lines() {
                    let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                        continue;
                    };
                    if data == "[DONE]" {
                        done = true;
                        continue;
                    }
                    let Ok(v) = serde_json::from_str::<Value>(data) else {
                        continue;
                    };
                    if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                        usage_tokens = Some(n as usize);
                    }
                    let c = &v["choices"][0];
                    let content = c["delta"]["content"]
                        .as_str()
                        .or(c["text"].as_str())
                        .unwrap_or("");
                    if content.is_empty() {
                        continue;
                    }
                    let now = Instant::now();
                    match last {
                        None => rec.ttft = (now - t0).as_secs_f64(),
                        Some(l) => rec.itls.push((now - l).as_secs_f64()),
                    }
                    last = Some(now);
                    chunks += 1;
                }
            }
        }
        rec.e2e = t0.elapsed().as_secs_f64();
        rec.output_tokens = usage_tokens.unwrap_or(chunks);
        if !done {
            rec.error = Some("stream ended without [DONE]".into());
        } else if chunks == 0 {
            rec.error = Some("empty completion".into());
        } else {
            rec.ok = true;
        }
        rec
    }
}
