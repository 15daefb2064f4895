//! Draft-length policy: fixed, or adaptive from the verify-cost curve and acceptance.
//!
//! Adaptive: a step that drafts k tokens costs `cost(k+1)` target time (the measured curve,
//! cost(1) = 1) plus `d(k)` for drafting, and commits on average `E[k] = Σ_{i=0..k} α^i` tokens
//! when each draft position is accepted with probability α given the previous ones were (the
//! geometric model of Leviathan et al.). The policy picks the k maximising
//! `E[k] / (cost(k+1) + d(k))`; plain decoding (k = 0) scores 1, so k = 0 wins whenever
//! speculation would not pay. Drafting time is measured on the fly, relative to one target
//! decode step, in the shape the drafter declares: `d(k) = r·k` for a chain that runs once per
//! token, `d(k) = r` for a drafter that drafts any length in one pass (DFlash). Modelling a
//! one-pass drafter per token would price a 1-token draft at a fraction of what it costs.
//!
//! The curve is measured once, on a short context with nothing running between forwards. In a
//! real decode a verify block can cost more than that (attention over a longer context, the
//! drafter's work between forwards): SmolLM2's 2-row steps ran about 1.4× a plain step inside a
//! DFlash decode where the curve said 1.06. So the policy also learns `x`, the ratio of what its
//! drafting steps' forwards took to what the curve and its own plain steps predict, and scores
//! `E[k] / (x·cost(k+1) + d(k))`: whatever the curve misses, speculation switches off once it
//! stops paying.
//! A request that drafts from its first step has no plain step to measure `x` against: where
//! its decision to draft depends on `x`, it times one plain step early
//! ([`tuning::BASELINE_AFTER`]). A new request starts from the excess (and a drafter's catch-up
//! time) the engine's other requests measured, which the engine hands over
//! ([`AdaptiveState::set_fleet_priors`]).
//! The score and the margin a draft must promise over plain decoding are the planner's
//! ([`super::planner::planned_len`]): this module keeps the statistics and the probing.
//! α is an exponentially weighted estimate from recent steps. While it stays at k = 0 it probes
//! with a short draft now and then (with exponential back-off), otherwise it could never learn
//! that acceptance has improved; a probe's outcome replaces the stale estimate.
//!
//! An idle drafter costs nothing, but resuming can: a draft model first feeds every token it
//! missed. That catch-up is timed on its own, and a probe is made only when what it is expected
//! to lose against plain decoding (catch-up, draft and verify block, less what it is expected to
//! commit) is at most [`tuning::PROBE_BUDGET`] of the time spent idle since the last draft; a
//! request starts with a probe only when its caller says drafting is expected to pay.
//! For a drafter whose catch-up costs more than that per token (a draft model: about 7% of a
//! target step per missed token), stopping is for good, so a drafting drafter stops only when
//! an optimistic α (one standard error above the estimate) no longer pays: otherwise two
//! unlucky steps at the start of a request, on a drafter accepted 90% of the time, switched it
//! off for the whole request.
//!
//! A proposer that chooses between drafters step by step (`A+B`: prompt lookup where it finds
//! a match, a learned drafter elsewhere) says before each step which one will draft, and the
//! policy keeps acceptance, drafting time, probing and the verify excess apart for each: one
//! estimate over both would price lookup's free, often-right drafts like the learned drafter's
//! and cut them short (DFlash's pass between forwards makes its verify steps dearer, which
//! lookup's are not). The target's step time is shared.

use super::metrics::SpecMetrics;
use super::planner::{
    best_len_of_gains, node_gains, planned_len, speedup_of_gains, tree_pays, DraftCost, RankRates, TREE_RANKS,
};
use super::proposer::DraftCostShape;
use super::step_cost::{StepCost, MAX_DRAFT};
use anyhow::{bail, Result};
use std::sync::Arc;

/// α from counts of accepted and tried draft positions, pulled towards `prior` with the weight
/// of `prior_trials` tried positions.
pub fn alpha_estimate(accepted: f64, tried: f64, prior: f64, prior_trials: f64) -> f64 {
    (accepted + prior * prior_trials) / (tried + prior_trials)
}

/// Measured seconds a drafter spends catching up per missed token (None before any catch-up).
fn catch_up_secs_per_token(m: &SpecMetrics) -> Option<f64> {
    (m.catch_up_tokens > 0).then(|| m.catch_up_secs / m.catch_up_tokens as f64)
}

/// A parsed `--draft-len` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftLen {
    Auto,
    Fixed(usize),
}

/// Parses `--draft-len N|auto`.
pub fn parse_draft_len(s: &str) -> Result<DraftLen> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("auto") {
        return Ok(DraftLen::Auto);
    }
    match s.parse::<usize>() {
        Ok(n) if n <= MAX_DRAFT => Ok(DraftLen::Fixed(n)),
        Ok(n) => bail!("--draft-len {n} is too long (at most {MAX_DRAFT})"),
        Err(_) => bail!("--draft-len must be a number of tokens or `auto`, got `{s}`"),
    }
}

/// A parsed `--draft-tree` value: whether drafters that can draft trees do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftTree {
    /// Chains only.
    Off,
    /// Trees of as many nodes as the planner finds worth their rows (up to the longest draft).
    Auto,
    /// Trees of at most this many nodes.
    Max(usize),
}

/// Parses `--draft-tree off|auto|N`.
pub fn parse_draft_tree(s: &str) -> Result<DraftTree> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("off") {
        return Ok(DraftTree::Off);
    }
    if s.eq_ignore_ascii_case("auto") {
        return Ok(DraftTree::Auto);
    }
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_DRAFT).contains(&n) => Ok(DraftTree::Max(n)),
        Ok(n) => bail!("--draft-tree {n} is out of range (1 to {MAX_DRAFT} nodes)"),
        Err(_) => bail!("--draft-tree must be `off`, `auto` or a number of nodes, got `{s}`"),
    }
}

/// Tuning of the adaptive policy.
mod tuning {
    /// Weight of history per step: an estimate's half-life is ln 2 / -ln(DECAY) ≈ 8 steps.
    pub const DECAY: f64 = 0.92;
    /// Prior acceptance and its weight in trials (pulled in before any data, and what long
    /// unobserved stretches decay towards).
    pub const PRIOR_ALPHA: f64 = 0.5;
    pub const PRIOR_TRIALS: f64 = 1.0;
    /// Prior acceptance of a draft tree's rank-1, 2 and 3 siblings once the better ones were
    /// rejected (same weight): about what SmolLM2's drafters' runner-ups reach over the
    /// evaluation sets (11–30% for rank 1 greedy, 2–25% at T = 1; docs/speculative.md). A
    /// prior of 30/20/15% bought rows that did not pay at T = 1.
    pub const PRIOR_RANKS: [f64; super::TREE_RANKS - 1] = [0.2, 0.12, 0.08];
    /// Steps at k = 0 before the first probe; doubled after each probe, up to the maximum, and
    /// back to this only once speculation has stayed on for as many steps: a lucky probe that
    /// turns drafting on for a step or two must not restart the short probe intervals.
    pub const PROBE_AFTER: u32 = 8;
    pub const PROBE_AFTER_MAX: u32 = 128;
    /// Longest draft of a probe (the planner takes whichever length up to this is expected to
    /// lose least).
    pub const PROBE_LEN: usize = 2;
    /// Weight, in drafting steps, of the prior `verify_excess` = 1 (the curve is right).
    pub const EXCESS_PRIOR_STEPS: f64 = 2.0;
    /// Bounds on one step's observed excess (a step that ran into a page fault or a preempted
    /// core says little about the next).
    pub const EXCESS_RANGE: (f64, f64) = (0.5, 3.0);
    /// Drafting steps after which a request with no plain step of its own takes one, timed, as
    /// the base its verify excess is measured on, where the decision to draft depends on that
    /// excess: where the draft would stop paying were verify blocks [`BASELINE_EXCESS`] times
    /// dearer than now estimated. Without it a draft model on a Zen 3 with AVX2 only, priced
    /// on a curve that happened to be measured 10–15% too cheap, kept drafting at 0.92× plain;
    /// taken by every request, it cost prompt lookup 3–6% on SmolLM2 (its drafts pay at any
    /// plausible excess, and the measured one cut long drafts that paid).
    pub const BASELINE_AFTER: u32 = 4;
    pub const BASELINE_EXCESS: f64 = 1.25;
    /// Share of the idle time since the last draft that a probe's catch-up may cost.
    pub const PROBE_BUDGET: f64 = 0.02;
}

