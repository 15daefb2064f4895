//! What the engine has seen across all requests (acceptance, drafting and catch-up time, verify
//! excess): the priors for each new request's own estimates.

use crate::speculative::planner::{best_len, pays, DraftCost};
use crate::speculative::policy::alpha_estimate;
use crate::speculative::{DraftCostShape, StepCost};

/// Decayed counts of accepted draft positions and positions tried, over every request the
/// engine has verified. A new request has no acceptance history of its own; starting it from
/// what this drafter achieves on this server's traffic, rather than from a fixed guess plus
/// optimism, keeps short requests from over-drafting when acceptance is poor, which at high
/// load made speculation slower than plain batching.
///
/// `generate` runs a fresh engine per request; a caller that runs many (the bench) can carry
/// this from one to the next, so each request starts from what a running server would know.
#[derive(Debug, Clone, Default)]
pub struct FleetAcceptance {
    accepted: f64,
    tried: f64,
    /// Decayed drafting seconds, drafted tokens and drafts.
    draft_secs: f64,
    drafted: f64,
    drafts: f64,
    /// Decayed catch-up seconds and caught-up tokens.
    catch_up_secs: f64,
    caught_up: f64,
    /// Per drafter (of `A+B`: each), decayed sum and count of requests' verify-excess
    /// observations (a drafting step's time over what the curve and the request's own plain
    /// steps predict).
    excess: Vec<(f64, f64)>,
}

impl FleetAcceptance {
    /// Half-life of about 350 draft positions: follows a change of traffic within seconds.
    const DECAY: f64 = 0.998;
    /// Half-life of about 35 excess observations (each a solo drafting step).
    const EXCESS_DECAY: f64 = 0.98;
    /// Weight, in tried positions, the fleet estimate gets in a request's own estimate.
    const PRIOR_WEIGHT: f64 = 4.0;

    /// A chain step: `drafted` tokens, the first `accepted` of them accepted.
    #[cfg(test)]
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        // Positions tried: the accepted ones and the first rejected one, if any.
        self.record_positions((accepted + 1).min(drafted), accepted);
    }

    /// A step that tried `tried` draft positions with the drafter's first choice (a tree's
    /// rank-0 siblings) and had `accepted` of them accepted.
    pub fn record_positions(&mut self, tried: usize, accepted: usize) {
        if tried == 0 {
            return;
        }
        let decay = Self::DECAY.powf(tried as f64);
        self.accepted = self.accepted * decay + accepted as f64;
        self.tried = self.tried * decay + tried as f64;
    }

    /// Upper confidence bound on α: optimistic while the server has seen few drafts (so
    /// speculation gets tried at all), converging on the observed rate.
    pub fn alpha(&self) -> f64 {
        let mean = (self.accepted + 0.5) / (self.tried + 1.0);
        (mean + 1.0 / (1.0 + self.tried).sqrt()).min(1.0)
    }

    /// Folds in one request's drafting work of a step.
    pub fn record_costs(&mut self, drafted: usize, draft_secs: f64, caught_up: usize, catch_up_secs: f64) {
        if drafted > 0 {
            let decay = Self::DECAY.powf(drafted as f64);
            self.draft_secs = self.draft_secs * decay + draft_secs;
            self.drafted = self.drafted * decay + drafted as f64;
            self.drafts = self.drafts * decay + 1.0;
        }
        if caught_up > 0 {
            let decay = Self::DECAY.powf(caught_up as f64);
            self.catch_up_secs = self.catch_up_secs * decay + catch_up_secs;
            self.caught_up = self.caught_up * decay + caught_up as f64;
        }
    }

    /// Folds in one request's observed verify excess of a step drafted by `drafter`.
    pub fn record_excess(&mut self, drafter: usize, ratio: f64) {
        if drafter >= self.excess.len() {
            self.excess.resize(drafter + 1, (0.0, 0.0));
        }
        let (sum, n) = &mut self.excess[drafter];
        *sum = *sum * Self::EXCESS_DECAY + ratio;
        *n = *n * Self::EXCESS_DECAY + 1.0;
    }

    /// How much dearer `drafter`'s verify blocks have been than the curve says, over recent
    /// requests (1, as the curve, until observed; pulled towards 1 with the weight of two
    /// observations).
    pub fn verify_excess(&self, drafter: usize) -> f64 {
        let (sum, n) = self.excess.get(drafter).copied().unwrap_or_default();
        (sum + 2.0) / (n + 2.0)
    }

    /// The least [`Self::verify_excess`] of any drafter: whether a new request's probe could pay.
    fn least_verify_excess(&self) -> f64 {
        (0..self.excess.len().max(1)).map(|d| self.verify_excess(d)).fold(f64::INFINITY, f64::min)
    }

    /// Seconds a drafter took to catch up on a missed token, over recent requests.
    pub fn catch_up_secs_per_token(&self) -> Option<f64> {
        (self.caught_up > 0.0).then(|| self.catch_up_secs / self.caught_up)
    }

    /// Whether a new request should start with a probe: never-tried drafters always do;
    /// otherwise only when the fleet's acceptance, draft cost and verify excess make drafting
    /// pay (by the planner's margin) over catching up on the prompt, spread over the request's
    /// output.
    pub fn start_with_probe(
        &self,
        cost: &StepCost,
        shape: DraftCostShape,
        max_draft: usize,
        prompt: usize,
        max_tokens: usize,
    ) -> bool {
        if self.tried == 0.0 {
            return true;
        }
        let step = cost.secs(1).max(1e-12);
        let per_unit = |secs: f64, n: f64| if n > 0.0 { secs / n / step } else { 0.0 };
        let draft =
            DraftCost { shape, r: per_unit(self.draft_secs, DraftCost::units(shape, self.drafted, self.drafts)) };
        let catch_up = per_unit(self.catch_up_secs, self.caught_up) * prompt as f64 / max_tokens.max(1) as f64;
        pays(1.0 + catch_up, best_len(cost, max_draft, self.alpha(), draft, self.least_verify_excess()).1)
    }

    /// A request's α: its own decayed counts, with the fleet estimate as prior.
    pub fn alpha_for(&self, own_accepted: f64, own_tried: f64) -> f64 {
        alpha_estimate(own_accepted, own_tried, self.alpha(), Self::PRIOR_WEIGHT)
    }
}

