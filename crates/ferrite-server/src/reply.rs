//! One choice's output as it streams: through the reasoning parser, then the tool-call
//! parser, as events every API turns into its own deltas.

use crate::reasoning::{Piece, ReasoningStream};
use crate::state::AppState;
use crate::tools::{CallStream, ToolEvent, ToolParser};
use serde_json::Value;

/// One streamed reply through the reasoning parser, then the tool-call parser.
pub(crate) struct ReplyStream {
    reasoning: Option<ReasoningStream>,
    calls: Option<CallStream>,
    /// Calls are forced: text outside them is an unfinished call's markup, not content.
    forced: bool,
}

pub(crate) enum ReplyEvent {
    Reasoning(String),
    Tool(ToolEvent),
}

impl ReplyStream {
    pub fn new(
        state: &AppState,
        parser: Option<ToolParser>,
        tools: &[Value],
        constrained: bool,
        forced: bool,
    ) -> Self {
        Self {
            reasoning: state
                .reasoning_parser
                .map(|r| ReasoningStream::new(r, constrained)),
            calls: parser.map(|p| CallStream::new(p, tools)),
            forced,
        }
    }

    /// The events of the next text; `last`: the output ends with it.
    pub fn push(&mut self, text: &str, last: bool) -> Vec<ReplyEvent> {
        let pieces = match &mut self.reasoning {
            Some(r) => {
                let mut p = r.push(text);
                if last {
                    p.extend(r.finish());
                }
                p
            }
            None => vec![Piece::Content(text.to_string())],
        };
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Reasoning(r) => out.push(ReplyEvent::Reasoning(r)),
                Piece::Content(c) => match &mut self.calls {
                    Some(calls) => out.extend(calls.push(&c).into_iter().map(ReplyEvent::Tool)),
                    None => out.push(ReplyEvent::Tool(ToolEvent::Content(c))),
                },
            }
        }
        if let (true, Some(calls)) = (last, &mut self.calls) {
            out.extend(calls.finish().into_iter().map(ReplyEvent::Tool));
        }
        if self.forced {
            out.retain(|e| !matches!(e, ReplyEvent::Tool(ToolEvent::Content(_))));
        }
        out
    }
}