/// What the policy knows about one drafter. A proposer that chooses between drafters step by
/// step (`A+B`: prompt lookup where it finds a match, a learned drafter elsewhere) has one per
/// drafter: priced with one shared estimate, lookup's free, often-right drafts would be cut to
/// what the learned drafter's dearer, less reliable ones are worth, and the learned drafter
/// would be asked for drafts as long as lookup's.
#[derive(Debug, Clone)]
struct SourceState {
    /// Decayed counts of accepted draft positions and of positions tried (a position is tried
    /// when every earlier one was accepted).
    accepted: f64,
    trials: f64,
    /// The same for siblings of rank 1, 2, 3 in draft trees.
    rank_accepted: RankRates,
    rank_trials: RankRates,
    /// How drafting time grows with k, and its decayed measurement: time per unit (token or
    /// draft) relative to one target decode step.
    draft_shape: DraftCostShape,
    draft_cost_sum: f64,
    draft_cost_weight: f64,
    zero_streak: u32,
    /// Consecutive steps of this drafter that chose to draft.
    on_streak: u32,
    probe_after: u32,
    /// A probe was asked for and the drafter has not produced a draft yet.
    probing: bool,
    /// The acceptance evidence predates a stretch of plain decoding: the probe that ends the
    /// stretch replaces it instead of being averaged into it.
    stale: bool,
    /// The last step was this drafter's draft, so it had nothing to catch up on in the next.
    drafter_warm: bool,
    /// Steps since this drafter's last draft.
    idle_steps: u32,
    /// No draft until the next scheduled probe (a request told not to start with one, or a
    /// probe that was not affordable).
    hold: bool,
    /// Decayed sum and weight of observed (solo drafting step's forward time) /
    /// (solo plain step × cost(block)) for this drafter's steps: how much dearer verifying is
    /// in this decode than the curve says. Per drafter, because a drafter's own work between
    /// forwards is part of it (DFlash's pass makes the next forward dearer; lookup does not).
    excess_sum: f64,
    excess_weight: f64,
    /// What the engine's other requests measured for this drafter (the excess's prior).
    prior_excess: f64,
}

impl SourceState {
    fn new(draft_shape: DraftCostShape, probe_first: bool) -> Self {
        Self {
            accepted: 0.0,
            trials: 0.0,
            rank_accepted: [0.0; TREE_RANKS - 1],
            rank_trials: [0.0; TREE_RANKS - 1],
            draft_shape,
            draft_cost_sum: 0.0,
            draft_cost_weight: 0.0,
            zero_streak: 0,
            on_streak: 0,
            probe_after: tuning::PROBE_AFTER,
            probing: probe_first,
            stale: false,
            drafter_warm: false,
            idle_steps: 0,
            hold: !probe_first,
            excess_sum: 0.0,
            excess_weight: 0.0,
            prior_excess: 1.0,
        }
    }

    fn alpha(&self) -> f64 {
        alpha_estimate(self.accepted, self.trials, tuning::PRIOR_ALPHA, tuning::PRIOR_TRIALS)
    }

    fn rank_rates(&self) -> RankRates {
        std::array::from_fn(|r| {
            alpha_estimate(self.rank_accepted[r], self.rank_trials[r], tuning::PRIOR_RANKS[r], tuning::PRIOR_TRIALS)
        })
    }

    fn draft_cost(&self) -> DraftCost {
        let r = if self.draft_cost_weight > 0.0 { self.draft_cost_sum / self.draft_cost_weight } else { 0.0 };
        DraftCost { shape: self.draft_shape, r }
    }

    fn verify_excess(&self) -> f64 {
        (self.excess_sum + self.prior_excess * tuning::EXCESS_PRIOR_STEPS)
            / (self.excess_weight + tuning::EXCESS_PRIOR_STEPS)
    }
}

/// The adaptive policy's running estimates: per drafter what depends on the drafter
/// (acceptance, drafting time, probing), shared what depends on the target (its step time,
/// how dear verifying is in this decode).
#[derive(Debug, Clone)]
pub struct AdaptiveState {
    max: usize,
    cost: Arc<StepCost>,
    sources: Vec<SourceState>,
    /// The drafter the last [`Self::choose_for`] was about: the steps observed next are its.
    current: usize,
    /// Counters at the previous call, to recover the last step from cumulative metrics.
    last: Snapshot,
    /// Decayed time of one target decode step, in seconds: from this request's plain steps once
    /// it has had one, from drafting steps' verify times and the curve before.
    step_secs: f64,
    plain_seen: bool,
    /// Decayed time of this request's plain steps that ran alone in their forward: the base
    /// of each drafter's verify excess (in a batch a step's time is a row share, which the
    /// curve does not model).
    solo_plain_secs: f64,
    /// The proposer drafts trees: a draft of k nodes is priced by the tree's gains.
    tree: bool,
    /// What the engine's other requests measured, until this one measures its own: a
    /// drafter's catch-up time per token.
    prior_catch_up_secs: Option<f64>,
    /// The newest excess observation (drafter, ratio), not yet handed to the engine's fleet
    /// statistics.
    excess_sample: Option<(usize, f64)>,
    /// The one plain step [`tuning::BASELINE_AFTER`] asks for has been taken.
    baseline_taken: bool,
}

#[derive(Debug, Clone, Copy, Default)]
struct Snapshot {
    steps: u64,
    drafted: u64,
    tried_at_rank: [u64; TREE_RANKS],
    accepted_at_rank: [u64; TREE_RANKS],
    draft_secs: f64,
    verify_secs: f64,
    shared_steps: u64,
}

impl Snapshot {
    fn of(m: &SpecMetrics) -> Self {
        Self {
            steps: m.steps,
            drafted: m.drafted,
            tried_at_rank: std::array::from_fn(|r| m.tried_at_rank.get(r).copied().unwrap_or(0)),
            accepted_at_rank: std::array::from_fn(|r| m.accepted_at_rank.get(r).copied().unwrap_or(0)),
            draft_secs: m.draft_secs,
            verify_secs: m.verify_secs,
            shared_steps: m.shared_steps,
        }
    }
}

impl AdaptiveState {
    /// `probe_first`: start with a short draft (nothing is known about this drafter on this
    /// text yet), or idle until the first scheduled probe.
    pub fn new(max: usize, cost: Arc<StepCost>, draft_shape: DraftCostShape, probe_first: bool) -> Self {
        Self::with_sources(max, cost, &[draft_shape], probe_first)
    }

    /// A policy for a proposer that chooses between drafters, one cost shape each (at least
    /// one; none is taken as one per-token drafter).
    pub fn with_sources(max: usize, cost: Arc<StepCost>, shapes: &[DraftCostShape], probe_first: bool) -> Self {
        let mut sources: Vec<SourceState> = shapes.iter().map(|&s| SourceState::new(s, probe_first)).collect();
        if sources.is_empty() {
            sources.push(SourceState::new(DraftCostShape::PerToken, probe_first));
        }
        Self {
            max,
            cost,
            sources,
            current: 0,
            last: Snapshot::default(),
            step_secs: 0.0,
            plain_seen: false,
            solo_plain_secs: 0.0,
            tree: false,
            prior_catch_up_secs: None,
            excess_sample: None,
            baseline_taken: false,
        }
    }

