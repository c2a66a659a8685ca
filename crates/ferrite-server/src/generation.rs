//! Shared by both endpoints: request validation into sampling params, starting the `n`
//! engine requests of a call, and reading their outputs with timing for the metrics.

use crate::error::ApiError;
use crate::metrics::RequestTimes;
use crate::protocol::{CommonParams, Usage};
use crate::state::AppState;
use ferrite_core::constraint::Constraint;
use ferrite_core::engine::RequestStream;
use ferrite_core::output::{RequestOutput, TokenLogprob};
use ferrite_core::request::FinishReason;
use ferrite_core::sampling::SamplingParams;
use ferrite_grammar::Grammar;
use serde_json::Value;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tokio::sync::watch;

pub fn finish_reason(r: FinishReason) -> &'static str {
    r.as_str()
}

/// Maps the OpenAI fields (and vLLM's extras) onto engine sampling params.
/// `vocab_size`: the tokenizer's, which `stop_token_ids` must fall within; `encode`: text to
/// token ids without special tokens (for `bad_words`).
pub fn sampling_params(
    c: &CommonParams,
    d: &SamplingParams,
    vocab_size: usize,
    encode: &dyn Fn(&str) -> Vec<u32>,
    max_tokens: Option<i64>,
    logprobs: Option<i64>,
    prompt_logprobs: Option<i64>,
) -> Result<SamplingParams, ApiError> {
    let bad_words = bad_words(c, encode)?;
    let logit_bias = logit_bias(c, vocab_size)?;
    if let Some(bad) = c
        .allowed_token_ids
        .iter()
        .flatten()
        .find(|&&t| t as usize >= vocab_size)
    {
        return Err(ApiError::bad_request(format!(
            "`allowed_token_ids` holds {bad}, outside the vocabulary of {vocab_size}"
        ))
        .with_param("allowed_token_ids"));
    }
    if let Some(bad) = c.stop_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(ApiError::bad_request(format!(
            "`stop_token_ids` holds {bad}, outside the vocabulary of {vocab_size}"
        ))
        .with_param("stop_token_ids"));
    }
    let max_tokens = match (max_tokens, d.max_tokens) {
        (Some(asked), Some(cap)) => Some(asked.min(cap)),
        (asked, cap) => asked.or(cap),
    };
    let p = SamplingParams {
        temperature: c.temperature.unwrap_or(d.temperature),
        top_k: c.top_k.unwrap_or(d.top_k),
        top_p: c.top_p.unwrap_or(d.top_p),
        min_p: c.min_p.unwrap_or(d.min_p),
        seed: c.seed.map(|s| s as u64),
        repetition_penalty: c.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: c.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: c.frequency_penalty.unwrap_or(d.frequency_penalty),
        max_tokens,
        min_tokens: c.min_tokens.unwrap_or(0),
        stop: c.stop.clone().map(|s| s.into_vec()).unwrap_or_default(),
        stop_token_ids: c.stop_token_ids.clone(),
        ignore_eos: c.ignore_eos,
        logprobs,
        prompt_logprobs,
        include_stop_str_in_output: c.include_stop_str_in_output,
        skip_special_tokens: c.skip_special_tokens.unwrap_or(true),
        cache_salt: c.cache_salt.clone(),
        logit_bias,
        allowed_token_ids: c.allowed_token_ids.clone(),
        bad_words,
    };
    p.validate().map_err(ApiError::bad_request)?;
    Ok(p)
}

/// [`sampling_params`] against the served model's tokenizer.
pub fn model_sampling_params(
    state: &AppState,
    c: &CommonParams,
    max_tokens: Option<i64>,
    logprobs: Option<i64>,
    prompt_logprobs: Option<i64>,
) -> Result<SamplingParams, ApiError> {
    let vocab = state.tokenizer.tokenizer.get_vocab_size(true);
    let encode = |t: &str| state.tokenizer.encode(t, false).unwrap_or_default();
    sampling_params(
        c,
        &state.sampling_defaults,
        vocab,
        &encode,
        max_tokens,
        logprobs,
        prompt_logprobs,
    )
}

/// vLLM's `bad_words`: each word as its tokens alone and, when that tokenizes differently
/// (another first token, as many tokens), after a space, as vLLM bans both.
fn bad_words(
    c: &CommonParams,
    encode: &dyn Fn(&str) -> Vec<u32>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let bad = |m: &str| ApiError::bad_request(m).with_param("bad_words");
    let words = match &c.bad_words {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad("`bad_words` must be a list of strings")),
    };
    if words.len() > 1024 {
        return Err(bad("`bad_words` holds more than 1024 words"));
    }
    let mut out: Vec<Vec<u32>> = Vec::new();
    for w in words {
        let w = w
            .as_str()
            .ok_or_else(|| bad("`bad_words` must be a list of strings"))?
            .trim_start();
        let plain = encode(w);
        if plain.is_empty() {
            continue;
        }
        let spaced = encode(&format!(" {w}"));
        if spaced.len() == plain.len() && spaced.first() != plain.first() {
            out.push(spaced);
        }
        out.push(plain);
    }
    Ok(out)
}

