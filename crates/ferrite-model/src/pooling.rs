//! Embedding models: how a prompt's hidden states become one vector. Read, as
//! sentence-transformers and vLLM read it, from the description beside the checkpoint
//! (`modules.json`, `1_Pooling/config.json`, a `Normalize` module, `sentence_bert_config.json`).

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolingType {
    /// The first token's state (BERT's `[CLS]`).
    Cls,
    /// The mean over the prompt's tokens.
    Mean,
    /// The last token's state (decoder embedding models: Qwen3-Embedding).
    Last,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Pooling {
    pub kind: PoolingType,
    /// The pooled vector scaled to unit length.
    pub normalize: bool,
    /// The longest input the model was trained on (`sentence_bert_config.json`).
    pub max_seq_length: Option<usize>,
    /// A cross-encoder: its input is a pair of texts and its output one relevance logit.
    pub pairs: bool,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(
            serde_json::from_str(&s).with_context(|| format!("parsing {}", path.display()))?,
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

impl Pooling {
    /// Without a sentence-transformers description (vLLM's defaults): CLS for encoders, the
    /// last token for decoders, normalized.
    pub fn default_for(encoder: bool) -> Self {
        Self {
            kind: match encoder {
                true => PoolingType::Cls,
                false => PoolingType::Last,
            },
            normalize: true,
            max_seq_length: None,
            pairs: false,
        }
    }

    /// A cross-encoder's: the `[CLS]` row's classifier logit, as it is.
    pub fn cross_encoder() -> Self {
        Self {
            kind: PoolingType::Cls,
            normalize: false,
            max_seq_length: None,
            pairs: true,
        }
    }

    /// The sentence-transformers description in `dir`, if it has one (`modules.json`).
    pub fn read(dir: &Path) -> Result<Option<Self>> {
        let Some(modules) = read_json(&dir.join("modules.json"))? else {
            return Ok(None);
        };
        let modules = modules.as_array().cloned().unwrap_or_default();
        let of_type = |t: &str| {
            modules
                .iter()
                .find(|m| m["type"].as_str().is_some_and(|s| s.ends_with(t)))
        };
        let Some(pool) = of_type(".Pooling") else {
            return Ok(None);
        };
        let path = dir.join(pool["path"].as_str().unwrap_or("1_Pooling"));
        let cfg = read_json(&path.join("config.json"))?.unwrap_or_default();
        let on = |k: &str| cfg[k].as_bool() == Some(true);
        let kind = match () {
            _ if on("pooling_mode_cls_token") => PoolingType::Cls,
            _ if on("pooling_mode_lasttoken") => PoolingType::Last,
            _ if on("pooling_mode_mean_tokens") => PoolingType::Mean,
            _ => bail!(
                "{}: a pooling mode ferrite does not run (it runs cls_token, mean_tokens, \
                 lasttoken)",
                path.join("config.json").display()
            ),
        };
        let st = read_json(&dir.join("sentence_bert_config.json"))?.unwrap_or_default();
        Ok(Some(Self {
            kind,
            normalize: of_type(".Normalize").is_some(),
            max_seq_length: st["max_seq_length"].as_u64().map(|n| n as usize),
            pairs: false,
        }))
    }

    /// Offsets of the rows of an `n`-token prompt whose states are pooled.
    pub fn rows(&self, n: usize) -> std::ops::Range<usize> {
        match self.kind {
            PoolingType::Cls => 0..1,
            PoolingType::Mean => 0..n,
            PoolingType::Last => n - 1..n,
        }
    }

    /// `states` (the [`Pooling::rows`] of one prompt, `width` each) as one vector.
    pub fn pool(&self, states: &[f32], width: usize) -> Vec<f32> {
        let n = states.len() / width;
        let mut v = vec![0f32; width];
        for row in states.chunks(width) {
            v.iter_mut().zip(row).for_each(|(a, x)| *a += x);
        }
        v.iter_mut().for_each(|a| *a /= n as f32);
        if self.normalize {
            normalize(&mut v);
        }
        v
    }
}

/// `v` scaled to unit length (left as it is when zero).
pub fn normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|x| (*x as f64) * (*x as f64))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x = (*x as f64 / norm) as f32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_cls_and_last_pick_their_rows() {
        let states = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // three rows of two
        let mean = Pooling {
            normalize: false,
            ..Pooling::default_for(true)
        };
        let mean = Pooling {
            kind: PoolingType::Mean,
            ..mean
        };
        assert_eq!(mean.rows(3), 0..3);
        assert_eq!(mean.pool(&states, 2), vec![3.0, 4.0]);
        assert_eq!(Pooling::default_for(true).rows(3), 0..1);
        assert_eq!(Pooling::default_for(false).rows(3), 2..3);
        let unit = Pooling::default_for(false).pool(&[3.0, 4.0], 2);
        assert!((unit[0] - 0.6).abs() < 1e-7 && (unit[1] - 0.8).abs() < 1e-7);
    }
}
