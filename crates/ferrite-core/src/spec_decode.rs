//! Speculative decoding as the scheduler sees it: which requests get draft tokens this step
//! and what they are. Drafts come from the request's own tokens (n-gram prompt lookup), from
//! a draft model or from the target's multi-token-prediction head, which the runner ran
//! after the previous step, so nothing here touches a tensor; the runner verifies them in
//! the packed step.

use serde::Deserialize;

/// `--speculative-config`, as vLLM takes it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeConfig {
    pub method: String,
    /// Draft tokens per request and step (k).
    pub num_speculative_tokens: usize,
    /// Longest suffix n-gram looked up in the request's tokens.
    #[serde(default)]
    pub prompt_lookup_max: Option<usize>,
    /// Shortest n-gram that counts as a match (default 1).
    #[serde(default)]
    pub prompt_lookup_min: Option<usize>,
    /// Above this many running requests no request drafts: a large batch already fills the
    /// step, and verifying drafts that fail costs more than it saves.
    #[serde(default)]
    pub disable_by_batch_size: Option<usize>,
    /// The draft model of method `draft_model`: a file or folder with the target's
    /// tokenizer.
    #[serde(default)]
    pub model: Option<String>,
}

/// Parsed and checked speculation settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Speculation {
    pub k: usize,
    pub proposer: Proposer,
    pub disable_by_batch_size: usize,
}

/// Where draft tokens come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Proposer {
    /// The request's own tokens: what followed the latest earlier occurrence of its suffix
    /// (`min_n` to `max_n` tokens long).
    Ngram { min_n: usize, max_n: usize },
    /// A smaller model with the same tokenizer, its K/V in the target's blocks.
    DraftModel { model: std::path::PathBuf },
    /// The target's multi-token-prediction head (Qwen3-Next, Qwen3.5), run over the
    /// target's hidden states after each step; k > 1 chains it on its own hidden state.
    Mtp,
}

impl Proposer {
    /// Whether drafts are what the runner proposed after the previous step.
    pub fn runs_after_step(&self) -> bool {
        !matches!(self, Proposer::Ngram { .. })
    }
}

/// What the draft model runs for one request after a step (it runs after the target, on
/// the same block table): known tokens it lacks, then the step's accepted rows and the token
/// sampled after them, then `propose` tokens of its own, one row per pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraftRun {
    /// Position of the first token the draft model is fed (its K/V holds the ones before).
    pub start: usize,
    /// Known tokens from `start` on that come before this step's rows.
    pub catch_up: Vec<u32>,
    /// Whether this step's accepted rows follow `catch_up` (false: the step's draft budget
    /// ran out, and the draft model catches up over later steps).
    pub with_step: bool,
    /// Tokens to propose for the next step; when more than 0 the sampled token is fed too,
    /// and the request's blocks have room for `propose` tokens past this step's rows.
    pub propose: usize,
}

/// What the MTP head runs for one request after a step: over the step's rows with each
/// row's token moved one ahead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MtpRun {
    /// The known token after the step's last row (a prefill chunk that leaves prompt
    /// tokens); `None`: the token sampled after it.
    pub next: Option<u32>,
    /// Tokens to propose for the next step; the request's blocks have room for them.
    pub propose: usize,
}

/// Largest k accepted: the verify rows of a step grow with it, its gain does not.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// Running requests above which speculation pauses when the config says nothing
/// (measured: docs/benchmarks/cpu-speculative.md).
pub const DEFAULT_DISABLE_BY_BATCH_SIZE: usize = 4;

impl SpeculativeConfig {
    /// Checks the config; an error says what to change.
    pub fn resolve(&self) -> Result<Speculation, String> {
        let proposer = match self.method.as_str() {
            "ngram" | "prompt_lookup" => {
                if self.model.is_some() {
                    return Err("the `ngram` method takes no `model`".into());
                }
                let max_n = self.prompt_lookup_max.unwrap_or(4);
                // One token is enough: a draft is no longer than the text agreeing before
                // its match, so a chance match drafts one token (measured:
                // docs/benchmarks/cpu-speculative.md).
                let min_n = self.prompt_lookup_min.unwrap_or(1);
                if min_n == 0 || min_n > max_n {
                    return Err(format!(
                        "prompt_lookup_min ({min_n}) must be at least 1 and at most prompt_lookup_max ({max_n})"
                    ));
                }
                Proposer::Ngram { min_n, max_n }
            }
            "draft_model" => {
                let Some(model) = &self.model else {
                    return Err("the `draft_model` method needs a `model`: the draft's file or folder".into());
                };
                if self.prompt_lookup_min.is_some() || self.prompt_lookup_max.is_some() {
                    return Err("prompt_lookup_min/max belong to the `ngram` method, not `draft_model`".into());
                }
                Proposer::DraftModel {
                    model: model.into(),
                }
            }
            // vLLM's names for the heads of the families ferrite serves.
            "mtp" | "qwen3_next_mtp" | "qwen3_5_mtp" => {
                if self.model.is_some() {
                    return Err("the `mtp` method drafts with the target's own head: it takes no `model`".into());
                }
                if self.prompt_lookup_min.is_some() || self.prompt_lookup_max.is_some() {
                    return Err("prompt_lookup_min/max belong to the `ngram` method, not `mtp`".into());
                }
                Proposer::Mtp
            }
            "eagle" | "eagle3" | "medusa" => {
                return Err(format!(
                    "speculative method `{}` is not served by ferrite yet; use `ngram`, `draft_model` or `mtp`",
                    self.method
                ))
            }
            m => {
                return Err(format!(
                    "unknown speculative method `{m}`; use `ngram`, `draft_model` or `mtp`"
                ))
            }
        };
        let k = self.num_speculative_tokens;
        if k == 0 || k > MAX_SPECULATIVE_TOKENS {
            return Err(format!(
                "num_speculative_tokens must be 1 to {MAX_SPECULATIVE_TOKENS}, not {k}"
            ));
        }
        let disable = self
            .disable_by_batch_size
            .unwrap_or(DEFAULT_DISABLE_BY_BATCH_SIZE);
        if disable == 0 {
            return Err("disable_by_batch_size must be at least 1".into());
        }
        Ok(Speculation {
            k,
            proposer,
            disable_by_batch_size: disable,
        })
    }
}