/// OpenAI's `logit_bias`: token ids (as strings) to a bias in [-100, 100].
fn logit_bias(c: &CommonParams, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::bad_request(m).with_param("logit_bias");
    let Some(map) = &c.logit_bias else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(k, v)| {
            let t: u32 = k
                .parse()
                .map_err(|_| bad(format!("`logit_bias` keys are token ids, got `{k}`")))?;
            if t as usize >= vocab_size {
                return Err(bad(format!(
                    "`logit_bias` names token {t}, outside the vocabulary of {vocab_size}"
                )));
            }
            let b = v.as_f64().ok_or_else(|| {
                bad(format!(
                    "`logit_bias` of token {t} must be a number, got {v}"
                ))
            })?;
            Ok((t, b as f32))
        })
        .collect()
}

pub fn check_n(n: Option<i64>) -> Result<usize, ApiError> {
    match n.unwrap_or(1) {
        n if (1..=128).contains(&n) => Ok(n as usize),
        n => {
            Err(ApiError::bad_request(format!("`n` must be in [1, 128], got {n}")).with_param("n"))
        }
    }
}

pub fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    if state.draining.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    match model {
        Some(m) if m != &state.model_name => {
            Err(ApiError::not_found(format!("The model `{m}` does not exist.")).with_param("model"))
        }
        _ if state.embedder.is_some() => Err(ApiError::bad_request(format!(
            "the model `{}` is an embedding model: it serves /v1/embeddings, /v1/score and \
             /v1/rerank, not text generation",
            state.model_name
        ))),
        _ => Ok(()),
    }
}

/// A choice whose request starts once its prompt's leader has computed (and cached) it.
struct Deferred {
    leader_ready: watch::Receiver<bool>,
    params: SamplingParams,
    constraint: Option<Constraint>,
}

/// One choice of a response: an engine request and its timeline.
pub struct Choice {
    pub index: usize,
    pub prompt: Vec<u32>,
    stream: Option<RequestStream>,
    deferred: Option<Deferred>,
    /// Set on the first output of a leader, releasing the deferred choices of its prompt.
    ready: Option<watch::Sender<bool>>,
    start: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    itls: Vec<f64>,
    queue: f64,
}

/// Starts `n` requests per prompt; if any is refused, the ones started are dropped (aborted).
/// With prefix caching, the `n - 1` siblings of a prompt start once the first one has
/// computed it, so the prompt is computed once and its blocks are shared.
pub fn start_choices(
    state: &AppState,
    prompts: Vec<Vec<u32>>,
    params: &SamplingParams,
    n: usize,
    grammar: Option<&Grammar>,
) -> Result<Vec<Choice>, ApiError> {
    let waiting = state.engine.stats().num_waiting;
    if waiting + prompts.len() * n > state.max_queued_requests {
        return Err(ApiError::unavailable(format!(
            "{waiting} requests are waiting and this call adds {}: past --max-queued-requests {}; retry later",
            prompts.len() * n,
            state.max_queued_requests
        )));
    }
    let share = n > 1 && state.engine.info().prefix_caching;
    let mut choices = Vec::with_capacity(prompts.len() * n);
    for prompt in prompts {
        let (tx, rx) = watch::channel(false);
        for i in 0..n {
            let mut p = params.clone();
            // With a seed, choices of one call must still differ.
            if let (Some(s), true) = (p.seed, n > 1) {
                p.seed = Some(s.wrapping_add(choices.len() as u64));
            }
            let leader = i == 0 || !share;
            // Each choice follows its own copy of the grammar.
            let constraint = grammar.map(|g| g.fork().into_constraint());
            let (stream, deferred) = if leader {
                let s = state
                    .engine
                    .add_constrained(prompt.clone(), p.clone(), constraint)?;
                if state.log_requests {
                    tracing::info!(
                        "request {} received: {} prompt tokens, max_tokens {:?}, temperature {}, top_p {}, seed {:?}",
                        s.id, prompt.len(), p.max_tokens, p.temperature, p.top_p, p.seed
                    );
                }
                (Some(s), None)
            } else {
                // Validated now, so a deferred start cannot be refused later.
                p.validate().map_err(ApiError::bad_request)?;
                (
                    None,
                    Some(Deferred {
                        leader_ready: rx.clone(),
                        params: p,
                        constraint,
                    }),
                )
            };
            choices.push(Choice {
                index: choices.len(),
                prompt: prompt.clone(),
                stream,
                deferred,
                ready: (share && i == 0).then(|| tx.clone()),
                start: Instant::now(),
                first: None,
                last: None,
                itls: Vec::new(),
                queue: 0.0,
            });
        }
    }
    Ok(choices)
}

