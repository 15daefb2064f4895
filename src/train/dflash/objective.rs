//! The DFlash training objective on one sequence (docs/training.md, "The objective").
//!
//! Each anchor `p` opens a block of `B` rows at positions `p … p+B−1`: row 0 holds the clean
//! token `x[p]`, rows 1… the MASK token. Every row of the block sees the target's features of
//! positions `0 … p−1` (strictly before the anchor) and all rows of its own block; blocks do not
//! see each other. All anchors of a sequence run in one drafter forward
//! ([`DflashDrafter::forward_block`], the same code that drafts when serving), packed as one
//! block per anchor with a mask over the context. Row `k ≥ 1` is scored against `x[p+k]` with weight
//! `exp(−(k−1)/γ)` (or a given per-offset table, e.g. how often serving verifies position k:
//! [`serving_position_weights`]) when `p+k` is inside the sequence and a response token (and, with a reduced
//! drafter vocabulary, one of its tokens); everything else weighs 0. The loss of a batch is
//! `Σ w·CE / Σ w` over all its rows.
//!
//! With `distill`, CE is the soft cross-entropy against the target's own distribution for
//! `x[p+k]` (its logits at `p+k−1`, restricted to the drafter's vocabulary) instead of the
//! one-hot label: forward-KL distillation, which tells the drafter how close each wrong
//! token was, not only which token won. The features then hold the target's last layer after
//! the tapped ones. Reported losses stay the hard CE, so runs with and without it compare.

use crate::speculative::dflash::{DflashDrafter, Packing, TargetHead};
use crate::speculative::nn::matmul_frozen_weight;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor, D};

/// What the drafter is trained against and never changes: the target's embedding (block
/// inputs) and LM-head rows (the drafter's output vocabulary).
pub struct FrozenTarget {
    pub head: TargetHead,
    /// `[drafter vocab, hidden]` f32: the target's LM-head rows for the drafter's tokens.
    pub lm_head: Tensor,
    /// Target id → drafter id (`u32::MAX`: not in the drafter's vocabulary); None when the
    /// drafter's vocabulary is the target's.
    pub target_to_draft: Option<Vec<u32>>,
}

impl FrozenTarget {
    fn draft_id(&self, target_id: u32) -> Option<u32> {
        match &self.target_to_draft {
            None => Some(target_id),
            Some(map) => map.get(target_id as usize).copied().filter(|&d| d != u32::MAX),
        }
    }
}

/// One training sequence: its tokens, loss mask and target features (at least up to the last
/// anchor), and the anchors drawn for it.
pub struct SequenceInput<'a> {
    pub tokens: &'a [u32],
    pub loss_mask: &'a [u8],
    /// `[≥ max anchor, taps·hidden]`: `TargetHead::hidden_state`s of the tapped layers, as
    /// `target_features` and the feature cache give them (with `distill`: `[≥ tokens − 1,
    /// (taps + 1)·hidden]`, the target's last layer last).
    pub features: &'a Tensor,
    pub anchors: &'a [usize],
}

/// A scored block row: its index among the forward's rows, its label in drafter ids, its
/// weight, and its offset `k` in the block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoredRow {
    pub row: usize,
    pub label: u32,
    pub weight: f32,
    pub offset: usize,
}

/// The decay weight of block offset `k ≥ 1`: `exp(−(k−1)/γ)`.
pub fn offset_weight(k: usize, gamma: f64) -> f32 {
    (-((k - 1) as f64) / gamma).exp() as f32
}

/// Most block offsets a weight table can give.
pub const MAX_WEIGHTED_OFFSETS: usize = 64;

/// How the loss weighs block offset `k ≥ 1`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PositionWeights {
    /// `exp(−(k−1)/γ)` ([`offset_weight`]).
    Decay { gamma: f64 },
    /// Offset k weighs `weights[k − 1]`; offsets past `len` weigh 0.
    Table { weights: [f32; MAX_WEIGHTED_OFFSETS], len: usize },
}

impl PositionWeights {
    /// A table of per-offset weights (offset 1 first): finite, non-negative, not all zero.
    pub fn table(weights: &[f64]) -> Result<Self> {
        if weights.is_empty() || weights.len() > MAX_WEIGHTED_OFFSETS {
            bail!("position weights: 1 to {MAX_WEIGHTED_OFFSETS} values, got {}", weights.len());
        }
        if let Some(w) = weights.iter().find(|w| !(w.is_finite() && **w >= 0.0)) {
            bail!("position weights must be finite and not negative, got {w}");
        }
        if weights.iter().all(|&w| w == 0.0) {
            bail!("position weights are all zero: nothing would be trained");
        }
        let mut table = [0f32; MAX_WEIGHTED_OFFSETS];
        for (t, &w) in table.iter_mut().zip(weights) {
            *t = w as f32;
        }
        Ok(Self::Table { weights: table, len: weights.len() })
    }