    /// Starts from what other requests measured: how much dearer each drafter's verify blocks
    /// were than the curve (`verify_excess(drafter)`), and what catching up on a missed token
    /// costs (seconds).
    pub fn set_fleet_priors(&mut self, verify_excess: impl Fn(usize) -> f64, catch_up_secs_per_token: Option<f64>) {
        for (i, s) in self.sources.iter_mut().enumerate() {
            s.prior_excess = verify_excess(i);
        }
        self.prior_catch_up_secs = catch_up_secs_per_token;
    }

    /// The verify excess observed since the last call (drafter, ratio), for the engine's
    /// statistics over all requests.
    pub fn take_excess_sample(&mut self) -> Option<(usize, f64)> {
        self.excess_sample.take()
    }

    /// Prices drafts as trees from now on (the proposer drafts them).
    pub fn enable_trees(&mut self) {
        self.tree = true;
    }

    /// Whether a draft of `k` nodes should be a tree: the planner's best draft of that size
    /// has a runner-up in it ([`tree_pays`]).
    pub fn tree_pays(&self, k: usize) -> bool {
        self.tree && tree_pays(self.alpha(), &self.src().rank_rates(), k)
    }

    /// The rank-1.. acceptance a tree's node gains use; None for chains.
    pub fn rank_rates(&self) -> Option<RankRates> {
        self.tree.then(|| self.src().rank_rates())
    }

    /// [`node_gains`] of this request's drafts at acceptance `alpha`, up to its maximum.
    fn gains(&self, alpha: f64) -> Vec<f64> {
        node_gains(alpha, self.rank_rates().as_ref(), self.max)
    }

    fn src(&self) -> &SourceState {
        &self.sources[self.current]
    }

    fn src_mut(&mut self) -> &mut SourceState {
        &mut self.sources[self.current]
    }

    /// Estimated acceptance α of one draft position given the earlier ones were accepted
    /// (of the drafter last chosen for).
    pub fn alpha(&self) -> f64 {
        self.src().alpha()
    }

    /// The decayed (accepted, tried) draft-position counts behind [`Self::alpha`], for callers
    /// that bring their own prior (the server: the acceptance of its other requests).
    pub fn acceptance_counts(&self) -> (f64, f64) {
        (self.src().accepted, self.src().trials)
    }

    /// Estimated drafting time relative to one target decode step.
    pub fn draft_cost(&self) -> DraftCost {
        self.src().draft_cost()
    }

    /// How much dearer a verify block of the drafter last chosen for is in this decode than
    /// the curve says (1: as the curve).
    pub fn verify_excess(&self) -> f64 {
        self.src().verify_excess()
    }

    /// cost(m)/cost(1): a verify block of m tokens in decode steps.
    fn cost(&self, m: usize) -> f64 {
        self.cost.relative(m)
    }

    /// Expected speed of drafting k tokens relative to plain decoding (k = 0 scores 1).
    pub fn speedup(&self, k: usize) -> f64 {
        speedup_of_gains(&self.cost, &self.gains(self.alpha()), self.draft_cost(), self.verify_excess(), k)
    }

    /// The best expected speed drafter `source` promises at its own acceptance and cost (1:
    /// no better than plain decoding), to choose between drafters that could both draft.
    pub fn source_speedup(&self, source: usize) -> f64 {
        let Some(s) = self.sources.get(source) else { return 1.0 };
        let rates = self.tree.then(|| s.rank_rates());
        let gains = node_gains(s.alpha(), rates.as_ref(), self.max);
        best_len_of_gains(&self.cost, &gains, s.draft_cost(), s.verify_excess()).1
    }

    /// The k in 0..=max with the best expected speed (shortest on ties), or 0 when even that
    /// one promises less than [`MIN_GAIN`](super::planner::MIN_GAIN) over plain decoding.
    pub fn best_len(&self) -> usize {
        self.best_len_at(self.alpha())
    }

    fn best_len_at(&self, alpha: f64) -> usize {
        planned_len(&self.cost, &self.gains(alpha), self.draft_cost(), self.verify_excess())
    }

    /// Whether to take the one timed plain step ([`tuning::BASELINE_AFTER`]): none yet, and
    /// drafting would not pay were verify blocks [`tuning::BASELINE_EXCESS`] times dearer.
    fn needs_baseline(&self) -> bool {
        let dearer = self.verify_excess() * tuning::BASELINE_EXCESS;
        !self.baseline_taken
            && self.solo_plain_secs == 0.0
            && planned_len(&self.cost, &self.gains(self.alpha()), self.draft_cost(), dearer) == 0
    }

    /// α one standard error above the estimate (its weight: the decayed tried positions).
    fn optimistic_alpha(&self) -> f64 {
        let a = self.alpha();
        (a + (a * (1.0 - a) / (self.src().trials + tuning::PRIOR_TRIALS)).sqrt()).min(1.0)
    }

    /// Whether catching up after an idle stretch costs more per missed token than the probe
    /// budget allows, so that a drafter that stops now is not probed again.
    fn resuming_is_dear(&self, m: &SpecMetrics) -> bool {
        self.step_secs > 0.0 && self.catch_up_secs(m).is_some_and(|secs| secs > tuning::PROBE_BUDGET * self.step_secs)
    }

    /// Seconds the drafter takes to catch up on a missed token: this request's measurement,
    /// else the other requests'.
    fn catch_up_secs(&self, m: &SpecMetrics) -> Option<f64> {
        catch_up_secs_per_token(m).or(self.prior_catch_up_secs)
    }

    /// Folds in the step(s) since the last call: the drafter they drafted with (if any) is
    /// the one the last call chose for.
    fn observe(&mut self, m: &SpecMetrics) {
        let now = Snapshot::of(m);
        let prev = std::mem::replace(&mut self.last, now);
        let steps = now.steps.saturating_sub(prev.steps);
        if steps == 0 {
            return;
        }
        let drafted = now.drafted.saturating_sub(prev.drafted) as f64;
        let block = (drafted / steps as f64).round() as usize + 1;
        let verify = (now.verify_secs - prev.verify_secs) / steps as f64;
        let ewma = |old: f64, new: f64| if old > 0.0 { old * tuning::DECAY + new * (1.0 - tuning::DECAY) } else { new };
        let solo = now.shared_steps == prev.shared_steps;
        if verify > 0.0 && drafted == 0.0 {
            self.step_secs = if self.plain_seen { ewma(self.step_secs, verify) } else { verify };
            self.plain_seen = true;
            if solo {
                self.solo_plain_secs = ewma(self.solo_plain_secs, verify);
            }
        } else if verify > 0.0 && !self.plain_seen {
            self.step_secs = ewma(self.step_secs, verify / self.cost(block).max(1e-9));
        }
        if verify > 0.0 && drafted > 0.0 && steps == 1 && solo && self.solo_plain_secs > 0.0 {
            // A drafting step after plain ones: what its block cost against the prediction.
            let (lo, hi) = tuning::EXCESS_RANGE;
            let ratio = (verify / (self.solo_plain_secs * self.cost(block))).clamp(lo, hi);
            let current = self.current;
            let s = self.src_mut();
            s.excess_sum = s.excess_sum * tuning::DECAY + ratio;
            s.excess_weight = s.excess_weight * tuning::DECAY + 1.0;
            self.excess_sample = Some((current, ratio));
        }
        let one_step = self.step_secs;
        let current = self.current;
        for (i, s) in self.sources.iter_mut().enumerate() {
            let drafted_here = i == current && drafted > 0.0;
            s.idle_steps = if drafted_here { 0 } else { s.idle_steps.saturating_add(steps as u32) };
            s.drafter_warm = drafted_here && steps == 1;
        }
        if drafted == 0.0 {
            return; // a plain step says nothing about the drafter
        }
        let s = self.src_mut();
        s.hold = false;
        // Positions tried at each rank: the accepted ones plus the first rejected one (if
        // any draft position was left), as the verifier walked them.
        let delta = |r: usize, now: &[u64; TREE_RANKS], prev: &[u64; TREE_RANKS]| now[r].saturating_sub(prev[r]) as f64;
        let decay = tuning::DECAY.powi(steps as i32);
        if std::mem::take(&mut s.stale) {
            s.accepted = 0.0;
            s.trials = 0.0;
            s.rank_accepted = [0.0; TREE_RANKS - 1];
            s.rank_trials = [0.0; TREE_RANKS - 1];
        }
        s.accepted = s.accepted * decay + delta(0, &now.accepted_at_rank, &prev.accepted_at_rank);
        s.trials = s.trials * decay + delta(0, &now.tried_at_rank, &prev.tried_at_rank);
        for r in 1..TREE_RANKS {
            s.rank_accepted[r - 1] =
                s.rank_accepted[r - 1] * decay + delta(r, &now.accepted_at_rank, &prev.accepted_at_rank);
            s.rank_trials[r - 1] = s.rank_trials[r - 1] * decay + delta(r, &now.tried_at_rank, &prev.tried_at_rank);
        }

        // Draft time per unit relative to one decode step. Catching up on the tokens missed
        // while idle is timed apart (it is a cost of resuming, not of each draft), so a probe's
        // pass counts too: it is what the next probe will cost.
        let draft_secs = now.draft_secs - prev.draft_secs;
        if steps == 1 && one_step > 0.0 && draft_secs >= 0.0 {
            // One step, so one draft.
            let units = DraftCost::units(s.draft_shape, drafted, 1.0);
            s.draft_cost_sum = s.draft_cost_sum * decay + draft_secs / one_step;
            s.draft_cost_weight = s.draft_cost_weight * decay + units;
        }
        s.probing = false;
    }

