//! The EAGLE-3 training objective on one sequence: training-time test (docs/training.md,
//! "EAGLE-3").
//!
//! Row t pairs token `x[t+1]` with the fused target states at t (position t), exactly as when
//! drafting. Step 0 runs every row causally with target features. Step j ≥ 1 runs each row
//! again at position t + j on its own step j−1 output, with the teacher token `x[t+1+j]`; it
//! sees the step-0 rows up to t and its own earlier steps (the attention pattern of a chain
//! draft from row t). Step j of row t predicts `x[t+2+j]` and is scored by soft cross-entropy
//! against the target's distribution there, restricted to the draft vocabulary, when that token
//! is a response token in the draft vocabulary; step j weighs `0.8^j` and each step's loss is a
//! mean over its scored rows in the batch. All steps use the drafter's serving forward
//! ([`Eagle3Drafter::forward`]).

use crate::speculative::dflash::TargetHead;
use crate::speculative::eagle3::Eagle3Drafter;
use crate::speculative::nn::LayerKv;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor, D};

/// Per-step weight decay of the loss (SpecForge's and the EAGLE-3 paper's 0.8).
pub const STEP_DECAY: f64 = 0.8;

/// What the drafter is trained against and never changes.
pub struct FrozenTarget {
    pub head: TargetHead,
    /// `[draft vocab, target hidden]` f32: the target's LM-head rows of the draft vocabulary.
    pub lm_head: Tensor,
    /// Target id → draft id (`u32::MAX`: not in the draft vocabulary).
    pub target_to_draft: Vec<u32>,
}

impl FrozenTarget {
    pub fn draft_id(&self, target_id: u32) -> Option<u32> {
        self.target_to_draft.get(target_id as usize).copied().filter(|&d| d != u32::MAX)
    }
}

/// One training sequence and its target features `[≥ n − 1, 4 · target hidden]` (the last
/// token's are not read): the three
/// fused taps then the last layer, as `TargetHead::hidden_state`s (what `target_features` and
/// the feature cache hold: the last layer is already through the final norm).
pub struct SequenceInput<'a> {
    pub tokens: &'a [u32],
    pub loss_mask: &'a [u8],
    pub features: &'a Tensor,
}

/// `valid[j][t]`: whether step j of row t is scored (see the module doc).
pub fn scored(tokens: &[u32], loss_mask: &[u8], frozen: &FrozenTarget, steps: usize) -> Vec<Vec<bool>> {
    let n = tokens.len();
    let rows = n.saturating_sub(1);
    (0..steps)
        .map(|j| {
            (0..rows)
                .map(|t| {
                    let u = t + 2 + j;
                    u < n && loss_mask.get(u).copied().unwrap_or(0) != 0 && frozen.draft_id(tokens[u]).is_some()
                })
                .collect()
        })
        .collect()
}

/// The loss terms of one sequence.
pub struct SequenceLoss {
    /// `Σ_j 0.8^j / norm_j · Σ_rows CE` (a scalar with a gradient).
    pub weighted_ce: Tensor,
    /// Per step: scored rows, and rows whose argmax is the teacher token.
    pub scored: Vec<usize>,
    pub hits: Vec<usize>,
    /// Per row scored at step 0: leading steps whose argmax is right (a chain's acceptance).
    pub accepted: Vec<usize>,
    /// The row t of each entry of `accepted`.
    pub accepted_rows: Vec<usize>,
    /// `Σ_j Σ_rows CE` without weights, and the number of terms (for reporting).
    pub ce_sum: f64,
    pub ce_terms: usize,
}

/// The target's next-token distribution over the draft vocabulary (no gradient), `[rows, draft
/// vocab]`, from its last layer's features `[rows, target hidden]` (already through the final norm).
pub fn target_distribution(frozen: &FrozenTarget, last_layer: &Tensor) -> Result<Tensor> {
    let logits = last_layer.matmul(&frozen.lm_head.t()?)?.detach();
    Ok(candle_nn::ops::softmax(&logits, D::Minus1)?)
}

