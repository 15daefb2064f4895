//! The draft planner: how many draft nodes (tokens of a chain, nodes of a tree) each decoding
//! sequence verifies per step. Every decision here weighs the same thing with one formula
//! ([`StepTotals`]) and one threshold ([`MIN_GAIN`]): what a node is expected to commit
//! ([`node_gains`], from acceptance measured per depth and sibling rank) against what its row
//! costs on the measured verify-cost curve, times how much dearer verifying has been in this
//! decode than the curve says, plus the drafter's own time.
//!
//! - One request ([`planned_len`]): the k maximising `(1 + Σ gains[..k]) /
//!   (x·cost(k+1) + d(k))`, when that beats plain decoding by [`MIN_GAIN`]. The statistics
//!   behind α, the gains, d and x are `super::policy`'s.
//! - A batch ([`allocate_drafts`]): drafts go one at a time to the sequence whose longer draft
//!   raises the step's expected tokens per second most, while that rise is at least
//!   [`MIN_GAIN`]. A batch of one gets the request's own choice.
//!
//! Batches: a step's time grows with its rows. On a CPU the curve is flat for a few rows (one
//! weight read serves them all) and then linear (compute-bound). So when the batch is large
//! enough for the step to be compute-bound, speculation switches itself off, and throughput
//! never falls below plain continuous batching (up to the accuracy of the cost model and of
//! the acceptance estimates).

use super::proposer::DraftCostShape;
use super::step_cost::StepCost;

/// A drafter's time for a draft: `r` per token or per draft, in target decode steps (or in
/// seconds, where a field says so).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DraftCost {
    pub shape: DraftCostShape,
    pub r: f64,
}

impl DraftCost {
    #[cfg(test)]
    pub fn per_token(r: f64) -> Self {
        Self { shape: DraftCostShape::PerToken, r }
    }

    /// Decode steps spent drafting k tokens.
    pub fn of(&self, k: usize) -> f64 {
        match (k, self.shape) {
            (0, _) => 0.0,
            (_, DraftCostShape::PerToken) => self.r * k as f64,
            (_, DraftCostShape::PerDraft) => self.r,
        }
    }

    /// Observed units of `r` in a stretch that drafted `drafted` tokens over `drafts` drafts.
    pub fn units(shape: DraftCostShape, drafted: f64, drafts: f64) -> f64 {
        match shape {
            DraftCostShape::PerToken => drafted,
            DraftCostShape::PerDraft => drafts,
        }
    }
}

/// Sibling ranks a draft tree's planner keeps acceptance for: the best (α) and three more.
pub const TREE_RANKS: usize = 4;

/// Acceptance of the sibling of rank 1, 2, 3 at a depth, given every better-ranked one there
/// was rejected (rank 0's is α).
pub type RankRates = [f64; TREE_RANKS - 1];

/// What the node a draft of `i + 1` nodes adds over one of `i` is expected to commit: the
/// probability that the verifier accepts it, for the first `n` nodes. Every draft-size
/// decision weighs these against the verify-cost curve.
///
/// A chain: node i (0-based) is accepted when all before it were, `α^(i+1)` (the geometric
/// model of Leviathan et al.). A tree (`ranks`): at each depth the verifier accepts the rank-r
/// sibling with probability `Π_{r'<r}(1 − β_r')·β_r` (β_0 = α, β_r = `ranks[r − 1]`), so a
/// node's probability is the product along its path of ranks, and the nodes come best first
/// (a sibling only after the better-ranked one, a child only after its parent), which is how
/// a tree drafter spends a node budget.
pub fn node_gains(alpha: f64, ranks: Option<&RankRates>, n: usize) -> Vec<f64> {
    let a = alpha.clamp(0.0, 1.0);
    match ranks {
        None => (1..=n).map(|i| a.powi(i as i32)).collect(),
        Some(ranks) => best_first_nodes(a, ranks, n).into_iter().map(|(gain, _)| gain).collect(),
    }
}

/// Whether the `n` best nodes of [`node_gains`]' tree include a sibling that is not the
/// drafter's first choice: if not, the best draft of that size is a chain, and a drafter
/// asked for a tree would spend rows on runner-ups the measured acceptance does not buy.
pub fn tree_pays(alpha: f64, ranks: &RankRates, n: usize) -> bool {
    best_first_nodes(alpha.clamp(0.0, 1.0), ranks, n).iter().any(|&(_, rank)| rank > 0)
}