#[cfg(test)]
mod tests {
    use super::FleetAcceptance;
    use crate::speculative::{DraftCostShape, StepCost};

    #[test]
    fn fleet_acceptance_starts_optimistic_and_converges_on_what_it_sees() {
        let mut fleet = FleetAcceptance::default();
        assert_eq!(fleet.alpha(), 1.0, "nothing seen yet: try speculation");
        // A drafter that gets the first of four positions right one time in five.
        for i in 0..400 {
            fleet.record(4, usize::from(i % 5 == 0));
        }
        let a = fleet.alpha();
        assert!(a < 0.3, "after poor acceptance the estimate must fall: {a}");
        // A new request starts from the fleet's estimate, and its own evidence moves it.
        let fresh = fleet.alpha_for(0.0, 0.0);
        assert!((fresh - a).abs() < 1e-12);
        assert!(fleet.alpha_for(20.0, 20.0) > 0.8, "a request that keeps matching earns its drafts");
        // Good acceptance later is learnt within a few hundred positions.
        for _ in 0..300 {
            fleet.record(4, 4);
        }
        assert!(fleet.alpha() > 0.8, "{}", fleet.alpha());
    }

    #[test]
    fn new_requests_start_idle_once_the_fleet_knows_drafting_does_not_pay() {
        let steep = StepCost::from_points((1..=16).map(|m| (m, 0.01 * (1.0 + 0.3 * (m - 1) as f64))).collect());
        let mut fleet = FleetAcceptance::default();
        assert!(fleet.start_with_probe(&steep, DraftCostShape::PerToken, 15, 100, 128), "nothing known yet: probe");
        // A draft model at a third of a decode step per token, rarely accepted.
        for _ in 0..200 {
            fleet.record(2, 0);
            fleet.record_costs(2, 0.007, 0, 0.0);
        }
        fleet.record_costs(0, 0.0, 100, 0.2);
        assert!(!fleet.start_with_probe(&steep, DraftCostShape::PerToken, 15, 100, 128));
        // Accepted every time and cheap: worth a probe even with the prompt to catch up on.
        let mut good = FleetAcceptance::default();
        for _ in 0..200 {
            good.record(4, 4);
            good.record_costs(4, 0.001, 0, 0.0);
        }
        good.record_costs(0, 0.0, 100, 0.05);
        assert!(good.start_with_probe(&steep, DraftCostShape::PerToken, 15, 100, 128));
        // The same drafter where verify blocks have cost three times what the curve says: not.
        for _ in 0..100 {
            good.record_excess(0, 3.0);
        }
        assert!(good.verify_excess(0) > 2.9 && good.verify_excess(0) < 3.0, "{}", good.verify_excess(0));
        assert_eq!(good.verify_excess(1), 1.0, "another drafter's steps are its own");
        assert!(!good.start_with_probe(&steep, DraftCostShape::PerToken, 15, 100, 128));
        assert_eq!(good.catch_up_secs_per_token(), Some(0.05 / 100.0));
    }
}
