//! What a forward is asked to compute, and what it returns.

use crate::kv::SeqCache;
use anyhow::Result;
use candle_core::Tensor;
use std::ops::Range;

/// Which of a sequence's new rows need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsRows {
    /// None: a prefill chunk that is not the last one.
    None,
    /// The last row: plain decoding and the end of a prefill.
    Last,
    /// Every new row: verifying a draft block.
    All,
}

/// One sequence in a packed batch: the new tokens to run on top of what its cache holds.
/// Row i of `tokens` is written to cache slot `cache.len() + i`; it is at position
/// `cache.len() + i` in a chain, or `cache.len() + depth` in a tree.
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut SeqCache,
    pub logits: LogitsRows,
    /// A draft tree: row i's parent row (`NO_PARENT` for a row that follows the cache), each
    /// parent before its children. Row i attends to the cache and its ancestors only. After
    /// verifying, the caller keeps the accepted path with [`SeqCache::keep_rows`].
    pub parents: Option<&'a [u32]>,
}

/// Several sequences packed into one forward, plus the layers whose outputs are wanted.
#[derive(Default)]
pub struct ForwardBatch<'a> {
    pub seqs: Vec<SeqInput<'a>>,
    /// Decoder layers (0-based) whose output hidden states are returned for every row.
    pub tap_layers: Vec<usize>,
}

impl<'a> ForwardBatch<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, tokens: &'a [u32], cache: &'a mut SeqCache, logits: LogitsRows) {
        self.seqs.push(SeqInput { tokens, cache, logits, parents: None });
    }

    /// A sequence whose new rows form a tree: `parents[i]` is row i's parent row, or
    /// [`crate::kv::NO_PARENT`].
    pub fn push_tree(&mut self, tokens: &'a [u32], cache: &'a mut SeqCache, logits: LogitsRows, parents: &'a [u32]) {
        self.seqs.push(SeqInput { tokens, cache, logits, parents: Some(parents) });
    }

    pub fn total_rows(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

/// Results of a forward: logits for the wanted rows, and taps for all rows.
#[derive(Debug)]
pub struct ForwardOutput {
    /// `[wanted rows, vocab]`, sequences in batch order.
    pub logits: Tensor,
    /// Per sequence, its rows within `logits`.
    pub logits_ranges: Vec<Range<usize>>,
    /// Per sequence, its rows within the packed batch (and within each tap).
    pub row_ranges: Vec<Range<usize>>,
    /// One `[rows, hidden]` tensor per requested tap layer, in the order asked.
    pub taps: Vec<Tensor>,
}

impl ForwardOutput {
    /// Sequence `i`'s logits rows as plain vectors.
    pub fn seq_logits(&self, i: usize) -> Result<Vec<Vec<f32>>> {
        let r = self.logits_ranges[i].clone();
        if r.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self.logits.narrow(0, r.start, r.len())?.to_vec2::<f32>()?)
    }

    /// Rows `rows` (relative to sequence `i`'s own logits rows) as plain vectors.
    pub fn seq_logits_rows(&self, i: usize, rows: Range<usize>) -> Result<Vec<Vec<f32>>> {
        let r = self.logits_ranges[i].clone();
        anyhow::ensure!(rows.end <= r.len(), "logits rows {rows:?} of a sequence with {} rows", r.len());
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self.logits.narrow(0, r.start + rows.start, rows.len())?.to_vec2::<f32>()?)
    }

    /// Sequence `i`'s rows of every tap.
    pub fn seq_taps(&self, i: usize) -> Result<Vec<Tensor>> {
        let r = self.row_ranges[i].clone();
        Ok(self.taps.iter().map(|t| t.narrow(0, r.start, r.len())).collect::<candle_core::Result<_>>()?)
    }
}