impl Speculation {
    /// Up to `limit` tokens that followed an earlier occurrence of the longest suffix of
    /// `tokens` (between `min_n` and `max_n` long) that occurred before: what the text would
    /// say next if it repeated itself. Nothing for a draft model's speculation.
    ///
    /// Of the suffix's occurrences, the one whose preceding text agrees with the text before
    /// the suffix the longest (up to `MATCH_HORIZON` tokens; ties: the latest) is followed:
    /// copied text repeats a region, not every place where a short n-gram recurs (a JSON
    /// record's keys recur in every record, and only the record being copied says what comes
    /// next). The draft is no longer than that agreement: a long one says a copy is under way
    /// and will go on; a short one is as likely chance, and a long draft after it would mostly
    /// cost verify rows. Replayed over the greedy answers of the `copy` benchmark split
    /// (`scripts/spec-draft-sim.py`, k = 4), these two choices raise acceptance from 0.64 to
    /// 0.71 (docs/benchmarks/cpu-speculative.md).
    pub fn propose(&self, tokens: &[u32], limit: usize) -> Vec<u32> {
        let limit = limit.min(self.k);
        let Proposer::Ngram { min_n, max_n } = self.proposer else {
            return Vec::new();
        };
        if limit == 0 {
            return Vec::new();
        }
        let len = tokens.len();
        // How many tokens before position `end` agree with those before the suffix's
        // occurrence at `len` (the suffix itself included when the occurrence matched it).
        let agreement = |end: usize| {
            tokens[..end]
                .iter()
                .rev()
                .zip(tokens.iter().rev())
                .take(MATCH_HORIZON)
                .take_while(|(a, b)| a == b)
                .count()
        };
        for n in (min_n..=max_n).rev() {
            if len <= n {
                continue;
            }
            let suffix = &tokens[len - n..];
            // Occurrences end before the suffix and have a token after them; the latest
            // wins ties (agents repeat what they said last).
            let best = (n..len)
                .rev()
                .filter(|&end| &tokens[end - n..end] == suffix)
                .map(|end| (agreement(end), end))
                .max_by_key(|&(agreed, end)| (agreed, end));
            if let Some((agreed, from)) = best {
                let to = (from + limit.min(agreed)).min(len);
                return tokens[from..to].to_vec();
            }
        }
        Vec::new()
    }
}

/// How far back a prompt-lookup match is followed to choose among occurrences and to bound
/// the draft's length.
const MATCH_HORIZON: usize = 64;

/// Counts of drafted and accepted tokens, as vLLM's `spec_decode` metrics name them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    /// Accepted drafts at each position (0: the first draft token).
    pub accepted_per_pos: Vec<u64>,
}

