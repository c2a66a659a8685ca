//! vLLM's `--override-generation-config`: server-wide sampling defaults, as JSON with the
//! keys of a Hugging Face `generation_config.json` that vLLM takes (`temperature`, `top_p`,
//! `top_k`, `min_p`, `repetition_penalty`, `max_new_tokens`). A request's own value wins,
//! except `max_new_tokens`, which caps every request's `max_tokens` (as vLLM does).

use ferrite_core::sampling::SamplingParams;
use serde_json::{Map, Value};

const KEYS: &str = "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens";

/// The sampling defaults `json` sets over the built-in ones.
pub fn sampling_defaults(json: &str) -> Result<SamplingParams, String> {
    let bad = |m: String| format!("--override-generation-config: {m}");
    let map: Map<String, Value> =
        serde_json::from_str(json).map_err(|e| bad(format!("not a JSON object: {e}")))?;
    let mut d = SamplingParams::default();
    for (k, v) in &map {
        if !KEYS.split(", ").any(|known| known == k) {
            return Err(bad(format!("unknown key `{k}` (known: {KEYS})")));
        }
        let n = v
            .as_f64()
            .ok_or_else(|| bad(format!("`{k}` must be a number, got {v}")))?;
        let whole = || match v.as_i64() {
            Some(i) => Ok(i),
            None => Err(bad(format!("`{k}` must be a whole number, got {v}"))),
        };
        match k.as_str() {
            "temperature" => d.temperature = n as f32,
            "top_p" => d.top_p = n as f32,
            "min_p" => d.min_p = n as f32,
            "repetition_penalty" => d.repetition_penalty = n as f32,
            "top_k" => d.top_k = whole()?,
            "max_new_tokens" => d.max_tokens = Some(whole()?),
            _ => unreachable!("checked against KEYS"),
        }
    }
    d.validate().map_err(bad)?;
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_set_defaults_and_bad_ones_are_named() {
        let d =
            sampling_defaults(r#"{"temperature": 0, "top_k": 5, "max_new_tokens": 64}"#).unwrap();
        assert_eq!((d.temperature, d.top_k, d.max_tokens), (0.0, 5, Some(64)));
        assert_eq!(d.top_p, 1.0);
        for (json, want) in [
            (r#"{"stop": "x"}"#, "unknown key `stop`"),
            (r#"{"temperature": "hot"}"#, "must be a number"),
            (r#"{"top_k": 1.5}"#, "whole number"),
            (r#"{"temperature": -1}"#, "temperature"),
            ("[1]", "not a JSON object"),
        ] {
            let e = sampling_defaults(json).unwrap_err();
            assert!(e.contains(want), "{json}: {e}");
        }
    }
}
