//! Speculation counters, per request and in aggregate.

use serde::Serialize;

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
    /// Steps whose forward also served other sequences (their `verify_secs` is a row share of
    /// a batched forward, not this sequence's own step time).
    pub shared_steps: u64,
}

impl SpecMetrics {
    pub fn record(&mut self, drafted: usize, accepted: usize, committed: usize) {
        self.steps += 1;
        self.committed += committed as u64;
        if drafted > 0 {
            self.spec_steps += 1;
        }
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        if self.drafted_at.len() < drafted {
            self.drafted_at.resize(drafted, 0);
            self.accepted_at.resize(drafted, 0);
        }
        for i in 0..drafted {
            self.drafted_at[i] += 1;
            if i < accepted {
                self.accepted_at[i] += 1;
            }
        }
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
        self.draft_secs += other.draft_secs;
        self.verify_secs += other.verify_secs;
        self.catch_up_tokens += other.catch_up_tokens;
        self.catch_up_secs += other.catch_up_secs;
        self.shared_steps += other.shared_steps;
    }
}
