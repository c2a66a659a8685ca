//! Embedding models: `POST /v1/embeddings` (OpenAI's), `/v1/score` (vLLM's) and
//! `/v1/rerank` (Jina's and Cohere's shape; also `/rerank`, `/v2/rerank`). Every text (or
//! pair) is a prefill-only request through the same scheduler. A score is the cosine of two
//! texts' embeddings, or a cross-encoder's sigmoid of its logit for the pair.

use crate::error::ApiError;
use crate::prompt_work::{check_text_len, off_runtime, MAX_CHOICES};
use crate::protocol::{now, Prompt};
use crate::state::{AppState, Embedder, SharedState};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::sync::atomic::Ordering;

/// A prompt's token ids, and their segments for a pair input.
type Input = (Vec<u32>, Option<Vec<u32>>);

#[derive(Debug, Deserialize)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    pub input: Prompt,
    pub encoding_format: Option<String>,
    pub dimensions: Option<i64>,
    pub user: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ScoreRequest {
    pub model: Option<String>,
    pub text_1: TextOrTexts,
    pub text_2: TextOrTexts,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum TextOrTexts {
    One(String),
    Many(Vec<String>),
}

impl TextOrTexts {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// A rerank document: a string (Jina, Cohere v2) or `{"text": ...}` (Cohere v1).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Document {
    Text(String),
    Object { text: String },
}

#[derive(Debug, Deserialize)]
pub struct RerankRequest {
    pub model: Option<String>,
    pub query: String,
    pub documents: Vec<Document>,
    pub top_n: Option<i64>,
    pub return_documents: Option<bool>,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: usize,
    total_tokens: usize,
}

#[derive(Serialize)]
struct EmbeddingData {
    object: &'static str,
    index: usize,
    /// Floats, or base64 of their little-endian f32 bytes.
    embedding: Value,
}

#[derive(Serialize)]
struct EmbeddingResponse {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    data: Vec<EmbeddingData>,
    usage: Usage,
}

#[derive(Serialize)]
struct ScoreData {
    index: usize,
    object: &'static str,
    score: f64,
}

#[derive(Serialize)]
struct ScoreResponse {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    data: Vec<ScoreData>,
    usage: Usage,
}

#[derive(Serialize)]
struct RerankResult {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    document: Option<Value>,
    relevance_score: f64,
}

#[derive(Serialize)]
struct RerankUsage {
    total_tokens: usize,
}

#[derive(Serialize)]
struct RerankResponse {
    id: String,
    model: String,
    usage: RerankUsage,
    results: Vec<RerankResult>,
}

fn request_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

/// The model serves embeddings, is the one named, and the server is not draining.
fn check_embedder<'a>(
    state: &'a AppState,
    model: &Option<String>,
) -> Result<&'a Embedder, ApiError> {
    if state.draining.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    if let Some(m) = model.as_ref().filter(|m| **m != state.model_name) {
        return Err(
            ApiError::not_found(format!("The model `{m}` does not exist.")).with_param("model"),
        );
    }
    state.embedder.as_ref().ok_or_else(|| {
        ApiError::bad_request(format!(
            "the model `{}` generates text and does not serve embeddings; start an embedding \
             model (or this one with --runner pooling)",
            state.model_name
        ))
    })
}

/// Token ids of each input, tokenized off the async runtime.
async fn tokenize(state: &SharedState, inputs: Prompt) -> Result<Vec<Vec<u32>>, ApiError> {
    let prompts = off_runtime(state, move |s| {
        let encode = |t: &str| -> Result<Vec<u32>, ApiError> {
            check_text_len(s, t)?;
            Ok(s.tokenizer.encode(t, true)?)
        };
        Ok(match inputs {
            Prompt::Text(t) => vec![encode(&t)?],
            Prompt::Texts(ts) => ts.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
            Prompt::Tokens(ids) => vec![ids],
            Prompt::TokenLists(l) => l,
        })
    })
    .await?;
    if prompts.is_empty() {
        return Err(ApiError::bad_request("`input` must not be empty").with_param("input"));
    }
    if prompts.len() > MAX_CHOICES {
        return Err(ApiError::bad_request(format!(
            "{} inputs in one request; at most {MAX_CHOICES}",
            prompts.len()
        ))
        .with_param("input"));
    }
    Ok(prompts)
}