    /// Whether the draft length [`Self::choose`] returned last is a probe (short, made to
    /// re-measure acceptance rather than because drafting is expected to pay).
    pub fn is_probing(&self) -> bool {
        self.src().probing
    }

    /// Seconds of one target decode step, as measured so far (0 before any step).
    pub fn step_secs(&self) -> f64 {
        self.step_secs
    }

    /// Whether a probe that must first catch up on `pending` tokens fits the probe budget: what
    /// it is expected to lose against plain decoding ([`Self::probe_loss`]) is at most
    /// [`tuning::PROBE_BUDGET`] of the time spent idle since the last draft.
    fn probe_affordable(&self, m: &SpecMetrics, pending: usize) -> bool {
        if self.step_secs <= 0.0 {
            return true; // nothing measured yet: nothing to price it with
        }
        let catch_up = match self.catch_up_secs(m) {
            Some(secs) if pending > 0 => secs * pending as f64 / self.step_secs,
            _ => 0.0,
        };
        self.probe_loss(catch_up) <= tuning::PROBE_BUDGET * self.src().idle_steps as f64
    }

    /// The probe's length: of drafts up to [`tuning::PROBE_LEN`], the one expected to lose
    /// least against plain decoding (the shorter on ties). Where a third row is dear (cost(3)
    /// 1.28 against cost(2) 1.06 for SmolLM2 on a Zen 3) a second draft token pays for itself
    /// only when α exceeds about 0.47; a probe of one token still measures the first position,
    /// the one that decides whether drafting pays.
    fn probe_len(&self) -> usize {
        let gains = self.gains(self.alpha());
        (1..=tuning::PROBE_LEN.min(self.max))
            .map(|k| (k, self.probe_loss_at(&gains, k, 0.0)))
            .fold((0, f64::INFINITY), |best, (k, loss)| if loss < best.1 { (k, loss) } else { best })
            .0
    }

    /// Decode steps a probe is expected to lose against plain decoding: its catch-up
    /// (`catch_up` steps), its draft and its verify block, less what it is expected to commit
    /// at the current α. A probe of a drafter that is often right costs nothing; one of a
    /// drafter that is rarely right costs up to a step (DFlash on SmolLM2 at T = 1: a pass of
    /// 0.25 steps, catching up 0.2, a 3-row block 1.28 for 1.3 tokens), which probing every
    /// few steps paid out of its speedup.
    fn probe_loss(&self, catch_up: f64) -> f64 {
        self.probe_loss_at(&self.gains(self.alpha()), self.probe_len(), catch_up).max(0.0)
    }

    fn probe_loss_at(&self, gains: &[f64], k: usize, catch_up: f64) -> f64 {
        let expected = 1.0 + gains.iter().take(k).sum::<f64>();
        catch_up + self.draft_cost().of(k) + self.verify_excess() * self.cost(k + 1) - expected
    }

    /// The draft length for the next step of a single-drafter proposer.
    pub fn choose(&mut self, m: &SpecMetrics, pending_catch_up: usize) -> usize {
        self.choose_for(0, m, pending_catch_up)
    }

