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
use llguidance::toktrie::{TokEnv, TokTrie};
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
    vocab: Arc<Vocabulary>,
}

/// What the reasoning gate reads of the vocabulary.
struct Vocabulary {
    env: TokEnv,
    /// Tokens that open a reasoning block (`<think>` after any whitespace).
    opens: Vec<u32>,
    /// Mask words covering the vocabulary.
    words: usize,
}

impl Vocabulary {
    /// A token's text as bytes (special tokens without their marker).
    fn bytes(&self, t: u32) -> &[u8] {
        let b = self.env.tok_trie().token(t);
        b.strip_prefix(&[TokTrie::SPECIAL_TOKEN_MARKER])
            .unwrap_or(b)
    }
}

/// How a reasoning model's output relates to its grammar, as vLLM applies one with a
/// reasoning parser: the grammar starts once the reasoning block has closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reasoning {
    /// The template opened the block in the prompt (DeepSeek-R1): the grammar waits for
    /// `</think>`.
    Opened,
    /// The output may open a block (Qwen3): if it starts with a `<think>` token the grammar
    /// waits for `</think>`, otherwise it applies from the first token.
    Optional,
}

/// Where a matcher stands with respect to the model's reasoning.
#[derive(Clone, Debug)]
enum Gate {
    /// The grammar applies.
    Open,
    /// Nothing drawn yet; a `<think>` token may open a block.
    Undecided,
    /// Inside the block: anything goes; the last bytes drawn, to see `</think>`.
    Thinking(Vec<u8>),
}

const CLOSE: &[u8] = b"</think>";

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
        let trie = env.tok_trie();
        let opens = (0..trie.vocab_size() as u32)
            .filter(|&t| {
                let b = trie.token(t);
                let b = b
                    .strip_prefix(&[TokTrie::SPECIAL_TOKEN_MARKER])
                    .unwrap_or(b);
                b.trim_ascii_start() == b"<think>"
            })
            .collect();
        let words = trie.vocab_size().div_ceil(32);
        Ok(Self {
            factory,
            eos: eos.to_vec(),
            cache: Mutex::default(),
            vocab: Arc::new(Vocabulary { env, opens, words }),
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
            gate: Gate::Open,
            vocab: self.vocab.clone(),
            eos: self.eos.clone(),
        }
    }
}

/// One request's matcher.
pub struct Grammar {
    matcher: Matcher,
    gate: Gate,
    vocab: Arc<Vocabulary>,
    /// Every end-of-sequence id; the first is the one the grammar knows.
    eos: Vec<u32>,
}

impl Grammar {
    /// Another matcher in the same state (the `n` choices of one call).
    pub fn fork(&self) -> Grammar {
        Grammar {
            matcher: self.matcher.deep_clone(),
            gate: self.gate.clone(),
            vocab: self.vocab.clone(),
            eos: self.eos.clone(),
        }
    }

    /// The grammar held back while the model reasons. `closed_in_prompt`: the prompt already
    /// ended the block (a template that turns thinking off writes an empty one).
    pub fn after_reasoning(mut self, r: Reasoning, closed_in_prompt: bool) -> Grammar {
        self.gate = match (r, closed_in_prompt) {
            (_, true) => Gate::Open,
            (Reasoning::Opened, false) => Gate::Thinking(Vec::new()),
            (Reasoning::Optional, false) => Gate::Undecided,
        };
        self
    }

    pub fn into_constraint(self) -> Constraint {
        Constraint::new(Box::new(self))
    }
}

impl TokenConstraint for Grammar {
    fn allowed(&mut self) -> Vec<u32> {
        match &self.gate {
            Gate::Open => self.grammar_mask(),
            Gate::Thinking(_) => vec![u32::MAX; self.vocab.words],
            Gate::Undecided => {
                let mut words = self.grammar_mask();
                for &t in &self.vocab.opens {
                    set_bit(&mut words, t);
                }
                words
            }
        }
    }

    fn commit(&mut self, token: u32) {
        match &mut self.gate {
            Gate::Open => {}
            Gate::Undecided if self.vocab.opens.contains(&token) => {
                self.gate = Gate::Thinking(Vec::new());
                return;
            }
            Gate::Undecided => self.gate = Gate::Open,
            Gate::Thinking(tail) => {
                tail.extend_from_slice(self.vocab.bytes(token));
                if tail.windows(CLOSE.len()).any(|w| w == CLOSE) {
                    self.gate = Gate::Open;
                } else if tail.len() > CLOSE.len() {
                    tail.drain(..tail.len() - CLOSE.len());
                }
                return;
            }
        }
        self.grammar_commit(token);
    }
}

impl Grammar {
    /// The grammar's own mask; every end-of-sequence id allowed once it accepts.
    fn grammar_mask(&mut self) -> Vec<u32> {
        let mut words = match self.matcher.compute_mask_or_eos() {
            Ok(mask) => mask.as_slice().to_vec(),
            Err(e) => {
                tracing::warn!("structured output: {e}; ending the request");
                Vec::new()
            }
        };
        let first = self.eos[0];
        let accepting =
            words.is_empty() || ferrite_core::constraint::is_allowed(&words, first as usize);
        if accepting {
            for &t in &self.eos {
                set_bit(&mut words, t);
            }
        }
        words
    }

    fn grammar_commit(&mut self, token: u32) {
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

fn set_bit(words: &mut Vec<u32>, t: u32) {
    let i = t as usize / 32;
    if words.len() <= i {
        words.resize(i + 1, 0);
    }
    words[i] |= 1 << (t % 32);
}

/// A shareable compiler, for the server's handlers.
pub type SharedGrammars = Arc<Grammars>;
