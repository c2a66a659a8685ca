//! The tokenizer, built from GGUF metadata (`tokenizer.ggml.*`) or a `tokenizer.json` beside
//! the weights, with the special-token ids and chat template the engine needs.

use crate::Metadata;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;
use tokenizers::Tokenizer;

pub struct ModelTokenizer {
    pub tokenizer: Tokenizer,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Prepend BOS when encoding a raw prompt (GGUF `tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

impl ModelTokenizer {
    /// From the GGUF metadata, unless a `tokenizer.json` sits beside the weights.
    pub fn load(gguf: &impl Metadata) -> Result<Self> {
        let beside = gguf.path().with_file_name("tokenizer.json");
        let (tokenizer, from_json) = if beside.exists() {
            (load_json(&beside)?, true)
        } else {
            (from_gguf(gguf)?, false)
        };
        let bos = gguf
            .opt_u64("tokenizer.ggml.bos_token_id")
            .map(|v| v as u32);
        let mut eos: Vec<u32> = gguf
            .opt_u64("tokenizer.ggml.eos_token_id")
            .map(|v| v as u32)
            .into_iter()
            .collect();
        // Chat models often end turns with a token other than the declared EOS; GGUF files
        // name it in `eot_token_id`, or (as llama.cpp also reads them) by its text.
        if let Some(eot) = gguf.opt_u64("tokenizer.ggml.eot_token_id") {
            eos.push(eot as u32);
        }
        eos.extend(end_of_turn_tokens(gguf));
        eos.sort_unstable();
        eos.dedup();
        let model = gguf.opt_string("tokenizer.ggml.model").unwrap_or_default();
        let add_bos = !from_json
            && gguf
                .opt_bool("tokenizer.ggml.add_bos_token")
                .unwrap_or(model == "llama");
        Ok(Self {
            tokenizer,
            bos_token_id: bos,
            eos_token_ids: eos,
            add_bos,
            chat_template: gguf.opt_string("tokenizer.chat_template").or_else(|| {
                let arch = gguf.opt_string("general.architecture")?;
                crate::chat_template::builtin(&arch).map(str::to_string)
            }),
        })
    }

    /// For a Hugging Face model folder: `tokenizer.json` beside `config.json` (else, for
    /// `--load-format dummy`, a placeholder vocabulary in which token `i` is the word `<i>`),
    /// BOS/EOS ids from `config.json` and `generation_config.json`, and the chat template from
    /// `tokenizer_config.json`.
    pub fn for_config(config_path: &Path, vocab_size: usize) -> Result<Self> {
        let beside = |name: &str| config_path.with_file_name(name);
        let json = |name: &str| -> Option<Value> {
            let text = std::fs::read_to_string(beside(name)).ok()?;
            serde_json::from_str(&text).ok()
        };
        let tokenizer = if beside("tokenizer.json").exists() {
            load_json(&beside("tokenizer.json"))?
        } else {
            let vocab = (0..vocab_size as u32)
                .map(|i| (format!("<{i}>"), i))
                .collect();
            let model = tokenizers::models::wordlevel::WordLevel::builder()
                .vocab(vocab)
                .unk_token("<0>".into())
                .build()
                .map_err(|e| anyhow!("placeholder vocabulary: {e}"))?;
            let mut t = Tokenizer::new(model);
            t.with_pre_tokenizer(Some(
                tokenizers::pre_tokenizers::whitespace::WhitespaceSplit,
            ));
            t
        };
        // An id or a list of ids.
        let ids = |v: Option<&Value>| -> Vec<u32> {
            match v {
                Some(Value::Number(n)) => n.as_u64().map(|n| n as u32).into_iter().collect(),
                Some(Value::Array(a)) => a
                    .iter()
                    .filter_map(|n| n.as_u64())
                    .map(|n| n as u32)
                    .collect(),
                _ => Vec::new(),
            }
        };
        let config = json("config.json");
        let generation = json("generation_config.json");
        let mut eos = ids(config.as_ref().and_then(|c| c.get("eos_token_id")));
        eos.extend(ids(generation.as_ref().and_then(|c| c.get("eos_token_id"))));
        eos.sort_unstable();
        eos.dedup();
        let chat_template =
            json("tokenizer_config.json").and_then(|t| match t.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: the default one.
                Some(Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
                _ => None,
            });
        Ok(Self {
            tokenizer,
            bos_token_id: ids(config.as_ref().and_then(|c| c.get("bos_token_id")))
                .first()
                .copied(),
            eos_token_ids: eos,
            // tokenizer.json's post-processor adds BOS itself where the model wants one.
            add_bos: false,
            chat_template,
        })
    }

    /// Encodes a raw prompt. `add_special_tokens` adds BOS where the model expects one;
    /// text produced by a chat template already carries its own.
    /// Two texts as one input of a pair model (a cross-encoder: `[CLS] a [SEP] b [SEP]`),
    /// with each token's segment (0 for the first text, 1 for the second).
    pub fn encode_pair(&self, a: &str, b: &str) -> Result<(Vec<u32>, Vec<u32>)> {
        let enc = self
            .tokenizer
            .encode((a, b), true)
            .map_err(|e| anyhow!("tokenization failed: {e}"))?;
        Ok((enc.get_ids().to_vec(), enc.get_type_ids().to_vec()))
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| anyhow!("tokenization failed: {e}"))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_special_tokens && self.add_bos {
            if let Some(b) = self.bos_token_id {
                ids.push(b);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| anyhow!("detokenization failed: {e}"))
    }

    pub fn token_text(&self, id: u32) -> String {
        self.decode(&[id], false).unwrap_or_default()
    }
}

/// Control tokens that end a chat turn, by their text.
const END_OF_TURN: &[&str] = &["<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>"];

fn end_of_turn_tokens(gguf: &impl Metadata) -> Vec<u32> {
    let (Ok(tokens), Some(types)) = (
        gguf.string_array("tokenizer.ggml.tokens"),
        gguf.u64_array("tokenizer.ggml.token_type"),
    ) else {
        return Vec::new();
    };
    tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (t, ty))| *ty == 3 && END_OF_TURN.contains(&t.as_str()))
        .map(|(i, _)| i as u32)
        .collect()
}

/// A `tokenizer.json` as the engine encodes: one prompt at a time, never padded or cut
/// (sentence-transformers checkpoints save both settings in it; a prompt too long for the
/// context is refused instead).
fn load_json(path: &Path) -> Result<Tokenizer> {
    let mut t =
        Tokenizer::from_file(path).map_err(|e| anyhow!("cannot load {}: {e}", path.display()))?;
    t.with_padding(None);
    t.with_truncation(None)
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    Ok(t)
}

/// Splits of the GPT-2 family, by `tokenizer.ggml.pre` (the names llama.cpp's converter writes).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_byte_level(pattern: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        byte_level(false),
    ]})
}

fn gpt2_pre_tokenizer(pre: &str) -> Result<Value> {
    Ok(match pre {
        "gpt2" | "default" | "gpt-2" | "" => byte_level(true),
        // SmolLM's real tokenizer splits every digit before the GPT-2 regex.
        "smollm" | "starcoder" | "refact" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true),
        ]}),
        "llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" | "dbrx" => {
            split_then_byte_level(LLAMA3_SPLIT)
        }
        "qwen2" | "deepseek-r1-qwen" => split_then_byte_level(QWEN2_SPLIT),
        other => bail!(
            "unsupported pre-tokenizer `tokenizer.ggml.pre = {other}`; put the model's \
             tokenizer.json beside the GGUF file"
        ),
    })
}

/// SentencePiece vocabularies carry scores but no merges: a pair merges when the joined
/// piece is in the vocabulary, higher-scored pieces first.
fn merges_from_scores(tokens: &[String], scores: &[f32]) -> Vec<(String, String)> {
    let index: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut merges: Vec<(f32, usize, usize, String, String)> = Vec::new();
    for (i, piece) in tokens.iter().enumerate() {
        for (split, _) in piece.char_indices().skip(1) {
            let (a, b) = piece.split_at(split);
            if let (Some(&ia), Some(&ib)) = (index.get(a), index.get(b)) {
                merges.push((scores[i], ia, ib, a.to_string(), b.to_string()));
            }
        }
    }
    merges.sort_by(|x, y| {
        y.0.partial_cmp(&x.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then((x.1, x.2).cmp(&(y.1, y.2)))
    });
    merges.into_iter().map(|m| (m.3, m.4)).collect()
}

fn from_gguf(gguf: &impl Metadata) -> Result<Tokenizer> {
    let model = gguf.string("tokenizer.ggml.model")?;
    let tokens = gguf.string_array("tokenizer.ggml.tokens")?;
    let types = gguf.u64_array("tokenizer.ggml.token_type");
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    // Control (3) and user-defined (4) tokens match as whole units, never split by BPE.
    let added: Vec<Value> = types
        .iter()
        .flatten()
        .enumerate()
        .filter(|(_, &t)| t == 3 || t == 4)
        .map(|(i, &t)| {
            json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": t == 3})
        })
        .collect();
    let spec = match model.as_str() {
        "gpt2" => {
            let pre = gguf.opt_string("tokenizer.ggml.pre").unwrap_or_default();
            let merges: Vec<Value> = gguf
                .string_array("tokenizer.ggml.merges")?
                .iter()
                .map(|m| {
                    m.split_once(' ')
                        .map(|(a, b)| json!([a, b]))
                        .ok_or_else(|| anyhow!("invalid merge `{m}`"))
                })
                .collect::<Result<_>>()?;
            json!({
                "version": "1.0", "truncation": null, "padding": null,
                "added_tokens": added, "normalizer": null,
                "pre_tokenizer": gpt2_pre_tokenizer(&pre)?,
                "post_processor": null,
                "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
                "model": {"type": "BPE", "dropout": null, "unk_token": null,
                          "continuing_subword_prefix": null, "end_of_word_suffix": null,
                          "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                          "vocab": vocab, "merges": merges},
            })
        }
        "llama" => {
            let scores = gguf
                .f32_array("tokenizer.ggml.scores")
                .ok_or_else(|| anyhow!("SentencePiece GGUF without `tokenizer.ggml.scores`"))?;
            let merges: Vec<Value> = merges_from_scores(&tokens, &scores)
                .into_iter()
                .map(|(a, b)| json!([a, b]))
                .collect();
            let unk = gguf
                .opt_u64("tokenizer.ggml.unknown_token_id")
                .map(|i| tokens[i as usize].clone());
            let mut normalizers = Vec::new();
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            // A prepended "▁" is taken off again when decoding.
            if gguf
                .opt_bool("tokenizer.ggml.add_space_prefix")
                .unwrap_or(true)
            {
                normalizers.push(json!({"type": "Prepend", "prepend": "▁"}));
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            normalizers
                .push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
            json!({
                "version": "1.0", "truncation": null, "padding": null,
                "added_tokens": added,
                "normalizer": {"type": "Sequence", "normalizers": normalizers},
                "pre_tokenizer": null, "post_processor": null,
                "decoder": {"type": "Sequence", "decoders": decoders},
                "model": {"type": "BPE", "dropout": null, "unk_token": unk,
                          "continuing_subword_prefix": null, "end_of_word_suffix": null,
                          "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                          "vocab": vocab, "merges": merges},
            })
        }
        other => bail!(
            "unsupported tokenizer model `tokenizer.ggml.model = {other}` (supported: gpt2, llama)"
        ),
    };
    let text = serde_json::to_string(&spec)?;
    text.parse::<Tokenizer>()
        .map_err(|e| anyhow!("cannot build the tokenizer from GGUF metadata: {e}"))
        .context("tokenizer")
}