    /// The draft length for the next step, drafted by drafter `source` (out of range: the
    /// last), given the metrics so far and the tokens it would have to catch up on first.
    pub fn choose_for(&mut self, source: usize, m: &SpecMetrics, pending_catch_up: usize) -> usize {
        self.observe(m);
        self.current = source.min(self.sources.len() - 1);
        if self.max == 0 {
            return 0;
        }
        if self.src().probing {
            if self.probe_affordable(m, pending_catch_up) {
                return self.probe_len();
            }
            let s = self.src_mut();
            s.probing = false;
            s.hold = true;
        }
        let hold = self.src().hold;
        let mut k = if hold { 0 } else { self.best_len() };
        if k == 0 && !hold && self.src().drafter_warm && self.resuming_is_dear(m) {
            // Stopping a drafter that cannot afford to resume is for good: it takes more than
            // a few unlucky steps.
            k = self.best_len_at(self.optimistic_alpha());
        }
        if k > 0 {
            let s = self.src_mut();
            s.zero_streak = 0;
            s.on_streak += 1;
            if s.on_streak >= tuning::PROBE_AFTER {
                s.probe_after = tuning::PROBE_AFTER;
            }
            if s.on_streak >= tuning::BASELINE_AFTER && self.needs_baseline() {
                self.baseline_taken = true;
                return 0;
            }
            return k;
        }
        let affordable = self.probe_affordable(m, pending_catch_up);
        let s = self.src_mut();
        s.on_streak = 0;
        s.zero_streak += 1;
        if s.zero_streak >= s.probe_after && affordable {
            s.zero_streak = 0;
            s.probe_after = (s.probe_after * 2).min(tuning::PROBE_AFTER_MAX);
            s.probing = true;
            s.stale = true;
            return self.probe_len();
        }
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::planner::{best_len, MIN_GAIN};

    /// Feeds `steps` steps where every draft is accepted with probability `alpha` (position by
    /// position, deterministic pseudo-randomness), drafting what the policy asks for.
    /// Verify blocks cost what `curve` says.
    fn run(
        choose: &mut dyn FnMut(&SpecMetrics) -> usize,
        curve: &StepCost,
        alpha: f64,
        steps: usize,
        draft_secs_per_token: f64,
    ) -> (SpecMetrics, Vec<usize>) {
        run_costed(choose, alpha, steps, &|k| draft_secs_per_token * k as f64, &|k| curve.relative(k + 1))
    }

    /// `run` with drafting seconds `draft_secs(k)` and verify time `0.01 × verify_steps(k)`.
    fn run_costed(
        choose: &mut dyn FnMut(&SpecMetrics) -> usize,
        alpha: f64,
        steps: usize,
        draft_secs: &dyn Fn(usize) -> f64,
        verify_steps: &dyn Fn(usize) -> f64,
    ) -> (SpecMetrics, Vec<usize>) {
        let mut m = SpecMetrics::default();
        let mut rng = crate::sample::SamplerRng::from_seed(11);
        let mut chosen = Vec::new();
        for _ in 0..steps {
            let k = choose(&m);
            chosen.push(k);
            let accepted = (0..k).take_while(|_| rng.next_f64() < alpha).count();
            m.record(k, accepted, accepted + 1);
            if k > 0 {
                m.draft_secs += draft_secs(k);
            }
            m.verify_secs += 0.01 * verify_steps(k); // unit: a 10 ms decode step
        }
        (m, chosen)
    }

    /// SmolLM2-135M's measured verify curve on this CPU: cost(2) 1.04, cost(4) 1.31,
    /// cost(8) 2.18, cost(16) 3.91 (linear in between).
    fn smollm2_points() -> Vec<(usize, f64)> {
        let knots = [(1, 1.0), (2, 1.04), (4, 1.31), (8, 2.18), (16, 3.91)];
        (1..=16)
            .map(|m| {
                let j = knots.iter().position(|&(x, _)| x >= m).unwrap();
                if knots[j].0 == m {
                    return (m, knots[j].1);
                }
                let ((x0, y0), (x1, y1)) = (knots[j - 1], knots[j]);
                (m, y0 + (y1 - y0) * (m - x0) as f64 / (x1 - x0) as f64)
            })
            .collect()
    }

    #[test]
    fn a_one_pass_drafter_that_is_rarely_right_stays_off() {
        // DFlash on SmolLM2 as measured: one block pass costs about 0.55 decode steps at any k,
        // and the first draft token is accepted about a quarter of the time. No k pays:
        // (1 + 0.25) / (1.04 + 0.55) < 1.
        let points = smollm2_points();
        let curve = Arc::new(StepCost::from_points(points.clone()));
        let verify = |k: usize| points[k].1;
        let mut state = AdaptiveState::new(15, curve.clone(), DraftCostShape::PerDraft, true);
        let (_, chosen) = run_costed(&mut |m| state.choose(m, 0), 0.25, 400, &|_| 0.0055, &verify);
        let late = &chosen[100..];
        let spec_steps = late.iter().filter(|&&k| k > 0).count();
        // Probes with back-off, and a short run after a probe that was lucky.
        assert!(spec_steps <= 10, "drafted in {spec_steps} of {} steps: {late:?}", late.len());
    }

    #[test]
    fn a_probe_is_priced_whole_and_drafts_what_loses_least() {
        // DFlash on SmolLM2 at T = 1 on a Zen 3 as measured: the first draft token accepted a
        // quarter of the time, a third row dear (cost(3) 1.45). A probe's pass, catch-up and
        // verify block cost more than it commits, so probes come rarer the dearer they are,
        // and draft one token.
        let points = vec![(1, 1.0), (2, 1.2), (3, 1.45), (4, 1.75)];
        let curve = Arc::new(StepCost::from_points(points.clone()));
        let probes = |pass: f64, catch_up: f64| {
            let mut state = AdaptiveState::new(3, curve.clone(), DraftCostShape::PerDraft, true);
            let mut caught_up = 0;
            let (_, chosen) = run_costed(
                &mut |m| {
                    // Catching up costs `catch_up` decode steps per missed token.
                    let mut m = m.clone();
                    caught_up = caught_up.max(m.steps);
                    m.catch_up_tokens = caught_up;
                    m.catch_up_secs = 0.01 * catch_up * caught_up as f64;
                    state.choose(&m, state.src().idle_steps as usize)
                },
                0.25,
                600,
                &|_| 0.01 * pass,
                &|k| points[k].1,
            );
            chosen
        };
        let free = probes(0.0, 0.0);
        let dear = probes(0.3, 0.01);
        let count = |c: &[usize]| c.iter().filter(|&&k| k > 0).count();
        // A probe: a draft after a plain step (a lucky one may be followed by the planner's).
        let probe_steps = |c: &[usize]| -> Vec<(usize, usize)> {
            (0..c.len()).filter(|&i| c[i] > 0 && (i == 0 || c[i - 1] == 0)).map(|i| (i, c[i])).collect()
        };
        let (free_probes, dear_probes) = (probe_steps(&free), probe_steps(&dear));
        assert!(count(&dear) * 2 < count(&free), "dear {dear_probes:?} vs free {free_probes:?}");
        // The first scheduled probe: after 8 steps where it costs nothing, after about
        // 25 where it is expected to lose half a step (2% of the time idle).
        assert_eq!(free_probes[1].0, tuning::PROBE_AFTER as usize, "{free_probes:?}");
        assert!(dear_probes[1].0 >= 20, "{dear_probes:?}");
        assert!(dear_probes.iter().all(|&(_, k)| k == 1), "a second token costs more than it commits: {dear_probes:?}");
    }

    #[test]
    fn a_drafter_that_would_barely_pay_stays_off() {
        // DFlash on SmolLM2 as measured on GSM8K: a pass costs 0.29 decode steps and the first
        // draft token is accepted about 36% of the time. The best k promises about 1.02×,
        // inside what estimates from a few steps miss by; drafting like that ran at 0.97×.
        let curve = Arc::new(StepCost::from_points(smollm2_points()));
        let mut state = AdaptiveState::new(15, curve.clone(), DraftCostShape::PerDraft, false);
        state.sources[0].hold = false;
        state.sources[0].draft_cost_sum = 0.29;
        state.sources[0].draft_cost_weight = 1.0;
        let mut with_alpha = |alpha: f64| {
            state.sources[0].trials = 1000.0;
            state.sources[0].accepted =
                alpha * (state.sources[0].trials + tuning::PRIOR_TRIALS) - tuning::PRIOR_ALPHA * tuning::PRIOR_TRIALS;
            assert!((state.alpha() - alpha).abs() < 1e-9);
            let (k, s) = best_len(&curve, 15, alpha, state.draft_cost(), 1.0);
            (state.best_len(), k, s)
        };
        let (chosen, k, s) = with_alpha(0.36);
        assert!(k > 0 && s > 1.0 && s < 1.0 + MIN_GAIN, "best k {k} promises {s}");
        assert_eq!(chosen, 0, "a promise of {s} must not switch drafting on");
        // Clearly paying: the same drafter right half the time.
        let (chosen, k, s) = with_alpha(0.5);
        assert!(s > 1.0 + MIN_GAIN && chosen == k && k > 0, "k {k} promises {s}, chosen {chosen}");
    }

    #[test]
    fn lucky_probes_do_not_restart_short_probe_intervals() {
        // A one-pass drafter just short of paying: α = 0.45, so (1 + α) / (1.04 + 0.55) < 1,
        // but a probe that is accepted whole makes one step look worth drafting. Such a probe
        // must not bring back probing every 8 steps: the idle stretches keep growing.
        let points = smollm2_points();
        let curve = Arc::new(StepCost::from_points(points.clone()));
        let verify = |k: usize| points[k].1;
        let mut state = AdaptiveState::new(15, curve, DraftCostShape::PerDraft, true);
        let (_, chosen) = run_costed(&mut |m| state.choose(m, 0), 0.45, 2000, &|_| 0.0055, &verify);
        let late = &chosen[1000..];
        let spec_steps = late.iter().filter(|&&k| k > 0).count();
        let longest_idle = late.split(|&k| k > 0).map(|idle| idle.len()).max().unwrap_or(0);
        eprintln!("drafted in {spec_steps} of {} steps, longest idle stretch {longest_idle}", late.len());
        assert!(longest_idle >= tuning::PROBE_AFTER_MAX as usize / 2, "longest idle stretch {longest_idle}");
        assert!(spec_steps <= 40, "drafted in {spec_steps} of {} steps", late.len());
    }

    #[test]
    fn a_one_pass_drafter_that_is_often_right_drafts_long() {
        // The same pass at α = 0.8: the pass is paid once, so long drafts are cheap per token.
        let points = smollm2_points();
        let curve = Arc::new(StepCost::from_points(points.clone()));
        let verify = |k: usize| points[k].1;
        let mut state = AdaptiveState::new(15, curve, DraftCostShape::PerDraft, true);
        let (m, chosen) = run_costed(&mut |m| state.choose(m, 0), 0.8, 300, &|_| 0.0055, &verify);
        assert!((state.draft_cost().r - 0.55).abs() < 1e-6, "{:?}", state.draft_cost());
        let late = &chosen[100..];
        assert!(late.iter().all(|&k| k >= 3), "{late:?}");
        assert!(m.tau() > 2.5, "tau {}", m.tau());
        // Priced per token, a pass measured at k tokens makes longer drafts look dearer than
        // they are; the policy settles on shorter drafts and commits less per step.
        let mut per_token =
            AdaptiveState::new(15, Arc::new(StepCost::from_points(points.clone())), DraftCostShape::PerToken, true);
        let (m_token, chosen_token) = run_costed(&mut |m| per_token.choose(m, 0), 0.8, 300, &|_| 0.0055, &verify);
        let mean = |c: &[usize]| c.iter().sum::<usize>() as f64 / c.len() as f64;
        let (k_draft, k_token) = (mean(late), mean(&chosen_token[100..]));
        assert!(k_token < k_draft - 1.0, "mean k {k_token} per token vs {k_draft} per draft");
        assert!(m_token.tau() < m.tau() - 0.5, "τ {} per token vs {} per draft", m_token.tau(), m.tau());
    }

    fn flat_curve(n: usize) -> Arc<StepCost> {
        Arc::new(StepCost::from_points((1..=n).map(|m| (m, 1.0 + 0.05 * (m - 1) as f64)).collect()))
    }

    fn steep_curve(n: usize) -> Arc<StepCost> {
        // cost(4) ≈ 2.5, cost(16) ≈ 6.2: the 1.5b model on this CPU.
        let secs = |m: usize| 1.0 + 0.5 * (m - 1) as f64 - 0.004 * ((m - 1) * (m - 1)) as f64;
        Arc::new(StepCost::from_points((1..=n).map(|m| (m, secs(m))).collect()))
    }

    #[test]
    fn high_acceptance_and_a_flat_curve_draft_long() {
        let curve = flat_curve(16);
        let mut state = AdaptiveState::new(15, curve.clone(), DraftCostShape::PerToken, true);
        let (m, chosen) = run(&mut |m| state.choose(m, 0), &curve, 0.95, 200, 0.0);
        let late = &chosen[100..];
        assert!(late.iter().all(|&k| k >= 8), "expected long drafts, got {late:?}");
        assert!(m.tau() > 5.0, "tau {}", m.tau());
    }

    #[test]
    fn low_acceptance_and_a_steep_curve_switch_speculation_off() {
        let curve = steep_curve(16);
        let mut state = AdaptiveState::new(15, curve.clone(), DraftCostShape::PerToken, true);
        let (_, chosen) = run(&mut |m| state.choose(m, 0), &curve, 0.2, 400, 0.0);
        let late = &chosen[100..];
        let spec_steps = late.iter().filter(|&&k| k > 0).count();
        // Only probes, with back-off: a handful in 300 steps.
        assert!(spec_steps <= 6, "speculated in {spec_steps} of {} steps: {late:?}", late.len());
        assert!(late.iter().all(|&k| k <= tuning::PROBE_LEN));
    }

    #[test]
    fn keeps_probing_and_recovers_when_acceptance_improves() {
        let curve = steep_curve(16);
        let mut state = AdaptiveState::new(15, curve.clone(), DraftCostShape::PerToken, true);
        let mut m = SpecMetrics::default();
        let mut rng = crate::sample::SamplerRng::from_seed(3);
        let mut step = |state: &mut AdaptiveState, m: &mut SpecMetrics, alpha: f64| {
            let k = state.choose(m, 0);
            let accepted = (0..k).take_while(|_| rng.next_f64() < alpha).count();
            m.record(k, accepted, accepted + 1);
            m.verify_secs += 0.01 * curve.relative(k + 1);
            k
        };
        // Bad phase: speculation switches off.
        let bad: Vec<usize> = (0..200).map(|_| step(&mut state, &mut m, 0.0)).collect();
        assert!(bad[150..].iter().filter(|&&k| k > 0).count() <= 3);
        assert!(bad.iter().filter(|&&k| k > 0).count() >= 3, "must probe while off: {bad:?}");
        // Perfect phase: a probe must discover it and speculation must come back, long.
        let good: Vec<usize> = (0..400).map(|_| step(&mut state, &mut m, 1.0)).collect();
        let first_long = good.iter().position(|&k| k >= 4).expect("speculation never came back");
        assert!(first_long < 200, "took {first_long} steps to come back: {good:?}");
        assert!(good[first_long + 20..].iter().all(|&k| k >= 4));
    }

    #[test]
    fn a_dear_drafter_drafts_shorter_than_a_free_one() {
        let curve = flat_curve(16);
        let mut free = AdaptiveState::new(15, curve.clone(), DraftCostShape::PerToken, true);
        let mut dear = AdaptiveState::new(15, curve, DraftCostShape::PerToken, true);
        for s in [&mut free, &mut dear] {
            s.sources[0].accepted = 80.0;
            s.sources[0].trials = 100.0;
            s.sources[0].probing = false;
        }
        dear.sources[0].draft_cost_sum = 0.5;
        dear.sources[0].draft_cost_weight = 1.0;
        assert!(free.best_len() > dear.best_len(), "{} vs {}", free.best_len(), dear.best_len());
        // With α = 0.8 and drafting at half a decode step per token, 1 token still pays:
        // E[1]/cost = 1.8 / (1.05 + 0.5) > 1.
        assert!(dear.best_len() >= 1);
    }

    #[test]
    fn draft_time_is_measured_relative_to_a_decode_step() {
        let mut state = AdaptiveState::new(15, flat_curve(16), DraftCostShape::PerToken, true);
        let mut m = SpecMetrics::default();
        state.choose(&m, 0);
        // First drafting step: the drafter caught up on the prompt (slow, timed apart: not a
        // draft price), then drafted 2 tokens in 10 ms; the block took 10 ms × cost(3).
        m.record(2, 2, 3);
        m.catch_up_secs = 0.5;
        m.draft_secs = 0.010;
        m.verify_secs = 0.011;
        state.choose(&m, 0);
        assert!((state.draft_cost().r - 0.5).abs() < 1e-6, "{}", state.draft_cost().r);
        // Next step drafts 4 tokens in 20 ms; verifying 5 tokens took 10 ms × cost(5) = 12 ms.
        m.record(4, 2, 3);
        m.draft_secs += 0.020;
        m.verify_secs += 0.012;
        state.choose(&m, 0);
        assert!((state.draft_cost().r - 0.5).abs() < 1e-6, "{}", state.draft_cost().r);
        // α: 4 accepted of 2 + 3 tried (the first step's 2 decayed once), plus the prior.
        let (acc, tried) = (2.0 * tuning::DECAY + 2.0, 2.0 * tuning::DECAY + 3.0);
        assert!((state.alpha() - (acc + 0.5) / (tried + 1.0)).abs() < 1e-9, "{}", state.alpha());
        // A plain step, then a drafting step that first catches up for a second: the draft
        // itself is priced as before.
        m.record(0, 0, 1);
        m.verify_secs += 0.01;
        state.choose(&m, 0);
        m.record(4, 4, 5);
        m.catch_up_secs += 1.0;
        m.draft_secs += 0.020;
        m.verify_secs += 0.012;
        state.choose(&m, 0);
        assert!((state.draft_cost().r - 0.5).abs() < 1e-6, "catch-up not priced as drafting: {}", state.draft_cost().r);
        // That step's block cost what the curve and the plain step predicted.
        assert!((state.verify_excess() - 1.0).abs() < 1e-9, "{}", state.verify_excess());
    }

    #[test]
    fn steps_shared_with_other_sequences_leave_the_excess_alone() {
        // In a batch a drafting sequence's share of the forward grows with its rows, which the
        // single-sequence curve does not model: such steps must not count as excess.
        let mut state = AdaptiveState::new(15, flat_curve(16), DraftCostShape::PerDraft, true);
        let mut m = SpecMetrics::default();
        state.choose(&m, 0);
        m.record(0, 0, 1);
        m.verify_secs += 0.01;
        m.shared_steps += 1;
        state.choose(&m, 0);
        m.record(3, 1, 2);
        m.verify_secs += 0.03;
        m.shared_steps += 1;
        state.choose(&m, 0);
        assert_eq!(state.verify_excess(), 1.0);
        // Alone, the same step would count: 30 ms against 10 ms × cost(4) = 11.5 ms.
        m.record(0, 0, 1);
        m.verify_secs += 0.01;
        state.choose(&m, 0);
        m.record(3, 1, 2);
        m.verify_secs += 0.03;
        state.choose(&m, 0);
        assert!(state.verify_excess() > 1.5, "{}", state.verify_excess());
    }

    #[test]
    fn verify_blocks_dearer_than_the_curve_switch_speculation_off() {
        // SmolLM2's curve, a cheap drafter (0.1 decode steps per draft) right 35% of the time:
        // on the curve a 1-token draft pays, (1 + 0.35) / (1.04 + 0.1) = 1.18. But in this
        // decode every drafting step's forward takes 1.4× what the curve says (as measured in a
        // DFlash decode), so it does not: (1.35) / (1.04 × 1.4 + 0.1) = 0.87.
        let points = smollm2_points();
        let curve = Arc::new(StepCost::from_points(points.clone()));
        let dear = |k: usize| if k == 0 { 1.0 } else { 1.4 * points[k].1 };
        let mut state = AdaptiveState::new(15, curve.clone(), DraftCostShape::PerDraft, true);
        let (_, chosen) = run_costed(&mut |m| state.choose(m, 0), 0.35, 400, &|_| 0.001, &dear);
        let late = chosen[100..].iter().filter(|&&k| k > 0).count();
        // Probes, and now and then a short run after a lucky one.
        assert!(late <= 30, "drafted in {late} of 300 steps: {:?}", &chosen[100..]);
        assert!(state.verify_excess() > 1.2, "{}", state.verify_excess());
        // Where the curve is right, the same drafter keeps drafting.
        let exact = |k: usize| points[k].1;
        let mut state = AdaptiveState::new(15, curve, DraftCostShape::PerDraft, true);
        let (_, chosen) = run_costed(&mut |m| state.choose(m, 0), 0.35, 400, &|_| 0.001, &exact);
        let late = chosen[100..].iter().filter(|&&k| k > 0).count();
        assert!(late > 200, "drafted in only {late} of 300 steps");
    }

    #[test]
    fn a_marginal_drafter_times_one_plain_step_to_learn_the_excess() {
        // A draft model right 90% of the time, a draft token at 0.6 of a decode step, on a
        // curve where each row adds 0.15: on the curve one token pays, (1 + 0.9) / (1.15 +
        // 0.6) = 1.09, but not at 1.25× that cost (1.9 / (1.44 + 0.6) = 0.93). In fact every
        // drafting step's forward takes 1.6× what the curve says (1.9 / (1.84 + 0.6) = 0.78):
        // a request that never decodes plainly can only learn that from a plain step it times.
        let curve = Arc::new(StepCost::from_points((1..=16).map(|m| (m, 1.0 + 0.15 * (m - 1) as f64)).collect()));
        let dear = |k: usize| if k == 0 { 1.0 } else { 1.6 * curve.relative(k + 1) };
        let mut state = AdaptiveState::new(15, curve.clone(), DraftCostShape::PerToken, true);
        let (_, chosen) = run_costed(&mut |m| state.choose(m, 0), 0.9, 300, &|k| 0.006 * k as f64, &dear);
        let first_plain = chosen.iter().position(|&k| k == 0).expect("a plain step");
        assert!((3..=10).contains(&first_plain), "{chosen:?}");
        assert!(state.verify_excess() > 1.3, "{}", state.verify_excess());
        let late = chosen[100..].iter().filter(|&&k| k > 0).count();
        assert!(late <= 30, "drafted in {late} of 200 steps: {:?}", &chosen[100..]);
        // A drafter that pays at any plausible excess (free and right 90% of the time) never
        // stops to time a plain step.
        let exact = |k: usize| curve.relative(k + 1);
        let mut state = AdaptiveState::new(15, curve.clone(), DraftCostShape::PerToken, true);
        let (_, chosen) = run_costed(&mut |m| state.choose(m, 0), 0.9, 300, &|_| 0.0, &exact);
        assert!(chosen.iter().all(|&k| k > 0), "{chosen:?}");
    }

    #[test]
    fn a_new_request_starts_from_what_other_requests_measured() {
        // A draft model right 90% of the time, a draft token at 0.4 of a decode step, on a
        // curve where each row adds 0.15: on the curve three tokens pay, (1 + 0.9 + 0.81 +
        // 0.73) / (1.45 + 1.2) = 1.30. Where the engine's other requests found verify blocks
        // 1.6× dearer than the curve says, no length does (3.44 / (2.32 + 1.2) = 0.98 at the
        // best), and a new request does not draft.
        let curve = Arc::new(StepCost::from_points((1..=16).map(|m| (m, 1.0 + 0.15 * (m - 1) as f64)).collect()));
        let mut state = AdaptiveState::new(15, curve.clone(), DraftCostShape::PerToken, false);
        state.sources[0].hold = false;
        state.sources[0].draft_cost_sum = 0.4;
        state.sources[0].draft_cost_weight = 1.0;
        state.sources[0].trials = 1000.0;
        state.sources[0].accepted = 900.0;
        assert!(state.best_len() > 0);
        state.set_fleet_priors(|_| 1.6, None);
        assert!((state.verify_excess() - 1.6).abs() < 1e-12);
        assert_eq!(state.best_len(), 0);
        // A draft model whose catch-up the fleet has timed (5 ms a token against 10 ms steps)
        // is not probed on a 100-token prompt it would first have to read.
        let mut state = AdaptiveState::new(15, curve.clone(), DraftCostShape::PerToken, false);
        state.set_fleet_priors(|_| 1.0, Some(0.005));
        let mut m = SpecMetrics::default();
        for step in 0..300 {
            assert_eq!(state.choose(&m, 100 + step), 0, "step {step}");
            m.record(0, 0, 1);
            m.verify_secs += 0.01;
        }
        // Without the fleet's timing it would have probed.
        let mut state = AdaptiveState::new(15, curve, DraftCostShape::PerToken, false);
        let mut m = SpecMetrics::default();
        let probed = (0..300).any(|step| {
            let k = state.choose(&m, 100 + step);
            m.record(k, 0, 1);
            m.verify_secs += 0.01;
            k > 0
        });
        assert!(probed);
    }

    #[test]
    fn draft_len_parsing() {
        assert_eq!(parse_draft_len("auto").unwrap(), DraftLen::Auto);
        assert_eq!(parse_draft_len("AUTO").unwrap(), DraftLen::Auto);
        assert_eq!(parse_draft_len("4").unwrap(), DraftLen::Fixed(4));
        assert_eq!(parse_draft_len("0").unwrap(), DraftLen::Fixed(0));
        assert!(parse_draft_len("-1").is_err());
        assert!(parse_draft_len("x").is_err());
        assert!(parse_draft_len("1000").is_err());
    }

    #[test]
    fn a_probe_that_must_catch_up_waits_until_it_fits_the_budget() {
        // A draft model that sat idle: resuming costs 5 ms of catch-up per missed token, a
        // decode step 10 ms. A probe after n idle steps costs 5n ms of catch-up against the
        // budget of 2% of 10n ms: never affordable, so an idle draft model stays idle.
        let mut state = AdaptiveState::new(15, steep_curve(16), DraftCostShape::PerToken, false);
        let mut m = SpecMetrics { catch_up_tokens: 100, catch_up_secs: 0.5, ..SpecMetrics::default() };
        let mut drafted = 0;
        for step in 1..=300usize {
            let k = state.choose(&m, step);
            drafted += k;
            m.record(k, 0, 1);
            m.verify_secs += 0.01 * steep_curve(16).relative(k + 1);
        }
        assert_eq!(drafted, 0, "probed although catching up costs more than the budget");
        // Free catch-up (prompt lookup): the same schedule probes.
        let mut state = AdaptiveState::new(15, steep_curve(16), DraftCostShape::PerToken, false);
        let mut m = SpecMetrics::default();
        let probes: usize = (0..300)
            .map(|_| {
                let k = state.choose(&m, 0);
                m.record(k, 0, 1);
                m.verify_secs += 0.01 * steep_curve(16).relative(k + 1);
                usize::from(k > 0)
            })
            .sum();
        assert!((2..=8).contains(&probes), "{probes} probes");
        // Told not to probe first: no draft before the first scheduled probe.
        let mut state = AdaptiveState::new(15, flat_curve(16), DraftCostShape::PerToken, false);
        assert_eq!(state.choose(&SpecMetrics::default(), 0), 0);
    }

    #[test]
    fn a_drafter_that_cannot_afford_to_resume_is_not_stopped_by_one_unlucky_step() {
        // The 0.5B draft model for the 1.5B as measured: a draft token costs 0.4 decode steps,
        // catching up 0.07 per missed token (over the probe budget: once off, never probed
        // again), cost(2) 1.22. A probe accepted, then one rejected step: α falls to
        // about 0.6, where one token is worth about what it costs.
        let curve = Arc::new(StepCost::from_points(vec![(1, 1.0), (2, 1.22), (3, 1.5), (4, 1.77)]));
        let steps = |dear: bool| {
            let mut state = AdaptiveState::new(3, curve.clone(), DraftCostShape::PerToken, true);
            state.sources[0].draft_cost_sum = 0.4;
            state.sources[0].draft_cost_weight = 1.0;
            let mut m = SpecMetrics::default();
            if dear {
                m.catch_up_tokens = 100;
                m.catch_up_secs = 100.0 * 0.07 * 0.01;
            }
            let mut chosen = Vec::new();
            for accepted_of in [|k: usize| k, |_| 0] {
                let k = state.choose(&m, 0);
                chosen.push(k);
                m.record(k, accepted_of(k), accepted_of(k) + 1);
                m.draft_secs += 0.004 * k as f64;
                m.verify_secs += 0.01 * curve.relative(k + 1);
            }
            chosen.push(state.choose(&m, 0));
            chosen
        };
        // The probe drafts one token: a second would cost 0.4 + 0.28 steps for α² = 0.25.
        assert_eq!(steps(false), vec![1, 1, 0], "a drafter that can resume cheaply stops and probes later");
        let dear = steps(true);
        assert_eq!(&dear[..2], &[1, 1]);
        assert!(dear[2] > 0, "stopped for good after one rejected step: {dear:?}");
        // A drafter that is rarely right still stops when resuming is dear.
        let mut state = AdaptiveState::new(3, curve.clone(), DraftCostShape::PerToken, true);
        let (_, chosen) = run_costed(
            &mut |m| {
                let mut m = m.clone();
                m.catch_up_tokens = 100;
                m.catch_up_secs = 0.007;
                state.choose(&m, 0)
            },
            0.2,
            200,
            &|k| 0.004 * k as f64,
            &|k| curve.relative(k + 1),
        );
        let drafting = chosen.iter().filter(|&&k| k > 0).count();
        assert!(drafting <= 8, "drafted on {drafting} steps: {chosen:?}");
    }

    #[test]
    fn each_drafter_of_a_combined_proposer_is_priced_on_its_own() {
        // ngram+DFlash on SmolLM2 as measured: lookup finds a match on about a third of the
        // steps, is free and right 70% of the time; DFlash drafts the rest, one pass costing
        // 0.3 decode steps, right 30% of the time. Lookup's steps should draft as long as lookup
        // alone would (k = 3 at α = 0.7), and DFlash's stay off.
        let points = smollm2_points();
        let curve = Arc::new(StepCost::from_points(points.clone()));
        let simulate = |state: &mut AdaptiveState, separate: bool| {
            let mut m = SpecMetrics::default();
            let mut rng = crate::sample::SamplerRng::from_seed(5);
            let mut by_source = [Vec::new(), Vec::new()];
            for _ in 0..3000 {
                let source = usize::from(rng.next_f64() >= 0.35);
                let k = if separate { state.choose_for(source, &m, 0) } else { state.choose(&m, 0) };
                by_source[source].push(k);
                let alpha = [0.7, 0.3][source];
                let accepted = (0..k).take_while(|_| rng.next_f64() < alpha).count();
                m.record(k, accepted, accepted + 1);
                if k > 0 {
                    m.draft_secs += [0.0, 0.003][source];
                }
                m.verify_secs += 0.01 * points[k].1;
            }
            let mean = |c: &[usize]| c[500..].iter().sum::<usize>() as f64 / (c.len() - 500) as f64;
            (mean(&by_source[0]), mean(&by_source[1]), m.verify_secs + m.draft_secs, m.committed)
        };
        let shapes = [DraftCostShape::PerToken, DraftCostShape::PerDraft];
        let mut separate = AdaptiveState::with_sources(15, curve.clone(), &shapes, true);
        let (lookup_k, dflash_k, secs, generated) = simulate(&mut separate, true);
        assert!(lookup_k > 2.5 && lookup_k < 4.0, "lookup drafts {lookup_k} per step");
        assert!(dflash_k < 0.3, "DFlash drafts {dflash_k} per step");
        // One estimate over both: lookup's drafts get shorter, and the decode slower.
        let mut shared = AdaptiveState::new(15, curve, DraftCostShape::PerDraft, true);
        let (shared_lookup_k, _, shared_secs, shared_generated) = simulate(&mut shared, false);
        assert!(shared_lookup_k < lookup_k - 0.5, "shared: lookup drafts {shared_lookup_k} per step");
        let (speed, shared_speed) = (generated as f64 / secs, shared_generated as f64 / shared_secs);
        eprintln!(
            "lookup k {lookup_k} (shared {shared_lookup_k}), DFlash k {dflash_k}, {speed} vs {shared_speed} tokens/s"
        );
        assert!(speed > shared_speed * 1.05, "{speed} tokens/s apart, {shared_speed} shared");
    }

    #[test]
    fn each_drafter_of_a_combined_proposer_has_its_own_verify_excess() {
        // Lookup + DFlash where DFlash's pass between forwards makes its verify steps 1.5× what
        // the curve says and lookup's cost what it says: lookup's drafts must not be priced
        // with DFlash's excess.
        let points = smollm2_points();
        let curve = Arc::new(StepCost::from_points(points.clone()));
        let shapes = [DraftCostShape::PerToken, DraftCostShape::PerDraft];
        let mut state = AdaptiveState::with_sources(15, curve, &shapes, true);
        let mut m = SpecMetrics::default();
        let mut rng = crate::sample::SamplerRng::from_seed(9);
        for _ in 0..3000 {
            let source = usize::from(rng.next_f64() >= 0.5);
            let k = state.choose_for(source, &m, 0);
            let accepted = (0..k).take_while(|_| rng.next_f64() < [0.7, 0.5][source]).count();
            m.record(k, accepted, accepted + 1);
            let dear = if k > 0 && source == 1 { 1.5 } else { 1.0 };
            m.verify_secs += 0.01 * dear * points[k].1;
        }
        let (lookup, dflash) = (state.sources[0].verify_excess(), state.sources[1].verify_excess());
        assert!((lookup - 1.0).abs() < 0.05 && dflash > 1.3, "lookup {lookup}, DFlash {dflash}");
        let sample = state.take_excess_sample();
        assert!(sample.is_none_or(|(d, _)| d < 2), "{sample:?}");
    }

    #[test]
    fn best_len_weighs_acceptance_against_cost() {
        let (k, s) = best_len(&flat_curve(16), 15, 0.9, DraftCost::per_token(0.0), 1.0);
        assert!(k >= 8 && s > 3.0, "{k} {s}");
        assert_eq!(best_len(&steep_curve(16), 15, 0.1, DraftCost::per_token(0.3), 1.0), (0, 1.0));
    }
}
