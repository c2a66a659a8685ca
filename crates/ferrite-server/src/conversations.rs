//! The conversations of `/v1/responses`, kept in memory for `previous_response_id`.

use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Responses whose conversations are kept for `previous_response_id`.
pub const KEPT_RESPONSES: usize = 1024;

/// Each kept response's conversation, as chat messages, its reply included.
#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<Kept>,
}

/// Conversations by response id, and the ids oldest first.
#[derive(Default)]
struct Kept {
    by_id: HashMap<String, Vec<Value>>,
    order: VecDeque<String>,
}

impl ResponseStore {
    pub fn get(&self, id: &str) -> Option<Vec<Value>> {
        self.inner.lock().unwrap().by_id.get(id).cloned()
    }

    pub fn put(&self, id: String, conversation: Vec<Value>) {
        let mut k = self.inner.lock().unwrap();
        if k.order.len() == KEPT_RESPONSES {
            if let Some(old) = k.order.pop_front() {
                k.by_id.remove(&old);
            }
        }
        k.order.push_back(id.clone());
        k.by_id.insert(id, conversation);
    }
}
