//! Structured output as the engine sees it: a per-request grammar that says which tokens may
//! come next. The engine only carries it from the request to the sampled rows; the executor
//! asks it for a mask while the model step runs and tells it each token drawn.

use std::fmt;
use std::sync::{Arc, Mutex};

/// A grammar over the model's vocabulary (implemented with llguidance in `ferrite-grammar`).
pub trait TokenConstraint: Send {
    /// The tokens allowed next, bit `t % 32` of word `t / 32`; only end-of-sequence once
    /// the grammar is complete (or broken: it never lets a request run on unconstrained).
    fn allowed(&mut self) -> Vec<u32>;
    /// `token` was drawn.
    fn commit(&mut self, token: u32);
}

/// A request's grammar, shared between its scheduled rows and the executor.
#[derive(Clone)]
pub struct Constraint(Arc<Mutex<Shared>>);

struct Shared {
    grammar: Box<dyn TokenConstraint>,
    /// Tokens drawn since the last mask, not yet told to the grammar.
    drawn: Vec<u32>,
}

impl Constraint {
    pub fn new(c: Box<dyn TokenConstraint>) -> Self {
        Self(Arc::new(Mutex::new(Shared {
            grammar: c,
            drawn: Vec::new(),
        })))
    }

    /// The next mask, after the grammar has taken the tokens drawn since the last one. The
    /// executor asks while the model step runs, so the grammar's work stays off the step.
    pub fn allowed(&self) -> Vec<u32> {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Shared { grammar, drawn } = &mut *s;
        for t in drawn.drain(..) {
            grammar.commit(t);
        }
        grammar.allowed()
    }

    /// `token` was drawn; the grammar takes it before the next mask.
    pub fn commit(&self, token: u32) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drawn
            .push(token)
    }
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Constraint")
    }
}

/// Whether bit `token` of `mask` is set (tokens past the mask are not allowed).
pub fn is_allowed(mask: &[u32], token: usize) -> bool {
    mask.get(token / 32)
        .is_some_and(|w| w >> (token % 32) & 1 == 1)
}