/// The tree's nodes best first: (probability of being accepted, sibling rank).
fn best_first_nodes(alpha: f64, ranks: &RankRates, n: usize) -> Vec<(f64, usize)> {
    // Per depth: the probability that the rank-r sibling is the one accepted.
    let mut at_rank = Vec::with_capacity(TREE_RANKS);
    let mut reached = 1.0;
    for beta in std::iter::once(alpha).chain(ranks.iter().map(|b| b.clamp(0.0, 1.0))) {
        at_rank.push(reached * beta);
        reached *= 1.0 - beta;
    }
    // Best first over (node probability, its parent's probability, its rank).
    #[derive(PartialEq)]
    struct Next(f64, f64, usize);
    impl Eq for Next {}
    impl PartialOrd for Next {
        fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(other))
        }
    }
    impl Ord for Next {
        fn cmp(&self, other: &Self) -> std::cmp::Ordering {
            self.0.total_cmp(&other.0)
        }
    }
    let mut heap = std::collections::BinaryHeap::from([Next(at_rank[0], 1.0, 0)]);
    let mut nodes = Vec::with_capacity(n);
    while nodes.len() < n {
        let Some(Next(p, parent, rank)) = heap.pop() else { break };
        nodes.push((p, rank));
        if let Some(&g) = at_rank.get(rank + 1) {
            heap.push(Next(parent * g, parent, rank + 1));
        }
        heap.push(Next(p * at_rank[0], p, 0));
    }
    nodes
}

/// Expected speed of a draft of k nodes whose [`node_gains`] are `gains`, relative to plain
/// decoding: `(1 + Σ gains[..k]) / (x·cost(k+1) + d(k))`.
pub fn speedup_of_gains(cost: &StepCost, gains: &[f64], draft: DraftCost, verify_excess: f64, k: usize) -> f64 {
    if k == 0 {
        return 1.0;
    }
    let expected = 1.0 + gains[..k.min(gains.len())].iter().sum::<f64>();
    expected / (cost.relative(k + 1) * verify_excess + draft.of(k)).max(1e-9)
}

/// The k in 0..=max with the best expected speed (shortest on ties), and that speed (k = 0
/// scores 1).
pub fn best_len(cost: &StepCost, max: usize, alpha: f64, draft: DraftCost, verify_excess: f64) -> (usize, f64) {
    best_len_of_gains(cost, &node_gains(alpha, None, max), draft, verify_excess)
}

/// [`best_len`] for nodes with these gains (up to `gains.len()` nodes).
pub fn best_len_of_gains(cost: &StepCost, gains: &[f64], draft: DraftCost, verify_excess: f64) -> (usize, f64) {
    let mut best = (0, 1.0);
    for k in 1..=gains.len() {
        let s = speedup_of_gains(cost, gains, draft, verify_excess, k);
        if s > best.1 * (1.0 + 1e-9) {
            best = (k, s);
        }
    }
    best
}

/// Smallest predicted rise in expected committed tokens per second that a draft must bring,
/// for a request alone and for each grant in a batch alike. Every input of the prediction is
/// an estimate from a few recent steps and the cost model leaves out per-row work outside the
/// forward (sampling and verifying each row), while a wrong guess costs a whole verify block:
/// drafts predicted to gain less than this were measured to lose (DFlash on SmolLM2 at a
/// predicted 1.00–1.02×: 0.97× plain; 4 clients on SmolLM2 at +1.5%: −12% served).
pub const MIN_GAIN: f64 = 0.05;

/// Whether going from `before` to `after` expected tokens per second is worth a draft.
pub fn pays(before: f64, after: f64) -> bool {
    after >= before * (1.0 + MIN_GAIN)
}

/// The draft size a request alone would verify: [`best_len_of_gains`]' k when it [`pays`],
/// else 0. [`allocate_drafts`] gives a lone sequence the same.
pub fn planned_len(cost: &StepCost, gains: &[f64], draft: DraftCost, verify_excess: f64) -> usize {
    match best_len_of_gains(cost, gains, draft, verify_excess) {
        (k, s) if pays(1.0, s) => k,
        _ => 0,
    }
}

