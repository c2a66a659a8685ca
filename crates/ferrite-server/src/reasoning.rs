//! Reasoning parsers (`--reasoning-parser`): the model's thinking, written between `<think>`
//! and `</think>`, goes out as `reasoning_content`, the rest as content (which the tool-call
//! parser then reads). Like the tool parser, one state machine serves streamed and whole
//! responses, so both split the text at the same place however it was cut into deltas.

use crate::tools::partial_suffix;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningParser {
    /// DeepSeek-R1: the template opens `<think>` in the prompt, so the output starts inside the
    /// reasoning (a leading `<think>` is skipped); it ends at `</think>`, or with the output.
    /// A grammar (structured output, forced tool calls) starts after `</think>`; when the
    /// prompt already closed the block the reply is the grammar's from its first token, and
    /// only an explicit `<think>...</think>` is reasoning.
    DeepSeekR1,
    /// Qwen3: reasoning only inside an explicit `<think>...</think>` at the start of the output
    /// (none with `enable_thinking: false`); an output that does not open one is all content.
    Qwen3,
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

impl ReasoningParser {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "deepseek_r1" | "deepseek-r1" => Some(Self::DeepSeekR1),
            "qwen3" => Some(Self::Qwen3),
            _ => None,
        }
    }

    pub const NAMES: &'static str = "deepseek_r1, qwen3";

    /// Whole output into (reasoning, content).
    pub fn split(self, text: &str, constrained: bool) -> (Option<String>, String) {
        let mut s = ReasoningStream::new(self, constrained);
        let mut pieces = s.push(text);
        pieces.extend(s.finish());
        let (mut reasoning, mut content) = (None::<String>, String::new());
        for p in pieces {
            match p {
                Piece::Reasoning(r) => reasoning.get_or_insert_with(String::new).push_str(&r),
                Piece::Content(c) => content.push_str(&c),
            }
        }
        (reasoning, content)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace yet: whether reasoning opens is not known.
    Start,
    Reasoning,
    /// After the reasoning: whitespace before the content is dropped.
    AfterReasoning,
    Content,
}

pub struct ReasoningStream {
    /// Whether output that does not open `<think>` starts inside the reasoning.
    implicit: bool,
    phase: Phase,
    /// Text not yet sent (a marker may be starting in it).
    held: String,
}

impl ReasoningStream {
    pub fn new(parser: ReasoningParser, constrained: bool) -> Self {
        Self {
            implicit: parser == ReasoningParser::DeepSeekR1 && !constrained,
            phase: Phase::Start,
            held: String::new(),
        }
    }

    pub fn push(&mut self, delta: &str) -> Vec<Piece> {
        self.held.push_str(delta);
        let mut out = Vec::new();
        self.advance(false, &mut out);
        out
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.advance(true, &mut out);
        out
    }

    fn advance(&mut self, at_end: bool, out: &mut Vec<Piece>) {
        loop {
            match self.phase {
                Phase::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.phase = Phase::Reasoning;
                    } else if OPEN.starts_with(t) && !at_end {
                        return;
                    } else {
                        self.phase = if self.implicit {
                            Phase::Reasoning
                        } else {
                            Phase::Content
                        };
                    }
                }
                Phase::Reasoning => {
                    if let Some(at) = self.held.find(CLOSE) {
                        let r = self.held[..at].to_string();
                        let rest = self.held[at + CLOSE.len()..].to_string();
                        if !r.is_empty() {
                            out.push(Piece::Reasoning(r));
                        }
                        self.held = rest;
                        self.phase = Phase::AfterReasoning;
                        continue;
                    }
                    let hold = if at_end {
                        0
                    } else {
                        partial_suffix(&self.held, CLOSE)
                    };
                    let send = self.held.len() - hold;
                    if send > 0 {
                        out.push(Piece::Reasoning(self.held[..send].to_string()));
                        self.held.drain(..send);
                    }
                    return;
                }
                Phase::AfterReasoning => {
                    self.held = self.held.trim_start().to_string();
                    if self.held.is_empty() {
                        return;
                    }
                    self.phase = Phase::Content;
                }
                Phase::Content => {
                    if !self.held.is_empty() {
                        out.push(Piece::Content(std::mem::take(&mut self.held)));
                    }
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn splits_reasoning_from_content() {
        let r1 = ReasoningParser::DeepSeekR1;
        assert_eq!(
            r1.split("<think>a b</think>\n\nAnswer", false),
            (Some("a b".into()), "Answer".into())
        );
        assert_eq!(
            r1.split("plan</think>Answer", false),
            (Some("plan".into()), "Answer".into())
        );
        assert_eq!(
            r1.split("cut short", false),
            (Some("cut short".into()), String::new())
        );
        assert_eq!(r1.split("{\"a\": 1}", true), (None, "{\"a\": 1}".into()));
        let q = ReasoningParser::Qwen3;
        assert_eq!(
            q.split("<think>\n\n</think>\n\nHi", false),
            (Some("\n\n".into()), "Hi".into())
        );
        assert_eq!(q.split("Hi there", false), (None, "Hi there".into()));
        assert_eq!(q.split("<thin", false), (None, "<thin".into()));
    }

    proptest! {
        #[test]
        fn any_split_gives_the_same_pieces(cuts in proptest::collection::vec(0usize..60, 0..8)) {
            for parser in [ReasoningParser::DeepSeekR1, ReasoningParser::Qwen3] {
                for text in [" <think>step 1 < step 2</think>  final <b>", "x</thi</think>y", "<think>open"] {
                    let mut at: Vec<usize> = cuts.iter().map(|c| c % (text.len() + 1)).collect();
                    at.sort();
                    let mut s = ReasoningStream::new(parser, false);
                    let (mut r, mut c) = (None::<String>, String::new());
                    let mut prev = 0;
                    let mut pieces = Vec::new();
                    for cut in at.into_iter().chain([text.len()]) {
                        pieces.extend(s.push(&text[prev..cut]));
                        prev = cut;
                    }
                    pieces.extend(s.finish());
                    for p in pieces {
                        match p {
                            Piece::Reasoning(x) => r.get_or_insert_with(String::new).push_str(&x),
                            Piece::Content(x) => c.push_str(&x),
                        }
                    }
                    prop_assert_eq!((r, c), parser.split(text, false));
                }
            }
        }
    }
}
