//! How many draft tokens each decoding sequence gets in a batched step.
//!
//! A step's time grows with its rows. On a CPU the curve is flat for a few rows (one weight
//! read serves them all) and then linear (compute-bound). A draft token is worth its expected
//! acceptance (α^j for the j-th token of a draft, the geometric model of Leviathan et al.), and
//! costs the extra step time plus the drafter's own time. Draft tokens are handed out greedily,
//! best first, while they raise the step's expected tokens per second above what the same
//! step would give without them. So when the batch is large enough for the step to be
//! compute-bound, speculation switches itself off, and throughput never falls below plain
//! continuous batching (up to the accuracy of the cost model and of α).

use crate::model::Transformer;
use anyhow::Result;

/// Seconds of one forward over a number of rows that all want logits.
#[derive(Debug, Clone, PartialEq)]
pub struct StepCostModel {
    /// (rows, seconds), rows ascending from 1, seconds non-decreasing.
    points: Vec<(usize, f64)>,
}

/// What a decoding sequence asks for this step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DraftBid {
    /// Estimated acceptance of one draft position given the earlier ones were accepted.
    pub alpha: f64,
    /// The most draft tokens it can use (its own policy's choice, bounded by max_tokens and
    /// the context); 0 = no speculation this step.
    pub max_len: usize,
    /// Drafter time per drafted token.
    pub secs_per_token: f64,
}

impl StepCostModel {
    /// From measured (rows, seconds) points; sorted, made non-decreasing (a dip is noise) and
    /// per-row cost non-increasing (m rows never cost more than m single rows; a bump is noise
    /// from a busy machine).
    pub fn from_points(mut points: Vec<(usize, f64)>) -> Self {
        points.retain(|&(r, s)| r > 0 && s.is_finite() && s > 0.0);
        points.sort_by_key(|&(r, _)| r);
        points.dedup_by_key(|p| p.0);
        let mut max = 0.0f64;
        let mut per_row = f64::INFINITY;
        for p in points.iter_mut() {
            p.1 = p.1.min(per_row * p.0 as f64);
            per_row = per_row.min(p.1 / p.0 as f64);
            max = max.max(p.1);
            p.1 = max;
        }
        if points.is_empty() {
            points.push((1, 1.0));
        }
        Self { points }
    }

    /// Times forwards of 1, 2, 4, … `max_rows` rows (logits for every row) on top of a short
    /// context: three interleaved rounds after a warm-up (`speculative::policy::time_blocks`), best
    /// of each.
    pub fn measure(model: &Transformer, max_rows: usize) -> Result<Self> {
        const DEPTH: usize = 64;
        let max_rows = max_rows.max(1);
        let sizes: Vec<usize> =
            std::iter::successors(Some(1), |&rows| (rows < max_rows).then(|| (rows * 2).min(max_rows))).collect();
        let times = crate::speculative::policy::time_blocks(model, DEPTH, &sizes, 3)?;
        let points =
            sizes.iter().zip(&times).map(|(&m, t)| (m, t.iter().copied().fold(f64::INFINITY, f64::min))).collect();
        Ok(Self::from_points(points))
    }

    /// Estimated seconds for `rows` rows: linear between points, extended past the last with
    /// the last segment's slope.
    pub fn secs(&self, rows: usize) -> f64 {
        let p = &self.points;
        if rows == 0 {
            return 0.0;
        }
        let hi = p.iter().position(|&(r, _)| r >= rows);
        let (a, b) = match hi {
            Some(0) => return p[0].1 * rows as f64 / p[0].0 as f64,
            Some(i) => (p[i - 1], p[i]),
            None if p.len() == 1 => return p[0].1 * rows as f64 / p[0].0 as f64,
            None => (p[p.len() - 2], p[p.len() - 1]),
        };
        let slope = (b.1 - a.1) / (b.0 - a.0) as f64;
        (a.1 + slope * (rows as f64 - a.0 as f64)).max(a.1.min(b.1))
    }

    pub fn points(&self) -> &[(usize, f64)] {
        &self.points
    }

    /// `curve[m - 1]` = cost(m) / cost(1) for m in 1..=n: a single sequence's verify curve,
    /// as [`crate::speculative::policy::AdaptiveState`] wants it.
    pub fn relative_curve(&self, n: usize) -> Vec<f64> {
        let one = self.secs(1).max(1e-12);
        (1..=n).map(|m| self.secs(m) / one).collect()
    }
}

/// Smallest predicted rise in the step's tokens per second that a draft token must bring. The
/// cost model leaves out per-row work outside the forward (sampling and verifying each row)
/// and is measured on a noisy machine; a token predicted to gain less than this was measured
/// to lose (4 clients on SmolLM2: +1.5% predicted, −12% served).
const MIN_GAIN: f64 = 0.03;