    /// The weight of block offset `k ≥ 1`.
    pub fn of(&self, k: usize) -> f32 {
        match *self {
            Self::Decay { gamma } => offset_weight(k, gamma),
            Self::Table { weights, len } => {
                if (1..=len).contains(&k) {
                    weights[k - 1]
                } else {
                    0.0
                }
            }
        }
    }
}

/// Per-offset weights that follow serving: offset k weighs how often serving's verifier reached
/// draft position k (every earlier position accepted and position k drafted), relative to
/// position 1, from a decode's `drafted_at` / `accepted_at` counts (`SpecMetrics`: drafts that
/// reached position i, and were accepted there). Reaching position k ≥ 2 is estimated as
/// accepted at k − 1 times the share of drafts at k − 1 that went on to k, which is exact for
/// chains whose length does not depend on their acceptance. Empty when nothing was drafted.
pub fn serving_position_weights(drafted_at: &[u64], accepted_at: &[u64]) -> Vec<f64> {
    let first = drafted_at.first().copied().unwrap_or(0);
    if first == 0 {
        return Vec::new();
    }
    let mut weights = vec![1.0];
    for k in 1..drafted_at.len().min(accepted_at.len() + 1) {
        let went_on = drafted_at[k] as f64 / drafted_at[k - 1].max(1) as f64;
        weights.push(accepted_at[k - 1] as f64 * went_on / first as f64);
    }
    while weights.last() == Some(&0.0) {
        weights.pop();
    }
    weights
}

/// The rows of a sequence's forward that carry a label (weight > 0), in row order.
pub fn scored_rows(
    tokens: &[u32],
    loss_mask: &[u8],
    anchors: &[usize],
    block: usize,
    weights: PositionWeights,
    frozen: &FrozenTarget,
) -> Vec<ScoredRow> {
    let mut out = Vec::new();
    for (a, &p) in anchors.iter().enumerate() {
        for k in 1..block {
            let pos = p + k;
            if pos >= tokens.len() || loss_mask.get(pos).copied().unwrap_or(0) == 0 {
                continue;
            }
            let weight = weights.of(k);
            let Some(label) = frozen.draft_id(tokens[pos]).filter(|_| weight > 0.0) else { continue };
            out.push(ScoredRow { row: a * block + k, label, weight, offset: k });
        }
    }
    out
}

/// Per block offset k (index k−1): rows inside the answer whose label is outside the drafter's
/// vocabulary.
fn unreachable_rows(
    tokens: &[u32],
    loss_mask: &[u8],
    anchors: &[usize],
    block: usize,
    frozen: &FrozenTarget,
) -> Vec<usize> {
    let mut out = vec![0usize; block - 1];
    if frozen.target_to_draft.is_none() {
        return out;
    }
    for &p in anchors {
        for k in 1..block {
            let pos = p + k;
            if pos < tokens.len() && loss_mask.get(pos) == Some(&1) && frozen.draft_id(tokens[pos]).is_none() {
                out[k - 1] += 1;
            }
        }
    }
    out
}

/// The loss terms of one sequence.
pub struct SequenceLoss {
    /// `Σ w·CE` over the sequence's scored rows (a scalar with a gradient): the objective.
    pub weighted_ce: Tensor,
    /// `Σ w·CE` against the labels (hard), for reporting: equal to `weighted_ce` unless
    /// distilling.
    pub weighted_hard_ce: f64,
    pub weight_sum: f64,
    /// Per block offset k (index k−1): rows scored for accuracy (including those whose label
    /// is outside the drafter's vocabulary: always misses), and rows whose argmax is the label.
    pub scored: Vec<usize>,
    pub hits: Vec<usize>,
    /// Per anchor: how many of its drafts would be accepted greedily (leading hits).
    pub accepted: Vec<usize>,
}

/// The objective's settings.
#[derive(Debug, Clone, Copy)]
pub struct ObjectiveSettings {
    pub block: usize,
    pub weights: PositionWeights,
    /// Soft targets: the target's distribution instead of its greedy token (see the module doc).
    pub distill: bool,
}