/// What a decoding sequence asks for this step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftBid {
    /// Estimated acceptance of one draft position given the earlier ones were accepted.
    pub alpha: f64,
    /// A tree drafter's acceptance of lower-ranked siblings: its nodes are priced by the
    /// tree's [`node_gains`]. None: a chain.
    pub tree: Option<RankRates>,
    /// The most draft tokens it can use (its own policy's choice, bounded by max_tokens and
    /// the context); 0 = no speculation this step.
    pub max_len: usize,
    /// The drafter's time in seconds (per token or per draft, as its shape says): in a batch a
    /// request's own decode step is a share of a shared forward, so drafts are priced in
    /// absolute time against the curve's.
    pub draft_secs: DraftCost,
    /// How much dearer a verify block is in this request's decode than the curve says.
    pub verify_excess: f64,
    /// A fixed draft length (`--draft-len N`), or an adaptive policy's probe: granted as far as
    /// rows and blocks allow, without weighing its cost. A probe must not be weighed: it is how
    /// a request learns that acceptance has changed, and weighing it by the acceptance it is
    /// there to re-measure would keep a drafter off for good once the fleet had seen it fail.
    pub exact: bool,
}

impl Default for DraftBid {
    fn default() -> Self {
        Self { alpha: 0.0, tree: None, max_len: 0, draft_secs: DraftCost::default(), verify_excess: 1.0, exact: false }
    }
}

/// A step's totals for some draft lengths, from which [`StepTotals::rate`] gives its expected
/// committed tokens per second: the one formula every draft decision weighs. Each sequence
/// commits its decode token plus what its draft nodes are expected to; the step costs the
/// curve's time for all its rows, times the drafting sequences' verify excess (mean over their
/// draft rows), plus the drafters' time. For a lone sequence, relative to plain decoding, this
/// is [`speedup_of_gains`]. Kept as running sums so that weighing a longer draft of one
/// sequence costs the same whatever the batch's size.
#[derive(Debug, Clone, Copy)]
struct StepTotals {
    tokens: f64,
    drafting: f64,
    draft_rows: f64,
    excess_rows: f64,
    rows: usize,
}

impl StepTotals {
    /// Every sequence's decode row, with no drafts.
    fn decode_rows(n: usize) -> Self {
        Self { tokens: n as f64, drafting: 0.0, draft_rows: 0.0, excess_rows: 0.0, rows: n }
    }

    /// The totals once bid `b`'s draft grows from `from` to `to` nodes (`expected`: prefix sums
    /// of its node gains).
    fn grown(&self, b: &DraftBid, expected: &[f64], from: usize, to: usize) -> Self {
        let at = |k: usize| expected.get(k).copied().unwrap_or(expected.last().copied().unwrap_or(0.0));
        let added = (to - from) as f64;
        Self {
            tokens: self.tokens + at(to) - at(from),
            drafting: self.drafting + b.draft_secs.of(to) - b.draft_secs.of(from),
            draft_rows: self.draft_rows + added,
            excess_rows: self.excess_rows + added * b.verify_excess,
            rows: self.rows + to - from,
        }
    }

    fn rate(&self, cost: &StepCost) -> f64 {
        let excess = if self.draft_rows > 0.0 { self.excess_rows / self.draft_rows } else { 1.0 };
        self.tokens / (excess * cost.secs(self.rows) + self.drafting).max(1e-12)
    }
}

