//! Incremental detokenization: text is emitted only once it is valid UTF-8, so a multi-byte
//! character split across byte-fallback or byte-level tokens is never sent half-written.

use tokenizers::Tokenizer;

/// Prompt tokens kept as left context, so tokenizers that strip or add a leading space on
/// the first token of a decode see the output in its real surroundings.
const PROMPT_CONTEXT: usize = 6;

#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    tokens: Vec<u32>,
    /// Start of the window decoded as context for the next delta.
    prefix_offset: usize,
    /// Tokens before this have had their text emitted.
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    pub fn new(prompt: &[u32], skip_special_tokens: bool) -> Self {
        let tail = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..];
        Self {
            tokens: tail.to_vec(),
            prefix_offset: 0,
            read_offset: tail.len(),
            skip_special_tokens,
        }
    }

    fn decode(&self, tok: &Tokenizer, ids: &[u32]) -> String {
        tok.decode(ids, self.skip_special_tokens)
            .unwrap_or_default()
    }

    /// Adds one token and returns the text that became final (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.tokens.push(id);
        let prefix = self.decode(tok, &self.tokens[self.prefix_offset..self.read_offset]);
        let full = self.decode(tok, &self.tokens[self.prefix_offset..]);
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return String::new();
        }
        let delta = match full.strip_prefix(prefix.as_str()) {
            Some(d) => d.to_string(),
            None if full.is_char_boundary(prefix.len()) => full[prefix.len()..].to_string(),
            None => return String::new(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        delta
    }

    /// Text of tokens still held back (an unfinished UTF-8 sequence at the end of the stream).
    pub fn flush(&mut self, tok: &Tokenizer) -> String {
        if self.read_offset == self.tokens.len() {
            return String::new();
        }
        let prefix = self.decode(tok, &self.tokens[self.prefix_offset..self.read_offset]);
        let full = self.decode(tok, &self.tokens[self.prefix_offset..]);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        match full.strip_prefix(prefix.as_str()) {
            Some(d) => d.to_string(),
            None if full.is_char_boundary(prefix.len().min(full.len())) => {
                full[prefix.len().min(full.len())..].to_string()
            }
            None => String::new(),
        }
    }
}
