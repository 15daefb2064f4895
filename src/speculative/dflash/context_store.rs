//! The drafter's context K/V of recent prompts, so that a request whose prompt prefix the
//! target restores from its prefix cache can restore the drafter's context rows for that prefix
//! too, instead of drafting without them.
//!
//! A context row depends only on the target's hidden states at that position, which depend
//! only on the tokens up to it (the target is causal, and its forward gives the same values for
//! a row whatever else is in the batch), so restored rows equal recomputed ones.
//!
//! Entries are the full prompts' rows, keyed by the target (a weak reference to its embedding:
//! the allocation cannot be reused while the entry exists) and the tokens. Bounded by the rows
//! held; the least recently used entries go first.

use super::model::LayerKv;
use candle_core::quantized::QTensor;
use std::sync::{Arc, Mutex, Weak};

struct Entry {
    target: Weak<QTensor>,
    tokens: Vec<u32>,
    /// Per drafter layer, K and V of rows `0..tokens.len()`.
    layers: Vec<LayerKv>,
    last_used: u64,
}

pub struct ContextStore {
    inner: Mutex<Inner>,
    /// Rows held at most, over all entries.
    capacity_rows: usize,
}

#[derive(Default)]
struct Inner {
    entries: Vec<Entry>,
    clock: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl ContextStore {
    pub fn new(capacity_rows: usize) -> Self {
        Self { inner: Mutex::new(Inner::default()), capacity_rows }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many leading rows of `prompt` the store can restore for `target`.
    pub fn restorable(&self, target: &Arc<QTensor>, prompt: &[u32]) -> usize {
        let weak = Arc::downgrade(target);
        self.lock()
            .entries
            .iter()
            .filter(|e| e.target.ptr_eq(&weak))
            .map(|e| common_prefix(&e.tokens, prompt))
            .max()
            .unwrap_or(0)
    }

    /// The K/V of rows `0..rows` for `prompt[..rows]`, if an entry holds them.
    pub fn take(&self, target: &Arc<QTensor>, prompt: &[u32], rows: usize) -> Option<Vec<LayerKv>> {
        let weak = Arc::downgrade(target);
        let mut inner = self.lock();
        inner.clock += 1;
        let now = inner.clock;
        let entry = inner
            .entries
            .iter_mut()
            .filter(|e| e.target.ptr_eq(&weak) && e.tokens.len() >= rows && e.tokens[..rows] == prompt[..rows])
            .max_by_key(|e| e.last_used)?;
        entry.last_used = now;
        entry
            .layers
            .iter()
            .map(|l| Some(LayerKv { k: l.k.narrow(1, 0, rows).ok()?, v: l.v.narrow(1, 0, rows).ok()? }))
            .collect()
    }

    /// Keeps the context rows of `tokens` (rows `0..tokens.len()`), replacing an entry that is
    /// a prefix of them; evicts the least recently used entries beyond the capacity.
    pub fn put(&self, target: &Arc<QTensor>, tokens: &[u32], layers: Vec<LayerKv>) {
        if tokens.is_empty() || tokens.len() > self.capacity_rows {
            return;
        }
        let weak = Arc::downgrade(target);
        let mut inner = self.lock();
        inner.clock += 1;
        let now = inner.clock;
        // Dead targets' entries, and entries this one covers, go.
        inner.entries.retain(|e| {
            e.target.strong_count() > 0
                && !(e.target.ptr_eq(&weak)
                    && e.tokens.len() <= tokens.len()
                    && tokens[..e.tokens.len()] == e.tokens[..])
        });
        if inner
            .entries
            .iter()
            .any(|e| e.target.ptr_eq(&weak) && e.tokens.len() >= tokens.len() && e.tokens[..tokens.len()] == *tokens)
        {
            return;
        }
        inner.entries.push(Entry { target: weak, tokens: tokens.to_vec(), layers, last_used: now });
        let mut held: usize = inner.entries.iter().map(|e| e.tokens.len()).sum();
        while held > self.capacity_rows {
            let Some((i, _)) = inner.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used) else { break };
            held -= inner.entries.remove(i).tokens.len();
        }
    }

    /// Rows held (tests, stats).
    pub fn rows(&self) -> usize {
        self.lock().entries.iter().map(|e| e.tokens.len()).sum()
    }
}
