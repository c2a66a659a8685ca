//! Structured output: what a request may say (a JSON schema, any JSON object, a regex, one of
//! some strings, a Lark grammar) compiled by llguidance against the model's vocabulary into a
//! per-request matcher that yields each step's token mask. llguidance (Rust, the engine vLLM,
//! SGLang and llama.cpp use) computes a mask in tens of microseconds from the grammar's lexer
//! and an Earley parser, with no precompiled per-schema automaton: a schema's first use costs
//! its compile, not a vocabulary-sized table.

mod vocab;

use anyhow::{anyhow, Result};
use ferrite_core::constraint::{Constraint, TokenConstraint};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::TokEnv;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What the output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Spec {
    /// A JSON Schema (OpenAI `json_schema`, vLLM `json`).
    JsonSchema(Value),
    /// Any JSON object (OpenAI `json_object`).
    JsonObject,
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect, as vLLM passes `grammar` to it).
    Lark(String),
}

impl Spec {
    fn grammar(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Spec::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            Spec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(json!({"type": "object"})))
            }
            Spec::Regex(r) => TopLevelGrammar::from_regex(r),
            Spec::Choice(c) => {
                if c.is_empty() {
                    anyhow::bail!("a choice needs at least one string");
                }
                // Lark string literals take JSON's escapes.
                let alts: Vec<String> = c
                    .iter()
                    .map(|s| Value::from(s.as_str()).to_string())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
            Spec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        })
    }
}

/// JSON without free whitespace between tokens (`{"a": 1, "b": [2, 3]}`): a small model let
/// loose on flexible whitespace can spend its whole budget on newlines. A schema's own
/// `x-guidance` options win.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert(json!({
            "whitespace_flexible": false,
            "item_separator": ", ",
            "key_separator": ": ",
        }));
    }
    schema
}

/// Compiles specs against one vocabulary, keeping the most recent compiled ones.
pub struct Grammars {
    factory: ParserFactory,
    eos: Vec<u32>,
    cache: Mutex<HashMap<String, Matcher>>,
}

/// Compiled specs kept for reuse.
const CACHE: usize = 64;

impl Grammars {
    /// For `tokenizer` inside a model vocabulary of `vocab_size` rows (the embedding may hold
    /// more rows than the tokenizer has tokens); `eos`: the ids that end a sequence.
    pub fn new(tokenizer: &tokenizers::Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<Self> {
        let first = *eos
            .first()
            .ok_or_else(|| anyhow!("the tokenizer declares no end-of-sequence token"))?;
        let env: TokEnv = vocab::env(tokenizer, vocab_size, first)?;
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Self {
            factory,
            eos: eos.to_vec(),
            cache: Mutex::default(),
        })
    }

    /// A fresh matcher of `spec` for one request; an error names what does not compile.
    pub fn compile(&self, spec: &Spec) -> Result<Grammar> {
        let key = format!("{spec:?}");
        if let Some(m) = self.cache.lock().unwrap().get(&key) {
            return Ok(self.grammar(m.deep_clone()));
        }
        let parser = self.factory.create_parser(spec.grammar()?)?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            anyhow::bail!("{e}");
        }
        let mut cache = self.cache.lock().unwrap();
        if cache.len() >= CACHE {
            cache.clear();
        }
        cache.insert(key, m.deep_clone());
        Ok(self.grammar(m))
    }

    fn grammar(&self, matcher: Matcher) -> Grammar {
        Grammar {
            matcher,
            eos: self.eos.clone(),
        }
    }
}

/// One request's matcher.
pub struct Grammar {
    matcher: Matcher,
    /// Every end-of-sequence id; the first is the one the grammar knows.
    eos: Vec<u32>,
}

impl Grammar {
    /// Another matcher in the same state (the `n` choices of one call).
    pub fn fork(&self) -> Grammar {
        Grammar {
            matcher: self.matcher.deep_clone(),
            eos: self.eos.clone(),
        }
    }

    pub fn into_constraint(self) -> Constraint {
        Constraint::new(Box::new(self))
    }
}

impl TokenConstraint for Grammar {
    fn allowed(&mut self) -> Vec<u32> {
        let mut words = match self.matcher.compute_mask_or_eos() {
            Ok(mask) => mask.as_slice().to_vec(),
            Err(e) => {
                tracing::warn!("structured output: {e}; ending the request");
                Vec::new()
            }
        };
        let set = |w: &mut Vec<u32>, t: u32| {
            let i = t as usize / 32;
            if w.len() <= i {
                w.resize(i + 1, 0);
            }
            w[i] |= 1 << (t % 32);
        };
        let first = self.eos[0];
        let accepting =
            words.is_empty() || ferrite_core::constraint::is_allowed(&words, first as usize);
        if accepting {
            for &t in &self.eos {
                set(&mut words, t);
            }
        }
        words
    }

    fn commit(&mut self, token: u32) {
        // Any end-of-sequence id is the one the grammar knows.
        let token = if self.eos.contains(&token) {
            self.eos[0]
        } else {
            token
        };
        if let Err(e) = self.matcher.consume_token(token) {
            tracing::warn!("structured output: token {token}: {e}");
        }
    }
}

/// A shareable compiler, for the server's handlers.
pub type SharedGrammars = Arc<Grammars>;
