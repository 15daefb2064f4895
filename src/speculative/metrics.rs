//! Speculation counters, per request and in aggregate.

use super::verify::{Draft, Verdict};
use serde::Serialize;

/// Per depth the verifier walked down a draft: how many siblings were tried there (in rank
/// order, up to the accepted one) and the rank accepted, if any.
pub fn rank_outcomes(draft: &Draft, verdict: &Verdict) -> Vec<(usize, Option<usize>)> {
    let children = draft.children();
    let mut out = Vec::new();
    for (depth, &row) in verdict.rows().iter().enumerate() {
        let kids = &children[row];
        if kids.is_empty() {
            break;
        }
        let taken = verdict.path.get(depth).and_then(|n| kids.iter().position(|k| k == n));
        out.push((taken.map_or(kids.len(), |r| r + 1), taken));
    }
    out
}

/// Acceptance length τ of `steps` verify steps that accepted `accepted` draft tokens in all:
/// each step commits its accepted drafts plus one target token (0 before any step).
pub fn tau(accepted: u64, steps: u64) -> f64 {
    if steps == 0 {
        0.0
    } else {
        (accepted + steps) as f64 / steps as f64
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SpecMetrics {
    /// Target forward steps after prefill (each verifies one block, possibly empty).
    pub steps: u64,
    /// Steps that carried a non-empty draft.
    pub spec_steps: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Tokens committed by decode steps (accepted drafts + one target token each).
    pub committed: u64,
    /// `drafted_at[i]` / `accepted_at[i]`: drafts that reached position i, and were accepted there.
    pub drafted_at: Vec<u64>,
    pub accepted_at: Vec<u64>,
    /// Drafting time (proposing), not counting catching up.
    pub draft_secs: f64,
    pub verify_secs: f64,
    /// Committed tokens a drafter had to process before drafting again after idle steps
    /// (a draft model's catch-up), and the time it took.
    pub catch_up_tokens: u64,
    pub catch_up_secs: f64,
    /// `tried_at_rank[r]` / `accepted_at_rank[r]`: at each depth the verifier walked, the
    /// sibling of rank r (0: the drafter's best) was tried (every better-ranked sibling had
    /// been rejected), and accepted. A chain only ever has rank 0.
    pub tried_at_rank: Vec<u64>,
    pub accepted_at_rank: Vec<u64>,
    /// `steps_by_nodes[j]`: steps that verified exactly j draft nodes (j + 1 rows).
    pub steps_by_nodes: Vec<u64>,
    /// Steps whose forward also served other sequences (their `verify_secs` is a row share of
    /// a batched forward, not this sequence's own step time).
    pub shared_steps: u64,
}

impl SpecMetrics {
    /// A chain step: `drafted` tokens, the first `accepted` of them accepted.
    pub fn record(&mut self, drafted: usize, accepted: usize, committed: usize) {
        let ranks: Vec<(usize, Option<usize>)> =
            (0..(accepted + 1).min(drafted)).map(|i| (1, (i < accepted).then_some(0))).collect();
        self.record_walk(drafted, drafted, accepted, committed, &ranks);
    }

    /// A verified draft, chain or tree; `ranks` is its [`rank_outcomes`].
    pub fn record_draft(&mut self, draft: &Draft, accepted: usize, committed: usize, ranks: &[(usize, Option<usize>)]) {
        self.record_walk(draft.len(), draft.depth(), accepted, committed, ranks);
    }

    /// `ranks`: per depth walked, (siblings tried, rank accepted).
    fn record_walk(
        &mut self,
        nodes: usize,
        depth: usize,
        accepted: usize,
        committed: usize,
        ranks: &[(usize, Option<usize>)],
    ) {
        self.steps += 1;
        self.committed += committed as u64;
        if nodes > 0 {
            self.spec_steps += 1;
        }
        self.drafted += nodes as u64;
        self.accepted += accepted as u64;
        if self.steps_by_nodes.len() <= nodes {
            self.steps_by_nodes.resize(nodes + 1, 0);
        }
        self.steps_by_nodes[nodes] += 1;
        if self.drafted_at.len() < depth {
            self.drafted_at.resize(depth, 0);
            self.accepted_at.resize(depth, 0);
        }
        for i in 0..depth {
            self.drafted_at[i] += 1;
            if i < accepted {
                self.accepted_at[i] += 1;
            }
        }
        for &(tried, taken) in ranks {
            if self.tried_at_rank.len() < tried {
                self.tried_at_rank.resize(tried, 0);
                self.accepted_at_rank.resize(tried, 0);
            }
            self.tried_at_rank[..tried].iter_mut().for_each(|t| *t += 1);
            if let Some(r) = taken {
                self.accepted_at_rank[r] += 1;
            }
        }
    }

    /// Per sibling rank r: the share of tries at rank r that were accepted.
    pub fn per_rank_acceptance(&self) -> Vec<f64> {
        self.tried_at_rank
            .iter()
            .zip(&self.accepted_at_rank)
            .map(|(&t, &a)| if t == 0 { 0.0 } else { a as f64 / t as f64 })
            .collect()
    }

    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Acceptance length τ: mean tokens committed per target verify step (accepted + 1).
    pub fn tau(&self) -> f64 {
        tau(self.accepted, self.steps)
    }

    /// Per draft position i: the share of drafts that reached position i whose token there
    /// was accepted (`accepted_at[i] / drafted_at[i]`).
    pub fn per_position_acceptance(&self) -> Vec<f64> {
        self.drafted_at
            .iter()
            .zip(&self.accepted_at)
            .map(|(&d, &a)| if d == 0 { 0.0 } else { a as f64 / d as f64 })
            .collect()
    }

    pub fn merge(&mut self, other: &SpecMetrics) {
        self.steps += other.steps;
        self.spec_steps += other.spec_steps;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.committed += other.committed;
        if self.drafted_at.len() < other.drafted_at.len() {
            self.drafted_at.resize(other.drafted_at.len(), 0);
            self.accepted_at.resize(other.drafted_at.len(), 0);
        }
        for (i, (&d, &a)) in other.drafted_at.iter().zip(&other.accepted_at).enumerate() {
            self.drafted_at[i] += d;
            self.accepted_at[i] += a;
        }
        if self.steps_by_nodes.len() < other.steps_by_nodes.len() {
            self.steps_by_nodes.resize(other.steps_by_nodes.len(), 0);
        }
        for (i, &n) in other.steps_by_nodes.iter().enumerate() {
            self.steps_by_nodes[i] += n;
        }
        if self.tried_at_rank.len() < other.tried_at_rank.len() {
            self.tried_at_rank.resize(other.tried_at_rank.len(), 0);
            self.accepted_at_rank.resize(other.tried_at_rank.len(), 0);
        }
        for (i, (&t, &a)) in other.tried_at_rank.iter().zip(&other.accepted_at_rank).enumerate() {
            self.tried_at_rank[i] += t;
            self.accepted_at_rank[i] += a;
        }
        self.draft_secs += other.draft_secs;
        self.verify_secs += other.verify_secs;
        self.catch_up_tokens += other.catch_up_tokens;
        self.catch_up_secs += other.catch_up_secs;
        self.shared_steps += other.shared_steps;
    }
}
