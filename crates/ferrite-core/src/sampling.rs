//! Per-request sampling and stopping parameters, validated before a request enters the engine.

use serde::{Deserialize, Serialize};

/// What a client asked for. Signed integers mirror the wire format so that a negative value
/// can be rejected with a clear message instead of failing to parse.
/// Below this temperature sampling is greedy (vLLM's `_SAMPLING_EPS`).
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// -1 or 0 disables top-k.
    pub top_k: i64,
    pub top_p: f32,
    pub min_p: f32,
    /// Makes sampling reproducible for this request whatever else shares the step.
    pub seed: Option<u64>,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// `None`: generate until a stop condition or `max_model_len`.
    pub max_tokens: Option<i64>,
    pub min_tokens: i64,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Number of top alternatives returned with each sampled token (0 = only the token's own).
    pub logprobs: Option<i64>,
    /// Same for prompt tokens.
    pub prompt_logprobs: Option<i64>,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    /// Isolates this request's cached prefixes from other tenants' (vLLM's `cache_salt`).
    pub cache_salt: Option<String>,
    /// Added to the logits of these tokens before sampling (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Only these tokens may be sampled (vLLM's `allowed_token_ids`).
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Token sequences never generated (vLLM's `bad_words`, tokenized): the last token of one
    /// is banned wherever the output ends with the rest of it.
    pub bad_words: Vec<Vec<u32>>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            max_tokens: None,
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            cache_salt: None,
            logit_bias: Vec::new(),
            allowed_token_ids: None,
            bad_words: Vec::new(),
        }
    }
}

/// Largest number of alternatives returned per position (OpenAI allows 20).
pub const MAX_LOGPROBS: i64 = 20;

impl SamplingParams {
    /// The next tokens `bad_words` forbid after `output`.
    pub fn bad_word_bans<'a>(&'a self, output: &'a [u32]) -> impl Iterator<Item = u32> + 'a {
        self.bad_words.iter().filter_map(move |w| {
            let (last, rest) = w.split_last()?;
            output.ends_with(rest).then_some(*last)
        })
    }

    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Temperatures below [`GREEDY_TEMPERATURE`] are greedy, as in vLLM: dividing logits by
    /// them overflows f32.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE || self.top_k == 1
    }

    /// Checks every field; the message names the field and the accepted range.
    pub fn validate(&self) -> Result<(), String> {
        let finite = |name: &str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(format!("`{name}` must be a finite number, got {v}"))
            }
        };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        if self.temperature < 0.0 {
            return Err(format!(
                "`temperature` must be non-negative, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("`top_p` must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("`min_p` must be in [0, 1], got {}", self.min_p));
        }
        if self.top_k < -1 {
            return Err(format!(
                "`top_k` must be -1 (disabled) or at least 1, got {}",
                self.top_k
            ));
        }
        if self.repetition_penalty <= 0.0 {
            return Err(format!(
                "`repetition_penalty` must be positive, got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("`{name}` must be in [-2, 2], got {v}"));
            }
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(format!(
                "`logit_bias` of token {t} must be in [-100, 100], got {b}"
            ));
        }
        if self
            .allowed_token_ids
            .as_ref()
            .is_some_and(|a| a.is_empty())
        {
            return Err("`allowed_token_ids` must not be empty".into());
        }
        if let Some(m) = self.max_tokens {
            if m < 1 {
                return Err(format!("`max_tokens` must be at least 1, got {m}"));
            }
        }
        if self.min_tokens < 0 {
            return Err(format!(
                "`min_tokens` must be non-negative, got {}",
                self.min_tokens
            ));
        }
        if let Some(m) = self.max_tokens {
            if self.min_tokens > m {
                return Err(format!(
                    "`min_tokens` ({}) must not exceed `max_tokens` ({m})",
                    self.min_tokens
                ));
            }
        }
        for (name, v) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if let Some(n) = v {
                if !(0..=MAX_LOGPROBS).contains(&n) {
                    return Err(format!("`{name}` must be in [0, {MAX_LOGPROBS}], got {n}"));
                }
            }
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return Err("`stop` strings must not be empty".into());
        }
        Ok(())
    }

    pub fn top_k(&self) -> Option<usize> {
        (self.top_k > 0).then_some(self.top_k as usize)
    }

    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    pub fn min_tokens(&self) -> usize {
        self.min_tokens.max(0) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_values_with_named_field() {
        let bad = [
            SamplingParams {
                temperature: -0.5,
                ..Default::default()
            },
            SamplingParams {
                max_tokens: Some(-3),
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                top_k: -7,
                ..Default::default()
            },
            SamplingParams {
                logprobs: Some(21),
                ..Default::default()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
        ];
        let fields = [
            "temperature",
            "max_tokens",
            "top_p",
            "top_k",
            "logprobs",
            "temperature",
        ];
        for (p, f) in bad.iter().zip(fields) {
            let err = p.validate().unwrap_err();
            assert!(err.contains(f), "{err} should name {f}");
        }
        assert!(SamplingParams::default().validate().is_ok());
        assert!(SamplingParams::greedy().validate().is_ok());
    }
}