/// Draft lengths for one step: `bids[i]` belongs to the i-th decoding sequence (each already
/// has its one decode row). `can_grow(i, k)` says whether sequence i may have k draft tokens
/// (row budget, KV blocks); it is asked in order of growth and may keep its own accounting.
/// Exact bids are served first; the others only with a cost model to weigh them.
///
/// Drafts are granted one at a time: of every sequence's possible longer drafts, the one that
/// gives the step the highest expected rate ([`StepTotals`]), as long as it [`pays`] against the step without
/// it. A draft's whole length is weighed at once, so a one-pass drafter's time is not charged
/// to its first node alone, and a lone sequence gets exactly [`planned_len`].
pub fn allocate_drafts(
    cost: Option<&StepCost>,
    bids: &[DraftBid],
    can_grow: &mut dyn FnMut(usize, usize) -> bool,
) -> Vec<usize> {
    let mut lens = vec![0usize; bids.len()];
    for (i, b) in bids.iter().enumerate().filter(|(_, b)| b.exact) {
        while lens[i] < b.max_len && can_grow(i, lens[i] + 1) {
            lens[i] += 1;
        }
    }
    let Some(cost) = cost else { return lens };
    let mut open: Vec<bool> = bids.iter().map(|b| !b.exact && b.max_len > 0 && b.alpha > 0.0).collect();
    // What each bid's first k nodes are expected to commit, k = 0..=max_len (an exact bid's
    // at its α).
    let expected: Vec<Vec<f64>> = bids
        .iter()
        .zip(&open)
        .map(|(b, &open)| {
            if open || (b.exact && b.alpha > 0.0) {
                let gains = node_gains(b.alpha, b.tree.as_ref(), b.max_len);
                std::iter::once(0.0)
                    .chain(gains.iter().scan(0.0, |sum, g| {
                        *sum += g;
                        Some(*sum)
                    }))
                    .collect()
            } else {
                vec![0.0]
            }
        })
        .collect();
    let mut totals = StepTotals::decode_rows(bids.len());
    for (i, b) in bids.iter().enumerate() {
        totals = totals.grown(b, &expected[i], 0, lens[i]);
    }
    loop {
        let now = totals.rate(cost);
        let mut best: Option<(usize, usize, f64)> = None;
        for i in (0..bids.len()).filter(|&i| open[i]) {
            for k in lens[i] + 1..expected[i].len() {
                let rate = totals.grown(&bids[i], &expected[i], lens[i], k).rate(cost);
                if best.is_none_or(|(_, _, r)| rate > r * (1.0 + 1e-9)) {
                    best = Some((i, k, rate));
                }
            }
        }
        let Some((i, k, rate)) = best else { break };
        if !pays(now, rate) {
            // No longer draft of any sequence is worth its rows: done.
            break;
        }
        let from = lens[i];
        while lens[i] < k {
            if !can_grow(i, lens[i] + 1) {
                open[i] = false;
                break;
            }
            lens[i] += 1;
        }
        totals = totals.grown(&bids[i], &expected[i], from, lens[i]);
        if lens[i] + 1 >= expected[i].len() {
            open[i] = false;
        }
    }
    lens
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::{DraftCostShape, StepCost};

    #[test]
    fn node_gains_of_chains_and_trees() {
        let chain = node_gains(0.5, None, 3);
        assert_eq!(chain, vec![0.5, 0.25, 0.125]);
        // Rank r is accepted at a depth with probability 0.5, 0.5·0.4, 0.5·0.6·0.3, …: the
        // second node is the first choice's child (0.25), the third the runner-up (0.2).
        let tree = node_gains(0.5, Some(&[0.4, 0.3, 0.2]), 8);
        assert_eq!(tree.len(), 8);
        assert!((tree[1] - 0.25).abs() < 1e-12 && (tree[2] - 0.2).abs() < 1e-12, "{tree:?}");
        // Here the runner-up is worth a row from the third node on; with a drafter right
        // nine times in ten it is not, for the sizes a CPU verifies.
        assert!(!tree_pays(0.5, &[0.4, 0.3, 0.2], 2) && tree_pays(0.5, &[0.4, 0.3, 0.2], 3));
        assert!(!tree_pays(0.9, &[0.3, 0.2, 0.1], 12));
        // A tree of k nodes never expects less than a chain of k.
        let chain = node_gains(0.5, None, 8);
        for k in 1..=8 {
            assert!(tree[..k].iter().sum::<f64>() >= chain[..k].iter().sum::<f64>() - 1e-12);
        }
    }

    /// A CPU-like curve: flat up to 4 rows, then linear.
    fn cpu_curve() -> StepCost {
        StepCost::from_points(vec![(1, 10.0), (2, 10.5), (4, 11.0), (8, 20.0), (16, 38.0), (32, 74.0), (64, 146.0)])
    }

    fn bid(alpha: f64, max_len: usize) -> DraftBid {
        DraftBid { alpha, max_len, ..DraftBid::default() }
    }

    #[test]
    fn one_sequence_with_good_acceptance_drafts_into_the_flat_region() {
        let lens = allocate_drafts(Some(&cpu_curve()), &[bid(0.9, 8)], &mut |_, _| true);
        assert!(lens[0] >= 3, "{lens:?}");
    }

    #[test]
    fn a_compute_bound_batch_switches_speculation_off() {
        // 16 decoding sequences: the step is on the linear part, where a row costs as much as
        // the average row, so only a certain token would pay.
        let bids = vec![bid(0.8, 8); 16];
        let lens = allocate_drafts(Some(&cpu_curve()), &bids, &mut |_, _| true);
        assert!(lens.iter().all(|&k| k == 0), "{lens:?}");
    }

    #[test]
    fn better_acceptance_gets_the_rows_first() {
        let bids = [bid(0.3, 8), bid(0.95, 8)];
        let lens = allocate_drafts(Some(&cpu_curve()), &bids, &mut |_, _| true);
        assert!(lens[1] > lens[0], "{lens:?}");
    }

    #[test]
    fn respects_caps_budget_and_zero_bids() {
        let bids = [bid(0.99, 2), bid(0.0, 8), bid(0.99, 0)];
        let mut rows_left = 1;
        let lens = allocate_drafts(Some(&cpu_curve()), &bids, &mut |_, _| {
            if rows_left == 0 {
                return false;
            }
            rows_left -= 1;
            true
        });
        assert_eq!(lens, vec![1, 0, 0]);
        let lens = allocate_drafts(Some(&cpu_curve()), &bids, &mut |_, _| true);
        assert_eq!(lens, vec![2, 0, 0]);
    }

    #[test]
    fn an_expensive_drafter_drafts_less() {
        let free = allocate_drafts(Some(&cpu_curve()), &[bid(0.8, 8)], &mut |_, _| true)[0];
        let dear = allocate_drafts(
            Some(&cpu_curve()),
            &[DraftBid { draft_secs: DraftCost::per_token(4.0), ..bid(0.8, 8) }],
            &mut |_, _| true,
        )[0];
        assert!(dear < free, "{dear} vs {free}");
    }

    #[test]
    fn a_tree_drafter_with_poor_first_choices_gets_rows_a_chain_would_not() {
        // First choices right a third of the time, on a curve that is flat for one draft row
        // only: a chain's second node (0.12) is not worth its row, a tree's runner-up at the
        // first position (0.65 × 0.5) is.
        let curve = StepCost::from_points(vec![(1, 10.0), (2, 10.5), (3, 12.0), (4, 15.0), (8, 27.0), (16, 51.0)]);
        let chain = allocate_drafts(Some(&curve), &[bid(0.35, 8)], &mut |_, _| true)[0];
        let tree = DraftBid { tree: Some([0.5, 0.4, 0.3]), ..bid(0.35, 8) };
        let tree = allocate_drafts(Some(&curve), &[tree], &mut |_, _| true)[0];
        assert_eq!((chain, tree), (1, 2));
    }

    #[test]
    fn exact_bids_get_their_length_without_a_cost_model() {
        let exact = DraftBid { max_len: 5, exact: true, ..DraftBid::default() };
        assert_eq!(allocate_drafts(None, &[exact, bid(0.99, 8)], &mut |_, _| true), vec![5, 0]);
        let mut rows_left = 3;
        let lens = allocate_drafts(None, &[exact], &mut |_, _| {
            rows_left -= 1;
            rows_left >= 0
        });
        assert_eq!(lens, vec![3], "bounded by the rows left");
    }

    #[test]
    fn a_lone_sequence_gets_what_the_request_would_choose_alone() {
        // One formula and one threshold: the batch allocation of a single sequence is the
        // request's own choice, for chains and trees, per-token and one-pass drafters, on
        // flat and steep curves, with and without verify excess.
        let mut rng = crate::sample::SamplerRng::from_seed(5);
        let curves = [cpu_curve(), StepCost::from_points((1..=16).map(|m| (m, 1.0 + 0.35 * (m - 1) as f64)).collect())];
        for case in 0..2000 {
            let cost = &curves[case % 2];
            let alpha = rng.next_f64();
            let tree = (case % 3 == 0).then(|| [rng.next_f64() * 0.5, rng.next_f64() * 0.3, rng.next_f64() * 0.2]);
            let shape = if case % 4 < 2 { DraftCostShape::PerToken } else { DraftCostShape::PerDraft };
            let draft = DraftCost { shape, r: rng.next_f64() * 0.6 };
            let verify_excess = 0.8 + rng.next_f64();
            let max_len = 1 + case % 16;
            let gains = node_gains(alpha, tree.as_ref(), max_len);
            let alone = planned_len(cost, &gains, draft, verify_excess);
            let draft_secs = DraftCost { r: draft.r * cost.secs(1), ..draft };
            let b = DraftBid { alpha, tree, max_len, draft_secs, verify_excess, exact: false };
            let lens = allocate_drafts(Some(cost), &[b], &mut |_, _| true);
            assert_eq!(lens, vec![alone], "case {case}: {b:?}");
        }
    }

    #[test]
    fn a_one_pass_drafter_is_weighed_over_its_whole_draft() {
        // A pass that costs 0.8 of a step whatever its length, right 80% of the time: one node
        // does not pay for the pass ((1 + 0.8) / (1.05 + 0.8) < 1), four nodes do
        // ((1 + 2.36) / (1.33 + 0.8) = 1.58), and a fifth costs more than it brings.
        let b = DraftBid { draft_secs: DraftCost { shape: DraftCostShape::PerDraft, r: 8.0 }, ..bid(0.8, 8) };
        assert_eq!(allocate_drafts(Some(&cpu_curve()), &[b], &mut |_, _| true), vec![4]);
    }
}