/// Each input's pooled vector, all queued at once (one scheduler, batched by its steps).
async fn embed(state: &AppState, prompts: Vec<Input>) -> Result<Vec<Vec<f32>>, ApiError> {
    let waiting = state.engine.stats().num_waiting;
    if waiting + prompts.len() > state.max_queued_requests {
        return Err(ApiError::unavailable(format!(
            "{waiting} requests are waiting and this call adds {}: past --max-queued-requests {}; retry later",
            prompts.len(),
            state.max_queued_requests
        )));
    }
    // Started before any is awaited; dropping the rest on an error aborts them.
    let mut streams = prompts
        .into_iter()
        .map(|(ids, types)| state.engine.add_pooling(ids, types))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = Vec::with_capacity(streams.len());
    for s in &mut streams {
        match s.next().await {
            Some(Ok(o)) => out.push(o.embedding.ok_or_else(|| {
                ApiError::internal("the engine finished an embedding request without a vector")
            })?),
            Some(Err(e)) => return Err(e.into()),
            None => {
                return Err(ApiError::internal(
                    "the engine dropped an embedding request",
                ))
            }
        }
    }
    Ok(out)
}

/// `v` cut to its first `dims` values (Matryoshka models), unit length again if vectors are.
fn truncated(mut v: Vec<f32>, dims: Option<usize>, normalize: bool) -> Vec<f32> {
    if let Some(d) = dims.filter(|&d| d < v.len()) {
        v.truncate(d);
        if normalize {
            let n = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            if n > 0.0 {
                v.iter_mut().for_each(|x| *x = (*x as f64 / n) as f32);
            }
        }
    }
    v
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    match na * nb {
        0.0 => 0.0,
        n => dot / n,
    }
}

pub async fn embeddings(state: SharedState, req: EmbeddingRequest) -> Result<Response, ApiError> {
    let embedder = check_embedder(&state, &req.model)?.clone();
    if embedder.cross_encoder {
        return Err(ApiError::bad_request(format!(
            "the model `{}` is a cross-encoder: it scores pairs of texts (/v1/score, \
             /v1/rerank) and makes no embeddings",
            state.model_name
        )));
    }
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(f) => {
            return Err(ApiError::bad_request(format!(
                "`encoding_format` must be `float` or `base64`, not `{f}`"
            ))
            .with_param("encoding_format"))
        }
    };
    let dims = match req.dimensions {
        None => None,
        Some(d) if d >= 1 => Some(d as usize),
        Some(d) => {
            return Err(
                ApiError::bad_request(format!("`dimensions` must be at least 1, got {d}"))
                    .with_param("dimensions"),
            )
        }
    };
    let _ = req.user;
    let prompts = tokenize(&state, req.input).await?;
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    let vectors = embed(&state, prompts.into_iter().map(|p| (p, None)).collect()).await?;
    if let Some(d) = dims.filter(|&d| vectors.first().is_some_and(|v| d > v.len())) {
        return Err(ApiError::bad_request(format!(
            "`dimensions` {d} is more than the model's {}",
            vectors[0].len()
        ))
        .with_param("dimensions"));
    }
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            let v = truncated(v, dims, embedder.normalize);
            let embedding = match base64 {
                true => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    Value::from(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
                false => Value::from(v),
            };
            EmbeddingData {
                object: "embedding",
                index,
                embedding,
            }
        })
        .collect();
    Ok(Json(EmbeddingResponse {
        id: request_id("embd"),
        object: "list",
        created: now(),
        model: state.model_name.clone(),
        data,
        usage: Usage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
    })
    .into_response())
}

/// Pairs of `text_1` and `text_2` as vLLM forms them: one against each, or item by item.
fn pairs(a: usize, b: usize) -> Result<Vec<(usize, usize)>, ApiError> {
    match (a, b) {
        (0, _) | (_, 0) => Err(ApiError::bad_request(
            "`text_1` and `text_2` must not be empty",
        )),
        (1, n) => Ok((0..n).map(|j| (0, j)).collect()),
        (m, n) if m == n => Ok((0..n).map(|j| (j, j)).collect()),
        (m, n) => Err(ApiError::bad_request(format!(
            "`text_1` has {m} texts and `text_2` {n}: give one `text_1`, or as many as `text_2`"
        ))
        .with_param("text_1")),
    }
}