impl SpecStats {
    /// A verified draft of `drafted` tokens whose first `accepted` held.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.num_drafts += 1;
        self.num_draft_tokens += drafted as u64;
        self.num_accepted_tokens += accepted as u64;
        if self.accepted_per_pos.len() < drafted {
            self.accepted_per_pos.resize(drafted, 0);
        }
        for p in &mut self.accepted_per_pos[..accepted] {
            *p += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ngram(k: usize, min_n: usize, max_n: usize) -> Speculation {
        Speculation {
            k,
            proposer: Proposer::Ngram { min_n, max_n },
            disable_by_batch_size: 8,
        }
    }

    #[test]
    fn proposes_what_followed_a_match_of_the_longest_suffix() {
        let s = ngram(3, 1, 3);
        // Suffix [1, 2] occurs at 0 (then 3, 4) and at 5 (then 9), each agreeing two tokens
        // back: the latest wins, and drafts two.
        assert_eq!(s.propose(&[1, 2, 3, 4, 0, 1, 2, 9, 7, 1, 2], 8), vec![9, 7]);
        // Longer matches first: [5, 1, 2] matched at 0 beats [1, 2] at 4.
        assert_eq!(s.propose(&[5, 1, 2, 8, 1, 2, 6, 5, 1, 2], 8), vec![8, 1, 2]);
        assert_eq!(s.propose(&[1, 2, 3], 8), Vec::<u32>::new());
        // The limit (tokens left to generate) cuts the draft.
        assert_eq!(s.propose(&[4, 5, 6, 4, 5], 1), vec![6]);
        assert_eq!(s.propose(&[4, 5, 6, 4, 5], 0), Vec::<u32>::new());
        // Below min_n nothing counts.
        assert_eq!(ngram(3, 2, 3).propose(&[7, 1, 8, 1], 8), Vec::<u32>::new());
    }

    #[test]
    fn follows_the_occurrence_whose_text_before_agrees_longest() {
        let s = ngram(16, 1, 2);
        // [4, 5] ends the copied region 1..=5 (agreeing 4 tokens back) and the later
        // 6, 4, 5 (agreeing 2): the region is followed, for as many tokens as agreed.
        let text = [1, 2, 3, 4, 5, 8, 6, 4, 5, 7, 0, 2, 3, 4, 5];
        assert_eq!(s.propose(&text, 16), vec![8, 6, 4, 5]);
        // With the agreement cut to the suffix alone, the latest occurrence wins.
        let mut text = text.to_vec();
        text[11] = 9;
        text[12] = 9;
        assert_eq!(s.propose(&text, 16), vec![7, 0]);
    }

    #[test]
    fn drafts_no_more_than_the_agreed_length() {
        let s = ngram(16, 1, 2);
        let copied: Vec<u32> = (10..30).collect();
        // A one-token match (7 ... 7) drafts one token.
        assert_eq!(s.propose(&[7, 1, 2, 3, 4, 5, 9, 7], 16), vec![1]);
        // A match that agrees four tokens back (10..14 copied) drafts four, though the
        // lookup itself only compared two.
        let mut text = copied.clone();
        text.extend([0, 10, 11, 12, 13]);
        assert_eq!(s.propose(&text, 16), vec![14, 15, 16, 17]);
        // The agreement stops at the first difference before the occurrence.
        let mut text = vec![5, 6, 1, 2, 3, 8, 8, 9, 6, 1, 2, 3];
        assert_eq!(s.propose(&text, 16), vec![8, 8, 9, 6]);
        text.insert(9, 4);
        assert_eq!(s.propose(&text, 16), vec![8, 8, 9]);
        // k caps it.
        let mut long = copied.clone();
        long.extend(10..28);
        let mut expected = vec![28, 29];
        expected.extend(10..24);
        assert_eq!(s.propose(&long, 16), expected);
        assert_eq!(
            ngram(4, 1, 2).propose(&long[..30], 16),
            vec![20, 21, 22, 23]
        );
    }

    #[test]
    fn config_is_checked() {
        let c = |s: &str| {
            serde_json::from_str::<SpeculativeConfig>(s)
                .unwrap()
                .resolve()
        };
        assert_eq!(
            c(r#"{"method": "ngram", "num_speculative_tokens": 3}"#).unwrap(),
            Speculation {
                k: 3,
                proposer: Proposer::Ngram { min_n: 1, max_n: 4 },
                disable_by_batch_size: DEFAULT_DISABLE_BY_BATCH_SIZE
            }
        );
        assert_eq!(
            c(r#"{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 4}"#)
                .unwrap()
                .proposer,
            Proposer::DraftModel {
                model: "d.gguf".into()
            }
        );
        assert!(
            c(r#"{"method": "draft_model", "num_speculative_tokens": 4}"#)
                .unwrap_err()
                .contains("needs a `model`")
        );
        assert!(
            c(r#"{"method": "ngram", "model": "d.gguf", "num_speculative_tokens": 4}"#).is_err()
        );
        assert!(c(r#"{"method": "ngram", "num_speculative_tokens": 0}"#).is_err());
        assert!(c(r#"{"method": "eagle", "num_speculative_tokens": 1}"#)
            .unwrap_err()
            .contains("not served"));
        let mtp = c(r#"{"method": "mtp", "num_speculative_tokens": 2}"#).unwrap();
        assert_eq!((mtp.k, mtp.proposer), (2, Proposer::Mtp));
        assert!(
            c(r#"{"method": "mtp", "model": "d.gguf", "num_speculative_tokens": 1}"#)
                .unwrap_err()
                .contains("takes no `model`")
        );
        assert!(c(r#"{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}"#).is_err());
        assert!(serde_json::from_str::<SpeculativeConfig>(
            r#"{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}"#
        )
        .is_err());
    }

    #[test]
    fn stats_count_per_position() {
        let mut s = SpecStats::default();
        s.record(3, 2);
        s.record(2, 0);
        assert_eq!(
            (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens),
            (2, 5, 2)
        );
        assert_eq!(s.accepted_per_pos, vec![1, 1, 0]);
    }
}