impl ObjectiveSettings {
    /// The paper's objective: hard labels, offsets weighed `exp(−(k−1)/γ)`.
    pub fn hard(block: usize, gamma: f64) -> Self {
        Self { block, weights: PositionWeights::Decay { gamma }, distill: false }
    }
}

/// `Σ w·CE` and the accuracy counts of one sequence; see the module doc.
pub fn sequence_loss(
    drafter: &DflashDrafter,
    frozen: &FrozenTarget,
    input: &SequenceInput,
    settings: ObjectiveSettings,
) -> Result<SequenceLoss> {
    let block = settings.block;
    let (tokens, anchors) = (input.tokens, input.anchors);
    if anchors.is_empty() {
        bail!("a training sequence needs at least one anchor");
    }
    if let Some(&bad) = anchors.iter().find(|&&p| p >= tokens.len()) {
        bail!("anchor {bad} is outside a sequence of {} tokens", tokens.len());
    }
    let device = drafter.device();
    let c = &drafter.config;
    let rows = scored_rows(tokens, input.loss_mask, anchors, block, settings.weights, frozen);
    let n = anchors.len() * block;

    // Context: every position before the last anchor (earlier anchors see a prefix of it).
    let ctx_len = *anchors.iter().max().expect("non-empty");
    if input.features.dim(0)? < ctx_len {
        bail!("features for {} rows, the last anchor needs {ctx_len}", input.features.dim(0)?);
    }
    let taps = c.target_layer_ids.len();
    let target_hidden = frozen.lm_head.dim(1)?;
    let want = (taps + settings.distill as usize) * target_hidden;
    if input.features.dim(1)? != want {
        bail!("features of width {}, the objective needs {want}", input.features.dim(1)?);
    }
    if settings.distill && input.features.dim(0)? + 1 < tokens.len() {
        bail!("distilling needs features for {} rows, got {}", tokens.len() - 1, input.features.dim(0)?);
    }
    let ctx_positions: Vec<usize> = (0..ctx_len).collect();
    let context = if ctx_len > 0 {
        let tapped = input.features.narrow(0, 0, ctx_len)?.narrow(1, 0, taps * target_hidden)?.contiguous()?;
        let features = drafter.fuse_features(&tapped)?;
        drafter.context_kv(&features, &ctx_positions)?
    } else {
        let empty = Tensor::zeros((c.n_kv_heads, 0, c.head_dim), DType::F32, device)?;
        vec![crate::speculative::dflash::LayerKv { k: empty.clone(), v: empty }; c.n_layers]
    };

    let mut ids = vec![c.mask_token_id; n];
    let mut positions = Vec::with_capacity(n);
    for (a, &p) in anchors.iter().enumerate() {
        ids[a * block] = tokens[p];
        positions.extend(p..p + block);
    }
    let mut embeddings = frozen.head.embed(&ids)?;
    if c.input_embedding_scale != 1.0 {
        embeddings = (embeddings * c.input_embedding_scale)?;
    }
    // Each block sees the context strictly before its anchor; its own rows are the packing's.
    let mut mask = vec![f32::NEG_INFINITY; n * ctx_len];
    for (a, &p) in anchors.iter().enumerate() {
        for r in a * block..(a + 1) * block {
            mask[r * ctx_len..r * ctx_len + p].fill(0.0);
        }
    }
    let mask = Tensor::from_vec(mask, (n, ctx_len), device)?;
    let packing = Packing { blocks: anchors.len(), context_mask: Some(&mask) };
    let hidden = drafter.forward_block(&embeddings, &positions, &context, &ctx_positions, packing)?;

    // Rows whose label the drafter cannot produce (outside its vocabulary) are not in the
    // loss but are misses: they count in the accuracy denominators.
    let mut scored = unreachable_rows(tokens, input.loss_mask, anchors, block, frozen);
    let mut hits = vec![0usize; block - 1];
    let mut accepted = vec![0usize; anchors.len()];
    if rows.is_empty() {
        let zero = (hidden.sum_all()? * 0.0)?;
        return Ok(SequenceLoss { weighted_ce: zero, weighted_hard_ce: 0.0, weight_sum: 0.0, scored, hits, accepted });
    }
    let index = Tensor::new(rows.iter().map(|r| r.row as u32).collect::<Vec<_>>(), device)?;
    let selected = hidden.index_select(&index, 0)?;
    let logits = drafter.finish_logits(matmul_frozen_weight(&selected, &frozen.lm_head)?)?;
    let labels = Tensor::new(rows.iter().map(|r| r.label).collect::<Vec<_>>(), device)?.unsqueeze(1)?;
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let lse = (logits.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()? + &max)?;
    let hard_ce = (&lse - logits.gather(&labels, D::Minus1)?)?.squeeze(1)?;
    let weights = Tensor::new(rows.iter().map(|r| r.weight).collect::<Vec<_>>(), device)?;
    let weighted_hard = (&hard_ce * &weights)?.sum_all()?;
    let weighted_hard_ce = weighted_hard.to_scalar::<f32>()? as f64;
    let weighted_ce = if settings.distill {
        // The target's logits for the label at `p+k` come from its last layer at `p+k−1`.
        let before = Tensor::new(
            rows.iter().map(|r| (anchors[r.row / block] + r.offset - 1) as u32).collect::<Vec<_>>(),
            device,
        )?;
        // Features are `TargetHead::hidden_state`s: the last layer's is already through the final norm.
        let last = input.features.index_select(&before, 0)?.narrow(1, taps * target_hidden, target_hidden)?;
        let last = last.to_dtype(DType::F32)?.contiguous()?;
        let target_logits = drafter.finish_logits(matmul_frozen_weight(&last, &frozen.lm_head)?)?.detach();
        let target_probs = candle_nn::ops::softmax(&target_logits, D::Minus1)?;
        let log_probs = logits.broadcast_sub(&lse)?;
        let soft_ce = (target_probs * log_probs)?.sum(D::Minus1)?.neg()?;
        (soft_ce * &weights)?.sum_all()?
    } else {
        weighted_hard
    };

    let argmax: Vec<u32> = logits.detach().argmax(D::Minus1)?.to_vec1()?;
    // Leading hits per anchor: rows come in (anchor, offset) order, so a block's run of hits
    // is unbroken until its first miss or missing row.
    let mut next_offset = vec![1usize; anchors.len()];
    for (r, &pred) in rows.iter().zip(&argmax) {
        let hit = pred == r.label;
        scored[r.offset - 1] += 1;
        hits[r.offset - 1] += hit as usize;
        let a = r.row / block;
        if next_offset[a] == r.offset && hit {
            accepted[a] += 1;
            next_offset[a] += 1;
        } else {
            next_offset[a] = usize::MAX;
        }
    }
    let weight_sum = rows.iter().map(|r| r.weight as f64).sum();
    Ok(SequenceLoss { weighted_ce, weighted_hard_ce, weight_sum, scored, hits, accepted })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::metrics::SpecMetrics;

    #[test]
    fn serving_weights_are_how_often_the_verifier_reached_each_position() {
        // Chains of 3 tokens on half the steps and 1 on the other half; every position is
        // accepted with probability 1/2 (deterministically: accepted counts 0..=k cycle).
        let mut m = SpecMetrics::default();
        for step in 0..4000u32 {
            let k = if step % 2 == 0 { 3 } else { 1 };
            let accepted = (step / 2 % 8).trailing_ones().min(k) as usize; // 0: 1/2, 1: 1/4, 2: 1/8, …
            m.record(k as usize, accepted, accepted + 1);
        }
        let w = serving_position_weights(&m.drafted_at, &m.accepted_at);
        // Position 1 is verified on every drafting step; 2 on the 3-token drafts whose first
        // was accepted (1/2 × 1/2 of all); 3 when the first two were (1/2 × 1/4).
        assert_eq!(w.len(), 3);
        let expected = [1.0, 0.25, 0.125];
        for (got, want) in w.iter().zip(expected) {
            assert!((got - want).abs() < 0.01, "{w:?}");
        }
        assert!(serving_position_weights(&[], &[]).is_empty());
        assert!(serving_position_weights(&[0, 0], &[0, 0]).is_empty());
    }

    #[test]
    fn a_weight_table_weighs_offsets_past_it_zero_and_refuses_nonsense() {
        let t = PositionWeights::table(&[1.0, 0.5]).unwrap();
        assert_eq!((t.of(1), t.of(2), t.of(3), t.of(0)), (1.0, 0.5, 0.0, 0.0));
        let decay = PositionWeights::Decay { gamma: 2.0 };
        assert_eq!(decay.of(3), offset_weight(3, 2.0));
        for bad in [&[][..], &[0.0, 0.0], &[1.0, -0.1], &[f64::NAN], &[1.0; MAX_WEIGHTED_OFFSETS + 1]] {
            assert!(PositionWeights::table(bad).is_err(), "{bad:?}");
        }
    }
}
