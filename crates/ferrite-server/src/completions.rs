//! `POST /v1/completions`: prompts as text or token ids, echo, legacy logprobs.

use crate::error::ApiError;
use crate::generation::{
    check_model, check_n, check_prompt_logprobs, collect, model_sampling_params,
    prompt_logprobs_json, start_choices, Choice, Finished,
};
use crate::prompt_work::{check_choices, check_text_len, off_runtime};
use crate::protocol::*;
use crate::sse::{sse_response, ChunkSink, WrapChunk};
use crate::state::{AppState, SharedState};
use crate::structured;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferrite_core::output::TokenLogprob;
use serde_json::Value;
use std::sync::Arc;

fn prompts(state: &AppState, p: Prompt) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |t: &str| -> Result<Vec<u32>, ApiError> {
        check_text_len(state, t)?;
        Ok(state.tokenizer.encode(t, true)?)
    };
    let out = match p {
        Prompt::Text(t) => vec![encode(&t)?],
        Prompt::Texts(ts) => ts.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
        Prompt::Tokens(ids) => vec![ids],
        Prompt::TokenLists(l) => l,
    };
    if out.is_empty() {
        return Err(ApiError::bad_request("`prompt` must not be empty").with_param("prompt"));
    }
    Ok(out)
}

/// Builds the legacy logprobs object; `offset` is the character offset of the first token.
fn legacy_logprobs(
    state: &AppState,
    lps: &[Option<TokenLogprob>],
    ids: &[u32],
    mut offset: usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for (i, &id) in ids.iter().enumerate() {
        let token = state.tokenizer.token_text(id);
        out.text_offset.push(offset);
        offset += token.chars().count();
        let lp = lps.get(i).and_then(|l| l.as_ref());
        out.token_logprobs.push(lp.map(|l| l.logprob));
        out.top_logprobs.push(lp.map(|l| {
            let mut m = serde_json::Map::new();
            for &(t, v) in &l.top {
                m.insert(state.tokenizer.token_text(t), Value::from(v));
            }
            m
        }));
        out.tokens.push(token);
    }
    out
}

pub async fn completions(state: SharedState, req: CompletionRequest) -> Result<Response, ApiError> {
    check_model(&state, &req.common.model)?;
    let n = check_request(&req)?;
    // OpenAI's legacy default is 16 tokens.
    let max_tokens = Some(req.common.max_tokens.unwrap_or(16));
    let prompt_lp = req
        .prompt_logprobs
        .or(if req.echo { req.logprobs } else { None });
    let params = model_sampling_params(&state, &req.common, max_tokens, req.logprobs, prompt_lp)?;
    let grammar = structured::compile(&state, structured::spec(&req.common)?).await?;
    let count = match &req.prompt {
        Prompt::Texts(t) => t.len(),
        Prompt::TokenLists(l) => l.len(),
        _ => 1,
    };
    check_choices(count, n)?;
    let prompt = req.prompt.clone();
    let prompts = off_runtime(&state, move |s| prompts(s, prompt)).await?;
    let choices = start_choices(&state, prompts, &params, n, grammar.as_ref())?;
    let id = random_id("cmpl");
    let model = state.model_name.clone();
    if req.common.stream {
        let include_usage = req.common.include_usage();
        let wrap: WrapChunk = Arc::new(move |choices, usage| {
            serde_json::to_value(Completion {
                id: id.clone(),
                object: "text_completion",
                created: now(),
                model: model.clone(),
                choices,
                usage,
            })
            .unwrap()
        });
        let (echo, want_lp) = (req.echo, req.logprobs.is_some());
        return Ok(sse_response(
            state,
            choices,
            include_usage,
            move |s, c, sink| stream_choice(s, c, sink, echo, want_lp),
            wrap,
        ));
    }
    let finished = futures_util::future::join_all(choices.into_iter().map(|c| {
        let prompt = c.prompt.clone();
        let state = &state;
        async move { collect(state, c).await.map(|f| (prompt, f)) }
    }))
    .await;
    let mut usage = Usage::default();
    let mut out = Vec::new();
    for (index, r) in finished.into_iter().enumerate() {
        let (prompt, f) = r?;
        usage = match index {
            0 => f.usage.clone(),
            // Each prompt counted once, by its first choice.
            i if i % n == 0 => usage.and(&f.usage).with_prompt(&f.usage),
            _ => usage.and(&f.usage),
        };
        out.push(whole_choice(&state, &req, index, &prompt, f)?);
    }
    let usage = serde_json::to_value(usage).unwrap();
    Ok(Json(Completion {
        id: random_id("cmpl"),
        object: "text_completion",
        created: now(),
        model: state.model_name.clone(),
        choices: out,
        usage: Some(usage),
    })
    .into_response())
}