/// Draft lengths for one step: `bids[i]` belongs to the i-th decoding sequence (each already
/// has its one decode row). `can_grow(i, k)` says whether sequence i may have k draft tokens
/// (row budget, KV blocks); it is asked in order of growth and may keep its own accounting.
pub fn allocate_drafts(
    cost: &StepCostModel,
    bids: &[DraftBid],
    can_grow: &mut dyn FnMut(usize, usize) -> bool,
) -> Vec<usize> {
    let mut lens = vec![0usize; bids.len()];
    let mut open: Vec<bool> = bids.iter().map(|b| b.max_len > 0 && b.alpha > 0.0).collect();
    let mut rows = bids.len();
    let mut tokens = bids.len() as f64;
    let mut extra_secs = 0.0;
    loop {
        // The open bid whose next draft token is most likely to be accepted.
        let mut best: Option<(usize, f64)> = None;
        for (i, b) in bids.iter().enumerate() {
            if !open[i] {
                continue;
            }
            let gain = b.alpha.clamp(0.0, 1.0).powi(lens[i] as i32 + 1);
            if best.is_none_or(|(_, g)| gain > g) {
                best = Some((i, gain));
            }
        }
        let Some((i, gain)) = best else { break };
        let now = tokens / (cost.secs(rows) + extra_secs).max(1e-12);
        let then = (tokens + gain) / (cost.secs(rows + 1) + extra_secs + bids[i].secs_per_token).max(1e-12);
        if then <= now * (1.0 + MIN_GAIN) {
            // Every other open bid gains less for the same cost: done.
            break;
        }
        if !can_grow(i, lens[i] + 1) {
            open[i] = false;
            continue;
        }
        lens[i] += 1;
        rows += 1;
        tokens += gain;
        extra_secs += bids[i].secs_per_token;
        if lens[i] >= bids[i].max_len {
            open[i] = false;
        }
    }
    lens
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CPU-like curve: flat up to 4 rows, then linear.
    fn cpu_curve() -> StepCostModel {
        StepCostModel::from_points(vec![
            (1, 10.0),
            (2, 10.5),
            (4, 11.0),
            (8, 20.0),
            (16, 38.0),
            (32, 74.0),
            (64, 146.0),
        ])
    }

    fn bid(alpha: f64, max_len: usize) -> DraftBid {
        DraftBid { alpha, max_len, secs_per_token: 0.0 }
    }

    #[test]
    fn interpolates_and_extrapolates() {
        let c = cpu_curve();
        assert_eq!(c.secs(1), 10.0);
        assert!((c.secs(3) - 10.75).abs() < 1e-9);
        assert!((c.secs(12) - 29.0).abs() < 1e-9);
        assert!((c.secs(128) - 290.0).abs() < 1e-9, "{}", c.secs(128));
        let rel = c.relative_curve(4);
        assert_eq!(rel, vec![1.0, 1.05, 1.075, 1.1]);
        // Dips are noise, and so is a block dearer than its rows one by one.
        let d = StepCostModel::from_points(vec![(1, 2.0), (2, 1.0), (4, 3.0)]);
        assert_eq!(d.secs(2), 2.0);
        let b = StepCostModel::from_points(vec![(1, 1.0), (2, 3.0), (4, 3.5)]);
        assert_eq!(b.points(), &[(1, 1.0), (2, 2.0), (4, 3.5)]);
    }

    #[test]
    fn one_sequence_with_good_acceptance_drafts_into_the_flat_region() {
        let lens = allocate_drafts(&cpu_curve(), &[bid(0.9, 8)], &mut |_, _| true);
        assert!(lens[0] >= 3, "{lens:?}");
    }

    #[test]
    fn a_compute_bound_batch_switches_speculation_off() {
        // 16 decoding sequences: the step is on the linear part, where a row costs as much as
        // the average row, so only a certain token would pay.
        let bids = vec![bid(0.8, 8); 16];
        let lens = allocate_drafts(&cpu_curve(), &bids, &mut |_, _| true);
        assert!(lens.iter().all(|&k| k == 0), "{lens:?}");
    }

    #[test]
    fn better_acceptance_gets_the_rows_first() {
        let bids = [bid(0.3, 8), bid(0.95, 8)];
        let lens = allocate_drafts(&cpu_curve(), &bids, &mut |_, _| true);
        assert!(lens[1] > lens[0], "{lens:?}");
    }

    #[test]
    fn respects_caps_budget_and_zero_bids() {
        let bids = [bid(0.99, 2), bid(0.0, 8), bid(0.99, 0)];
        let mut rows_left = 1;
        let lens = allocate_drafts(&cpu_curve(), &bids, &mut |_, _| {
            if rows_left == 0 {
                return false;
            }
            rows_left -= 1;
            true
        });
        assert_eq!(lens, vec![1, 0, 0]);
        let lens = allocate_drafts(&cpu_curve(), &bids, &mut |_, _| true);
        assert_eq!(lens, vec![2, 0, 0]);
    }

    #[test]
    fn an_expensive_drafter_drafts_less() {
        let free = allocate_drafts(&cpu_curve(), &[bid(0.8, 8)], &mut |_, _| true)[0];
        let dear =
            allocate_drafts(&cpu_curve(), &[DraftBid { alpha: 0.8, max_len: 8, secs_per_token: 4.0 }], &mut |_, _| {
                true
            })[0];
        assert!(dear < free, "{dear} vs {free}");
    }
}