/// Relevance of each `(first[i], second[j])` pair, and the tokens computed: a cross-encoder's
/// sigmoid of the pair's logit, or the cosine of the two texts' embeddings (each text
/// embedded once).
async fn scores(
    state: &SharedState,
    first: Vec<String>,
    second: Vec<String>,
    pairs: &[(usize, usize)],
) -> Result<(Vec<f64>, usize), ApiError> {
    let cross = state.embedder.as_ref().is_some_and(|e| e.cross_encoder);
    if cross {
        let texts: Vec<(String, String)> = pairs
            .iter()
            .map(|&(i, j)| (first[i].clone(), second[j].clone()))
            .collect();
        let inputs = off_runtime(state, move |s| {
            texts
                .iter()
                .map(|(a, b)| {
                    check_text_len(s, &format!("{a}{b}"))?;
                    let (ids, types) = s.tokenizer.encode_pair(a, b)?;
                    Ok((ids, Some(types)))
                })
                .collect::<Result<Vec<Input>, ApiError>>()
        })
        .await?;
        let tokens = inputs.iter().map(|i| i.0.len()).sum();
        let logits = embed(state, inputs).await?;
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x as f64).exp());
        return Ok((logits.iter().map(|l| sigmoid(l[0])).collect(), tokens));
    }
    let n = first.len();
    let texts: Vec<String> = first.into_iter().chain(second).collect();
    let prompts = tokenize(state, Prompt::Texts(texts)).await?;
    let tokens = prompts.iter().map(Vec::len).sum();
    let vectors = embed(state, prompts.into_iter().map(|p| (p, None)).collect()).await?;
    let (va, vb) = vectors.split_at(n);
    Ok((
        pairs.iter().map(|&(i, j)| cosine(&va[i], &vb[j])).collect(),
        tokens,
    ))
}

pub async fn score(state: SharedState, req: ScoreRequest) -> Result<Response, ApiError> {
    check_embedder(&state, &req.model)?;
    let (a, b) = (req.text_1.into_vec(), req.text_2.into_vec());
    let pairs = pairs(a.len(), b.len())?;
    let (scores, tokens) = scores(&state, a, b, &pairs).await?;
    let data = scores
        .into_iter()
        .enumerate()
        .map(|(index, score)| ScoreData {
            index,
            object: "score",
            score,
        })
        .collect();
    Ok(Json(ScoreResponse {
        id: request_id("score"),
        object: "list",
        created: now(),
        model: state.model_name.clone(),
        data,
        usage: Usage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
    })
    .into_response())
}

pub async fn rerank(state: SharedState, req: RerankRequest) -> Result<Response, ApiError> {
    check_embedder(&state, &req.model)?;
    if req.documents.is_empty() {
        return Err(ApiError::bad_request("`documents` must not be empty").with_param("documents"));
    }
    let top_n = match req.top_n {
        None => req.documents.len(),
        Some(n) if n >= 1 => (n as usize).min(req.documents.len()),
        Some(n) => {
            return Err(
                ApiError::bad_request(format!("`top_n` must be at least 1, got {n}"))
                    .with_param("top_n"),
            )
        }
    };
    let docs: Vec<String> = req
        .documents
        .into_iter()
        .map(|d| match d {
            Document::Text(t) | Document::Object { text: t } => t,
        })
        .collect();
    let pairs: Vec<(usize, usize)> = (0..docs.len()).map(|j| (0, j)).collect();
    let (scores, tokens) = scores(&state, vec![req.query], docs.clone(), &pairs).await?;
    let mut results: Vec<RerankResult> = scores
        .into_iter()
        .enumerate()
        .map(|(index, relevance_score)| RerankResult {
            index,
            document: (req.return_documents != Some(false))
                .then(|| serde_json::json!({"text": docs[index]})),
            relevance_score,
        })
        .collect();
    results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
    results.truncate(top_n);
    Ok(Json(RerankResponse {
        id: request_id("rerank"),
        model: state.model_name.clone(),
        usage: RerankUsage {
            total_tokens: tokens,
        },
        results,
    })
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_pairs_are_one_to_each_or_item_by_item() {
        assert_eq!(pairs(1, 3).unwrap(), vec![(0, 0), (0, 1), (0, 2)]);
        assert_eq!(pairs(2, 2).unwrap(), vec![(0, 0), (1, 1)]);
        assert!(pairs(2, 3).is_err() && pairs(0, 1).is_err());
    }

    #[test]
    fn cut_vectors_are_unit_length_again() {
        let v = truncated(vec![0.6, 0.0, 0.8], Some(2), true);
        assert_eq!(v, vec![1.0, 0.0]);
        assert_eq!(truncated(vec![0.6, 0.8], Some(2), true), vec![0.6, 0.8]);
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - 0.5f64.sqrt()).abs() < 1e-12);
    }
}
