//! What every drafter implements.

use super::verify::Draft;
use anyhow::Result;
use candle_core::Tensor;
use std::ops::Range;

/// How a drafter's time grows with the draft length, for the draft-length policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraftCostShape {
    /// Each drafted token costs about the same (a chain: draft model, EAGLE-3, lookup).
    #[default]
    PerToken,
    /// One pass drafts any length up to a block (DFlash): a draft costs the same at k = 1
    /// as at k = 15.
    PerDraft,
}

/// A drafter for one sequence. The engine drives it once per step:
/// `propose` → target verifies → `observe` with what was committed.
pub trait Proposer: Send {
    /// Short name for logs and reports (`ngram`, `draft-model`, `dflash`).
    fn name(&self) -> &str;

    /// Target decoder layers whose output hidden states this drafter needs for every token
    /// that enters the target's KV cache. The engine asks the forward for exactly these.
    fn tap_layers(&self) -> &[usize] {
        &[]
    }

    /// How this drafter's time grows with the draft length.
    fn draft_cost_shape(&self) -> DraftCostShape {
        DraftCostShape::PerToken
    }

    /// How many drafters this proposer chooses between step by step (two for `A+B`). The
    /// adaptive draft-length policy keeps acceptance and cost estimates for each.
    fn sources(&self) -> usize {
        1
    }

    /// How drafting time grows with the draft length for drafter `source`.
    fn source_cost_shape(&self, _source: usize) -> DraftCostShape {
        self.draft_cost_shape()
    }

    /// Which of [`Self::sources`] drafts the next `propose` after `tokens`, asked before its
    /// length is chosen.
    fn next_source(&mut self, _tokens: &[u32]) -> usize {
        0
    }

    /// Another of [`Self::sources`] that could draft the next `propose` instead of
    /// [`Self::next_source`]'s (`A+B` where A has a draft: B), for the planner to weigh.
    fn alternative_source(&mut self, _tokens: &[u32]) -> Option<usize> {
        None
    }

    /// The planner's choice between [`Self::next_source`] and [`Self::alternative_source`]
    /// for the next `propose`.
    fn select_source(&mut self, _source: usize) {}

    /// Whether `propose` after `tokens` would return a draft, where that is known without
    /// drafting (prompt lookup: whether the context has a match); None where it is not.
    fn has_draft(&mut self, _tokens: &[u32]) -> Option<bool> {
        None
    }

    /// From now on `propose` drafts trees of up to `max_len` nodes (`on`) or chains, where
    /// this drafter can draft trees. Returns whether it can.
    fn set_trees(&mut self, _on: bool) -> bool {
        false
    }

    /// Starts a new sequence with its prompt.
    fn begin(&mut self, prompt: &[u32]) -> Result<()>;

    /// How many leading tokens of `prompt` the engine may restore from its prefix cache
    /// instead of running them through the target (asked before `begin`). A drafter that
    /// reads the target's hidden states sees none for restored rows, so it answers with what
    /// it can restore on its own; the others need nothing from those rows.
    fn restorable_prefix(&self, _prompt: &[u32]) -> usize {
        if self.tap_layers().is_empty() {
            usize::MAX
        } else {
            0
        }
    }

    /// After a step: `tokens` is the whole committed sequence (prompt + output; its last
    /// token is not yet in the target's cache), `cached` the range of `tokens` that entered
    /// the target's KV cache in this step, and `taps` the target's hidden states for exactly
    /// those tokens, one `[cached.len(), hidden]` tensor per tap layer. The drafter must
    /// drop every trace of rejected draft tokens here (rollback of its own caches).
    fn observe(&mut self, tokens: &[u32], cached: Range<usize>, taps: &[Tensor]) -> Result<()>;

    /// Proposes up to `max_len` tokens to follow `tokens` (the committed sequence): a chain,
    /// or after [`Self::set_trees`] a tree of up to `max_len` nodes.
    fn propose(&mut self, tokens: &[u32], max_len: usize) -> Result<Draft>;

    /// Committed tokens the drafter has not processed yet and must before it can draft (a
    /// draft model that sat idle feeds them all first): what resuming drafting costs. A few
    /// that `propose` processes in its own first forward, at no extra cost, are not counted.
    fn pending_catch_up(&self, _tokens: &[u32]) -> usize {
        0
    }

    /// Processes the pending tokens ahead of `propose`, so that the engine can time catching
    /// up apart from drafting. Returns how many it processed (none of those
    /// [`Self::pending_catch_up`] does not count).
    fn catch_up(&mut self, _tokens: &[u32]) -> Result<usize> {
        Ok(0)
    }
}

/// A borrowed proposer drafts like the one it borrows (callers that keep their drafter to
/// inspect it afterwards lend it to the engine).
impl<P: Proposer + ?Sized> Proposer for &mut P {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn tap_layers(&self) -> &[usize] {
        (**self).tap_layers()
    }
    fn restorable_prefix(&self, prompt: &[u32]) -> usize {
        (**self).restorable_prefix(prompt)
    }
    fn draft_cost_shape(&self) -> DraftCostShape {
        (**self).draft_cost_shape()
    }
    fn sources(&self) -> usize {
        (**self).sources()
    }
    fn source_cost_shape(&self, source: usize) -> DraftCostShape {
        (**self).source_cost_shape(source)
    }
    fn next_source(&mut self, tokens: &[u32]) -> usize {
        (**self).next_source(tokens)
    }
    fn has_draft(&mut self, tokens: &[u32]) -> Option<bool> {
        (**self).has_draft(tokens)
    }
    fn alternative_source(&mut self, tokens: &[u32]) -> Option<usize> {
        (**self).alternative_source(tokens)
    }
    fn select_source(&mut self, source: usize) {
        (**self).select_source(source)
    }

    fn set_trees(&mut self, on: bool) -> bool {
        (**self).set_trees(on)
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        (**self).begin(prompt)
    }
    fn observe(&mut self, tokens: &[u32], cached: Range<usize>, taps: &[Tensor]) -> Result<()> {
        (**self).observe(tokens, cached, taps)
    }
    fn propose(&mut self, tokens: &[u32], max_len: usize) -> Result<Draft> {
        (**self).propose(tokens, max_len)
    }
    fn pending_catch_up(&self, tokens: &[u32]) -> usize {
        (**self).pending_catch_up(tokens)
    }
    fn catch_up(&mut self, tokens: &[u32]) -> Result<usize> {
        (**self).catch_up(tokens)
    }
}