/// Refuses what `/v1/completions` does not serve; the number of choices per prompt.
fn check_request(req: &CompletionRequest) -> Result<usize, ApiError> {
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_request("`suffix` is not supported").with_param("suffix"));
    }
    let n = check_n(req.common.n)?;
    if let Some(b) = req.best_of {
        if b as usize != n {
            return Err(
                ApiError::bad_request("`best_of` other than `n` is not supported")
                    .with_param("best_of"),
            );
        }
    }
    check_prompt_logprobs(req.common.stream, req.prompt_logprobs)?;
    if req.echo && req.common.stream && req.logprobs.is_some() {
        return Err(ApiError::bad_request(
            "`echo` with `logprobs` is not supported when streaming",
        )
        .with_param("echo"));
    }
    Ok(n)
}

/// One choice of a whole (not streamed) reply: echo, legacy logprobs, prompt logprobs.
fn whole_choice(
    state: &AppState,
    req: &CompletionRequest,
    index: usize,
    prompt: &[u32],
    f: Finished,
) -> Result<CompletionChoice, ApiError> {
    let prompt_text = if req.echo {
        state.tokenizer.decode(prompt, false)?
    } else {
        String::new()
    };
    let logprobs = req.logprobs.map(|_| {
        let gen: Vec<Option<TokenLogprob>> = f.logprobs.iter().cloned().map(Some).collect();
        let gen_lp = legacy_logprobs(state, &gen, &f.token_ids, prompt_text.chars().count());
        if !req.echo {
            return gen_lp;
        }
        let mut all = legacy_logprobs(
            state,
            &f.prompt_logprobs.clone().unwrap_or_default(),
            prompt,
            0,
        );
        all.text_offset.extend(gen_lp.text_offset);
        all.token_logprobs.extend(gen_lp.token_logprobs);
        all.tokens.extend(gen_lp.tokens);
        all.top_logprobs.extend(gen_lp.top_logprobs);
        all
    });
    Ok(CompletionChoice {
        index,
        text: prompt_text + &f.text,
        logprobs,
        finish_reason: Some(f.finish_reason),
        prompt_logprobs: req
            .prompt_logprobs
            .map(|_| prompt_logprobs_json(state, f.prompt_logprobs.as_deref().unwrap_or(&[]))),
    })
}

async fn stream_choice(
    state: SharedState,
    mut choice: Choice,
    sink: ChunkSink,
    echo: bool,
    want_logprobs: bool,
) -> Result<Usage, ApiError> {
    let index = choice.index;
    let mut offset = 0;
    if echo {
        let text = state.tokenizer.decode(&choice.prompt, false)?;
        offset = text.chars().count();
        sink.send_choice(CompletionChoice {
            index,
            text,
            logprobs: None,
            finish_reason: None,
            prompt_logprobs: None,
        })
        .await?;
    }
    while let Some(o) = choice.next(&state).await {
        let o = o?;
        let logprobs = want_logprobs.then(|| {
            let lps: Vec<Option<TokenLogprob>> = o.logprobs.iter().cloned().map(Some).collect();
            legacy_logprobs(&state, &lps, &o.token_ids, offset)
        });
        offset += o.text.chars().count();
        let finish = o.finish_reason.map(crate::generation::finish_reason);
        let usage = Usage::of(&o);
        if !o.text.is_empty() || finish.is_some() || logprobs.is_some() {
            sink.send_choice(CompletionChoice {
                index,
                text: o.text,
                logprobs,
                finish_reason: finish,
                prompt_logprobs: None,
            })
            .await?;
        }
        if finish.is_some() {
            return Ok(usage);
        }
    }
    Err(ApiError::internal(
        "the engine ended the request without finishing it",
    ))
}