impl Choice {
    /// Next output, with timing noted; the metrics are recorded when the request ends.
    pub async fn next(&mut self, state: &AppState) -> Option<Result<RequestOutput, ApiError>> {
        if let Some(mut d) = self.deferred.take() {
            // A leader that fails drops its sender, which releases the siblings too.
            let _ = d.leader_ready.wait_for(|r| *r).await;
            match state
                .engine
                .add_constrained(self.prompt.clone(), d.params, d.constraint)
            {
                Ok(s) => self.stream = Some(s),
                Err(e) => return Some(Err(e.into())),
            }
        }
        let item = self.stream.as_mut()?.next().await;
        if let Some(tx) = self.ready.take() {
            let _ = tx.send(true);
        }
        let item = item?;
        let now = Instant::now();
        Some(match item {
            Ok(o) => {
                if let Some(q) = o.queue_time {
                    self.queue = q;
                }
                match self.last {
                    Some(l) => self.itls.push((now - l).as_secs_f64()),
                    None => self.first = Some(now),
                }
                self.last = Some(now);
                if let Some(r) = o.finish_reason {
                    if state.log_requests {
                        tracing::info!(
                            "request {} finished ({}): {} prompt + {} generated tokens in {:.3} s",
                            self.stream.as_ref().map_or(0, |s| s.id),
                            finish_reason(r),
                            o.num_prompt_tokens,
                            o.num_output_tokens,
                            (now - self.start).as_secs_f64()
                        );
                    }
                    state.metrics.record(&RequestTimes {
                        queue: self.queue,
                        ttft: (self.first.unwrap_or(now) - self.start).as_secs_f64(),
                        itls: std::mem::take(&mut self.itls),
                        e2e: (now - self.start).as_secs_f64(),
                        finish_reason: finish_reason(r),
                        prompt_tokens: o.num_prompt_tokens,
                        generation_tokens: o.num_output_tokens,
                    });
                }
                Ok(o)
            }
            Err(e) => Err(e.into()),
        })
    }
}

/// vLLM's `prompt_logprobs` output: per prompt token (`null` for the first), the token and
/// its top alternatives, each `{"logprob", "rank", "decoded_token"}` under its id.
pub fn prompt_logprobs_json(state: &AppState, lps: &[Option<TokenLogprob>]) -> Value {
    let entry = |id: u32, logprob: f32, rank: usize| serde_json::json!({"logprob": logprob, "rank": rank, "decoded_token": state.tokenizer.token_text(id)});
    Value::Array(
        lps.iter()
            .map(|lp| {
                let Some(lp) = lp else { return Value::Null };
                let mut m = serde_json::Map::new();
                m.insert(
                    lp.token_id.to_string(),
                    entry(lp.token_id, lp.logprob, lp.rank),
                );
                for (i, &(id, l)) in lp.top.iter().enumerate() {
                    m.entry(id.to_string())
                        .or_insert_with(|| entry(id, l, i + 1));
                }
                Value::Object(m)
            })
            .collect(),
    )
}

/// vLLM refuses prompt logprobs on streams: they would come before any token.
pub fn check_prompt_logprobs(stream: bool, prompt_logprobs: Option<i64>) -> Result<(), ApiError> {
    if stream && prompt_logprobs.is_some() {
        return Err(
            ApiError::bad_request("`prompt_logprobs` is not available when streaming")
                .with_param("prompt_logprobs"),
        );
    }
    Ok(())
}

/// A choice read to its end.
#[derive(Default)]
pub struct Finished {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    pub finish_reason: &'static str,
    /// The stop string that ended the choice, if one did.
    pub stop_str: Option<String>,
    pub usage: Usage,
}

pub async fn collect(state: &AppState, mut c: Choice) -> Result<Finished, ApiError> {
    let mut f = Finished::default();
    while let Some(o) = c.next(state).await {
        let o = o?;
        f.usage = Usage::of(&o);
        f.text += &o.text;
        f.token_ids.extend(&o.token_ids);
        f.logprobs.extend(o.logprobs);
        if o.prompt_logprobs.is_some() {
            f.prompt_logprobs = o.prompt_logprobs;
        }
        if let Some(r) = o.finish_reason {
            f.finish_reason = finish_reason(r);
            f.stop_str = o.stop_str;
            return Ok(f);
        }
    }
    Err(ApiError::internal(
        "the engine ended the request without finishing it",
    ))
}
