//! The model's vocabulary as llguidance reads it: every token's bytes in a trie, and a
//! tokenizer for the strings a grammar forces.

use anyhow::{anyhow, Result};
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use std::sync::Arc;

struct Vocab {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let text = String::from_utf8_lossy(s);
        match self.tokenizer.encode(text.as_ref(), false) {
            Ok(e) => e.get_ids().to_vec(),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }

    fn tokenize_is_canonical(&self) -> bool {
        true
    }
}

/// `tokenizer`'s tokens as bytes (from its `tokenizer.json` form), padded to `vocab_size`
/// with special tokens no grammar can produce.
pub fn env(tokenizer: &tokenizers::Tokenizer, vocab_size: usize, eos: u32) -> Result<TokEnv> {
    let json: serde_json::Value = serde_json::from_str(
        &tokenizer
            .to_string(false)
            .map_err(|e| anyhow!("serializing the tokenizer: {e}"))?,
    )?;
    let mut words = llguidance::token_bytes_from_tokenizer_json(&json)?;
    if words.len() > vocab_size {
        anyhow::bail!(
            "the tokenizer has {} tokens, the model's vocabulary {vocab_size}",
            words.len()
        );
    }
    for i in words.len()..vocab_size {
        let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        w.extend(format!("<[ferrite-unused-{i}]>").bytes());
        words.push(w);
    }
    let info = TokRxInfo::new(vocab_size as u32, eos);
    Ok(Arc::new(Vocab {
        trie: TokTrie::from(&info, &words),
        tokenizer: tokenizer.clone(),
    }))
}