/// The training-time-test loss of one sequence; `norms[j]` is step j's number of scored rows
/// in the whole batch (each step's loss is a batch mean).
pub fn sequence_loss(
    drafter: &Eagle3Drafter,
    frozen: &FrozenTarget,
    input: &SequenceInput,
    norms: &[f64],
) -> Result<SequenceLoss> {
    let steps = norms.len();
    let (tokens, n) = (input.tokens, input.tokens.len());
    let device = drafter.device();
    let valid = scored(tokens, input.loss_mask, frozen, steps);
    let rows = n.saturating_sub(1);
    // Rows scored at some step; the others only provide step-0 keys.
    let r: Vec<usize> = (0..rows).filter(|&t| valid.iter().any(|v| v[t])).collect();
    let zero = Tensor::zeros((), candle_core::DType::F32, device)?;
    let empty = SequenceLoss {
        weighted_ce: zero.clone(),
        scored: vec![0; steps],
        hits: vec![0; steps],
        accepted: Vec::new(),
        accepted_rows: Vec::new(),
        ce_sum: 0.0,
        ce_terms: 0,
    };
    if r.is_empty() || steps == 0 {
        return Ok(empty);
    }
    let th = drafter.config.target_hidden;
    if input.features.dim(0)? < rows || input.features.dim(1)? != 4 * th {
        bail!("EAGLE-3 features {:?} for a sequence of {n} tokens (want [{rows}, {}])", input.features.dims(), 4 * th);
    }
    // The features are already `TargetHead::hidden_state`s (the last layer through the final norm).
    let tap = |i: usize| -> Result<Tensor> {
        Ok(input.features.narrow(1, i * th, th)?.narrow(0, 0, rows)?.to_dtype(DType::F32)?.contiguous()?)
    };
    let fused: Vec<Tensor> = (0..3).map(|i| Ok(tap(i)?.narrow(0, 0, rows)?)).collect::<Result<_>>()?;
    let target_probs = target_distribution(frozen, &tap(3)?)?;

    let r_ids = Tensor::new(r.iter().map(|&t| t as u32).collect::<Vec<_>>(), device)?;
    let embeds0 = drafter.embed(&tokens[1..rows + 1], Some(&frozen.head))?;
    let features0 = drafter.fuse(&Tensor::cat(&fused, 1)?)?;
    let positions0: Vec<usize> = (0..rows).collect();
    let (out0, kv0) = drafter.forward(&embeds0, &features0, &positions0, &drafter.empty_kv()?, None)?;
    let mut h = out0.index_select(&r_ids, 0)?;
    // Unrolled steps see the step-0 rows up to their own source row, and their own row of
    // every step.
    let context_mask = context_mask(&r, rows, device)?;
    let mut earlier: Vec<LayerKv> = Vec::with_capacity(steps);

    let mut weighted = zero;
    let (mut scored_n, mut hits) = (vec![0usize; steps], vec![0usize; steps]);
    // Per row and step: None when not scored, else whether the argmax is the teacher token.
    let mut outcome: Vec<Vec<Option<bool>>> = vec![vec![None; steps]; r.len()];
    let (mut ce_sum, mut ce_terms) = (0.0f64, 0usize);
    for j in 0..steps {
        if j > 0 {
            let ids: Vec<u32> = r.iter().map(|&t| tokens[(t + 1 + j).min(n - 1)]).collect();
            let embeds = drafter.embed(&ids, Some(&frozen.head))?;
            let positions: Vec<usize> = r.iter().map(|&t| t + j).collect();
            let (out, kv) = drafter.forward_unrolled(&embeds, &h, &positions, &kv0, &context_mask, &earlier)?;
            earlier.push(kv);
            h = out;
        }
        let logp = candle_nn::ops::log_softmax(&drafter.logits(&h)?, D::Minus1)?;
        // Scored rows read position t + 1 + j ≤ n − 2; the others (weight 0) are clamped.
        let at: Vec<u32> = r.iter().map(|&t| (t + 1 + j).min(rows - 1) as u32).collect();
        let p = target_probs.index_select(&Tensor::new(at, device)?, 0)?;
        let ce = (p * &logp)?.sum(D::Minus1)?.neg()?;
        let w: Vec<f32> = r
            .iter()
            .map(|&t| if valid[j][t] && norms[j] > 0.0 { (STEP_DECAY.powi(j as i32) / norms[j]) as f32 } else { 0.0 })
            .collect();
        weighted = (weighted + (&ce * Tensor::new(w, device)?)?.sum_all()?)?;
        let argmax = logp.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let ce_host = ce.to_vec1::<f32>()?;
        for (i, &t) in r.iter().enumerate() {
            if !valid[j][t] {
                continue;
            }
            scored_n[j] += 1;
            ce_sum += ce_host[i] as f64;
            ce_terms += 1;
            let right = frozen.draft_id(tokens[t + 2 + j]) == Some(argmax[i]);
            hits[j] += right as usize;
            outcome[i][j] = Some(right);
        }
    }
    let (mut accepted, mut accepted_rows) = (Vec::new(), Vec::new());
    for (o, &t) in outcome.iter().zip(&r) {
        if o[0].is_some() {
            accepted.push(o.iter().take_while(|x| **x == Some(true)).count());
            accepted_rows.push(t);
        }
    }
    Ok(SequenceLoss { weighted_ce: weighted, scored: scored_n, hits, accepted, accepted_rows, ce_sum, ce_terms })
}

/// Which step-0 rows the scored rows `r` see, `[r, rows]` additive: row t sees rows `..=t`.
fn context_mask(r: &[usize], rows: usize, device: &candle_core::Device) -> Result<Tensor> {
    let mut v = vec![f32::NEG_INFINITY; r.len() * rows];
    for (i, &t) in r.iter().enumerate() {
        v[i * rows..i * rows + t + 1].fill(0.0);
    }
    Ok(Tensor::from_vec(v, (r.len(), rows), device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unrolled_rows_see_the_step_zero_rows_up_to_their_own() {
        let m = context_mask(&[1, 3], 4, &candle_core::Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
        let seen = |row: &Vec<f32>| row.iter().map(|x| x.is_finite()).collect::<Vec<_>>();
        assert_eq!(seen(&m[0]), [true, true, false, false]);
        assert_eq!(seen(&m[1]), [true, true, true, true]);
    }
}
