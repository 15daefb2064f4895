//! Draft-length policy: fixed, or adaptive from the verify-cost curve and acceptance.
//!
//! Adaptive: a step that drafts k tokens costs `cost(k+1)` target time (the measured curve,
//! cost(1) = 1) plus `r·k` for drafting (r = draft time per drafted token relative to one target
//! decode step, measured on the fly), and commits on average `E[k] = Σ_{i=0..k} α^i` tokens
//! when each draft position is accepted with probability α given the previous ones were (the
//! geometric model of Leviathan et al.). The policy picks the k maximising
//! `E[k] / (cost(k+1) + r·k)`; plain decoding (k = 0) scores 1, so k = 0 wins whenever
//! speculation would not pay.
//! α is an exponentially weighted estimate from recent steps. While it stays at k = 0 it probes
//! with a short draft now and then (with exponential back-off), otherwise it could never learn
//! that acceptance has improved; a probe's outcome replaces the stale estimate.

use crate::engine::SpecMetrics;
use crate::model::{ForwardBatch, LogitsRows, Transformer};
use anyhow::{bail, Result};
use std::time::Instant;

/// α from counts of accepted and tried draft positions, pulled towards `prior` with the weight
/// of `prior_trials` tried positions.
pub fn alpha_estimate(accepted: f64, tried: f64, prior: f64, prior_trials: f64) -> f64 {
    (accepted + prior * prior_trials) / (tried + prior_trials)
}

/// How each step's draft length is chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftPolicy {
    /// Always ask for this many tokens (0 = plain decoding).
    Fixed(usize),
    /// Choose 0..=max per step; `curve[m - 1]` = cost(m)/cost(1) of verifying m tokens.
    Adaptive { max: usize, curve: Vec<f64> },
}

/// A parsed `--draft-len` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftLen {
    Auto,
    Fixed(usize),
}

/// Longest draft `--draft-len` accepts (and the adaptive policy's default ceiling + 1 is the
/// largest block the verify curve is measured for).
pub const MAX_DRAFT_LEN: usize = 32;

/// Default ceiling of the adaptive policy.
pub const DEFAULT_ADAPTIVE_MAX: usize = 15;

/// Parses `--draft-len N|auto`.
pub fn parse_draft_len(s: &str) -> Result<DraftLen> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("auto") {
        return Ok(DraftLen::Auto);
    }
    match s.parse::<usize>() {
        Ok(n) if n <= MAX_DRAFT_LEN => Ok(DraftLen::Fixed(n)),
        Ok(n) => bail!("--draft-len {n} is too long (at most {MAX_DRAFT_LEN})"),
        Err(_) => bail!("--draft-len must be a number of tokens or `auto`, got `{s}`"),
    }
}

impl DraftPolicy {
    /// The closure [`crate::engine::GenerateOptions::draft_len`] calls before every step. It
    /// keeps its own state, so use one per request.
    pub fn draft_len_fn(self) -> Box<dyn FnMut(&SpecMetrics) -> usize + Send> {
        match self {
            DraftPolicy::Fixed(n) => Box::new(move |_| n),
            DraftPolicy::Adaptive { max, curve } => {
                let mut state = AdaptiveState::new(max, curve);
                Box::new(move |m| state.choose(m))
            }
        }
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
    /// Steps at k = 0 before the first probe; doubled after each probe that does not turn
    /// speculation back on, up to the maximum.
    pub const PROBE_AFTER: u32 = 8;
    pub const PROBE_AFTER_MAX: u32 = 128;
    /// Draft length of a probe.
    pub const PROBE_LEN: usize = 2;
}

/// The adaptive policy's running estimates.
#[derive(Debug, Clone)]
pub struct AdaptiveState {
    max: usize,
    curve: Vec<f64>,
    /// Decayed counts of accepted draft positions and of positions tried (a position is tried
    /// when every earlier one was accepted).
    accepted: f64,
    trials: f64,
    /// Decayed draft time per drafted token, relative to one target decode step.
    draft_cost_sum: f64,
    draft_cost_weight: f64,
    /// Counters at the previous call, to recover the last step from cumulative metrics.
    last: Snapshot,
    zero_streak: u32,
    probe_after: u32,
    /// A probe was asked for and the drafter has not produced a draft yet.
    probing: bool,
    /// The acceptance evidence predates a stretch of plain decoding: the probe that ends the
    /// stretch replaces it instead of being averaged into it.
    stale: bool,
    /// The last step drafted, so the drafter had no tokens to catch up on in the next one.
    drafter_warm: bool,
}

#[derive(Debug, Clone, Copy, Default)]
struct Snapshot {
    steps: u64,
    drafted: u64,
    accepted: u64,
    draft_secs: f64,
    verify_secs: f64,
}

impl Snapshot {
    fn of(m: &SpecMetrics) -> Self {
        Self {
            steps: m.steps,
            drafted: m.drafted,
            accepted: m.accepted,
            draft_secs: m.draft_secs,
            verify_secs: m.verify_secs,
        }
    }
}

impl AdaptiveState {
    pub fn new(max: usize, curve: Vec<f64>) -> Self {
        Self {
            max,
            curve,
            accepted: 0.0,
            trials: 0.0,
            draft_cost_sum: 0.0,
            draft_cost_weight: 0.0,
            last: Snapshot::default(),
            zero_streak: 0,
            probe_after: tuning::PROBE_AFTER,
            // Start with a probe: nothing is known about this drafter on this text yet.
            probing: true,
            stale: false,
            drafter_warm: false,
        }
    }

    /// Estimated acceptance α of one draft position given the earlier ones were accepted.
    pub fn alpha(&self) -> f64 {
        alpha_estimate(self.accepted, self.trials, tuning::PRIOR_ALPHA, tuning::PRIOR_TRIALS)
    }

    /// The decayed (accepted, tried) draft-position counts behind [`Self::alpha`], for callers
    /// that bring their own prior (the server: the acceptance of its other requests).
    pub fn acceptance_counts(&self) -> (f64, f64) {
        (self.accepted, self.trials)
    }

    /// Estimated draft time per drafted token relative to one target decode step.
    pub fn draft_cost(&self) -> f64 {
        if self.draft_cost_weight > 0.0 {
            self.draft_cost_sum / self.draft_cost_weight
        } else {
            0.0
        }
    }

    /// cost(m)/cost(1), extrapolated linearly past the measured curve.
    fn cost(&self, m: usize) -> f64 {
        let c = &self.curve;
        match c.len() {
            0 => m as f64, // no curve: assume verifying is as dear as decoding each token
            _ if m == 0 => 0.0,
            n if m <= n => c[m - 1],
            1 => c[0] * m as f64,
            n => {
                let slope = (c[n - 1] - c[n - 2]).max(0.0);
                c[n - 1] + slope * (m - n) as f64
            }
        }
    }

    /// Expected speed of drafting k tokens relative to plain decoding (k = 0 scores 1).
    pub fn speedup(&self, k: usize) -> f64 {
        let a = self.alpha().clamp(0.0, 1.0);
        let expected: f64 = (0..=k).map(|i| a.powi(i as i32)).sum();
        let cost = self.cost(k + 1) / self.cost(1).max(1e-9) + self.draft_cost() * k as f64;
        expected / cost.max(1e-9)
    }

    /// The k in 0..=max with the best expected speed (shortest on ties).
    pub fn best_len(&self) -> usize {
        let mut best = (0, 1.0);
        for k in 1..=self.max {
            let s = self.speedup(k);
            if s > best.1 * (1.0 + 1e-9) {
                best = (k, s);
            }
        }
        best.0
    }

    /// Folds in the step(s) since the last call.
    fn observe(&mut self, m: &SpecMetrics) {
        let now = Snapshot::of(m);
        let prev = std::mem::replace(&mut self.last, now);
        let steps = now.steps.saturating_sub(prev.steps);
        if steps == 0 {
            return;
        }
        let drafted = now.drafted.saturating_sub(prev.drafted) as f64;
        let accepted = now.accepted.saturating_sub(prev.accepted) as f64;
        let warm = std::mem::replace(&mut self.drafter_warm, drafted > 0.0 && steps == 1);
        if drafted == 0.0 {
            return; // a plain step says nothing about the drafter
        }
        // Positions tried: the accepted ones plus the first rejected one (if any draft
        // position was left). Exact for a single step; an approximation over several.
        let tried = (accepted + steps as f64).min(drafted);
        let decay = tuning::DECAY.powi(steps as i32);
        if std::mem::take(&mut self.stale) {
            self.accepted = 0.0;
            self.trials = 0.0;
        }
        self.accepted = self.accepted * decay + accepted;
        self.trials = self.trials * decay + tried;

        // Draft time per token relative to one decode step: the verify time of this step
        // divided by the curve's cost of its block gives the time of one decode step. Only
        // from a step that follows a drafting step: after plain steps a drafter first catches
        // up on the tokens it missed (a draft model runs them all), a cost of switching
        // speculation back on that would otherwise look like the price of every draft token.
        let draft_secs = now.draft_secs - prev.draft_secs;
        let verify_secs = now.verify_secs - prev.verify_secs;
        let block = (drafted / steps as f64).round() as usize + 1;
        let one_step = verify_secs / steps as f64 / self.cost(block).max(1e-9);
        if warm && one_step > 0.0 && draft_secs >= 0.0 {
            let rel = (draft_secs / drafted) / one_step;
            self.draft_cost_sum = self.draft_cost_sum * decay + rel * drafted;
            self.draft_cost_weight = self.draft_cost_weight * decay + drafted;
        }
        self.probing = false;
    }

    /// The draft length for the next step, given the metrics so far.
    pub fn choose(&mut self, m: &SpecMetrics) -> usize {
        self.observe(m);
        if self.max == 0 {
            return 0;
        }
        if self.probing {
            return tuning::PROBE_LEN.min(self.max);
        }
        let k = self.best_len();
        if k > 0 {
            self.zero_streak = 0;
            self.probe_after = tuning::PROBE_AFTER;
            return k;
        }
        self.zero_streak += 1;
        if self.zero_streak >= self.probe_after {
            self.zero_streak = 0;
            self.probe_after = (self.probe_after * 2).min(tuning::PROBE_AFTER_MAX);
            self.probing = true;
            self.stale = true;
            return tuning::PROBE_LEN.min(self.max);
        }
        0
    }
}

/// Ordinary-looking token ids for timing runs, away from the special ones at either end of the
/// vocabulary; `salt` gives a different sequence of the same kind.
pub fn timing_filler(vocab: usize, n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|i| ((vocab / 8 + (i * 7919 + salt * 104_729) % (vocab / 2).max(1)) % vocab) as u32).collect()
}

/// Single-token steps run before any timing. Right after a prefill, one-token steps here run
/// up to twice as slow for the next ~100 ms (measured: 7–8 ms falling to 4 ms over 20–40
/// steps, whatever the allocator's settings), so timing one token first, as the curve was
/// measured before, inflated cost(1) about 1.5× and made verifying a block look that much
/// cheaper than it is.
const TIMING_WARMUP_STEPS: usize = 40;

/// Times forwards of `sizes[i]` new tokens (logits for all of them) on top of a `depth`-token
/// context of one sequence, after a warm-up of single-token steps, in `rounds` interleaved
/// passes over all sizes, so that every size sees the same conditions. Returns each size's
/// `rounds` timings in seconds.
pub fn time_blocks(model: &Transformer, depth: usize, sizes: &[usize], rounds: usize) -> Result<Vec<Vec<f64>>> {
    let max_m = sizes.iter().copied().max().unwrap_or(1).max(1);
    let filler = |n: usize, salt: usize| timing_filler(model.config.vocab, n, salt);
    let pool = model.new_kv_pool(depth + max_m + 16);
    let mut cache = pool.new_sequence();
    let context = filler(depth, 0);
    let mut batch = ForwardBatch::new();
    batch.push(&context, &mut cache, LogitsRows::None);
    model.forward(&mut batch)?;
    drop(batch);

    let block = filler(max_m, 1);
    let mut run = |m: usize| -> Result<f64> {
        let t = Instant::now();
        let mut batch = ForwardBatch::new();
        batch.push(&block[..m], &mut cache, LogitsRows::All);
        let out = model.forward(&mut batch)?;
        let _rows = out.seq_logits(0)?;
        let secs = t.elapsed().as_secs_f64();
        drop(batch);
        cache.truncate(depth);
        Ok(secs)
    };
    for _ in 0..TIMING_WARMUP_STEPS {
        run(1)?;
    }
    let mut times = vec![Vec::with_capacity(rounds); sizes.len()];
    for _ in 0..rounds.max(1) {
        for (i, &m) in sizes.iter().enumerate() {
            times[i].push(run(m.max(1))?);
        }
    }
    Ok(times)
}

/// Measures the target's verify-cost curve: `result[m - 1]` = time to run m new tokens (logits
/// for all of them) on top of a 64-token context, relative to one token. Measured at a few
/// block sizes (best of 2 each: the minimum is the least disturbed by other load) and
/// interpolated in between, made non-decreasing. Kept short: it runs when a CLI starts.
pub fn measure_verify_curve(model: &Transformer, max_m: usize) -> Result<Vec<f64>> {
    const DEPTH: usize = 64;
    const REPEATS: usize = 2;
    if max_m == 0 {
        bail!("the verify curve needs max_m >= 1");
    }
    let mut sizes: Vec<usize> =
        [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64].into_iter().filter(|&m| m <= max_m).collect();
    if sizes.last() != Some(&max_m) {
        sizes.push(max_m);
    }
    let times = time_blocks(model, DEPTH, &sizes, REPEATS)?;
    let points: Vec<(usize, f64)> =
        sizes.iter().zip(&times).map(|(&m, t)| (m, t.iter().copied().fold(f64::INFINITY, f64::min))).collect();
    Ok(interpolate_curve(&points, max_m))
}

/// `points` = (m, seconds) with m ascending starting at 1 → cost(m)/cost(1) for m in 1..=max_m,
/// linear in between, non-decreasing.
fn interpolate_curve(points: &[(usize, f64)], max_m: usize) -> Vec<f64> {
    let base = points[0].1.max(1e-12);
    let mut curve = Vec::with_capacity(max_m);
    for m in 1..=max_m {
        let hi = points.iter().position(|&(pm, _)| pm >= m).unwrap_or(points.len() - 1);
        let (m1, t1) = points[hi];
        let value = if m1 == m || hi == 0 {
            t1
        } else {
            let (m0, t0) = points[hi - 1];
            t0 + (t1 - t0) * (m - m0) as f64 / (m1 - m0) as f64
        };
        let ratio = value / base;
        let prev = curve.last().copied().unwrap_or(1.0);
        curve.push(if m == 1 { 1.0 } else { ratio.max(prev) });
    }
    curve
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `steps` steps where every draft is accepted with probability `alpha` (position by
    /// position, deterministic pseudo-randomness), drafting what the policy asks for.
    fn run(
        choose: &mut dyn FnMut(&SpecMetrics) -> usize,
        alpha: f64,
        steps: usize,
        draft_secs_per_token: f64,
    ) -> (SpecMetrics, Vec<usize>) {
        let mut m = SpecMetrics::default();
        let mut rng = crate::sample::SamplerRng::from_seed(11);
        let mut chosen = Vec::new();
        for _ in 0..steps {
            let k = choose(&m);
            chosen.push(k);
            let accepted = (0..k).take_while(|_| rng.next_f64() < alpha).count();
            m.record(k, accepted, accepted + 1);
            m.draft_secs += draft_secs_per_token * k as f64;
            m.verify_secs += 0.01 * (1.0 + 0.05 * k as f64); // a flat-ish curve, unit 10 ms
        }
        (m, chosen)
    }

    fn flat_curve(n: usize) -> Vec<f64> {
        (1..=n).map(|m| 1.0 + 0.05 * (m - 1) as f64).collect()
    }

    fn steep_curve(n: usize) -> Vec<f64> {
        // cost(4) ≈ 2.5, cost(16) ≈ 6.2: the 1.5b model on this CPU.
        (1..=n).map(|m| 1.0 + 0.5 * (m - 1) as f64 - 0.004 * ((m - 1) * (m - 1)) as f64).collect()
    }

    #[test]
    fn high_acceptance_and_a_flat_curve_draft_long() {
        let mut f = DraftPolicy::Adaptive { max: 15, curve: flat_curve(16) }.draft_len_fn();
        let (m, chosen) = run(&mut f, 0.95, 200, 0.0);
        let late = &chosen[100..];
        assert!(late.iter().all(|&k| k >= 8), "expected long drafts, got {late:?}");
        assert!(m.tau() > 5.0, "tau {}", m.tau());
    }

    #[test]
    fn low_acceptance_and_a_steep_curve_switch_speculation_off() {
        let mut f = DraftPolicy::Adaptive { max: 15, curve: steep_curve(16) }.draft_len_fn();
        let (_, chosen) = run(&mut f, 0.2, 400, 0.0);
        let late = &chosen[100..];
        let spec_steps = late.iter().filter(|&&k| k > 0).count();
        // Only probes, with back-off: a handful in 300 steps.
        assert!(spec_steps <= 6, "speculated in {spec_steps} of {} steps: {late:?}", late.len());
        assert!(late.iter().all(|&k| k <= tuning::PROBE_LEN));
    }

    #[test]
    fn keeps_probing_and_recovers_when_acceptance_improves() {
        let mut state = AdaptiveState::new(15, steep_curve(16));
        let mut m = SpecMetrics::default();
        let mut rng = crate::sample::SamplerRng::from_seed(3);
        let mut step = |state: &mut AdaptiveState, m: &mut SpecMetrics, alpha: f64| {
            let k = state.choose(m);
            let accepted = (0..k).take_while(|_| rng.next_f64() < alpha).count();
            m.record(k, accepted, accepted + 1);
            m.verify_secs += 0.01;
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
        let mut free = AdaptiveState::new(15, curve.clone());
        let mut dear = AdaptiveState::new(15, curve);
        for s in [&mut free, &mut dear] {
            s.accepted = 80.0;
            s.trials = 100.0;
            s.probing = false;
        }
        dear.draft_cost_sum = 0.5;
        dear.draft_cost_weight = 1.0;
        assert!(free.best_len() > dear.best_len(), "{} vs {}", free.best_len(), dear.best_len());
        // With α = 0.8 and drafting at half a decode step per token, 1 token still pays:
        // E[1]/cost = 1.8 / (1.05 + 0.5) > 1.
        assert!(dear.best_len() >= 1);
    }

    #[test]
    fn draft_time_is_measured_relative_to_a_decode_step() {
        let mut state = AdaptiveState::new(15, flat_curve(16));
        let mut m = SpecMetrics::default();
        state.choose(&m);
        // First drafting step: the drafter caught up on the prompt (slow); not a draft price.
        m.record(2, 2, 3);
        m.draft_secs = 0.5;
        m.verify_secs = 0.0105;
        state.choose(&m);
        assert_eq!(state.draft_cost(), 0.0);
        // Next step drafts 4 tokens in 20 ms; verifying 5 tokens took 10 ms × cost(5) = 12 ms.
        m.record(4, 2, 3);
        m.draft_secs += 0.020;
        m.verify_secs += 0.012;
        state.choose(&m);
        assert!((state.draft_cost() - 0.5).abs() < 1e-6, "{}", state.draft_cost());
        // α: 4 accepted of 2 + 3 tried (the first step's 2 decayed once), plus the prior.
        let (acc, tried) = (2.0 * tuning::DECAY + 2.0, 2.0 * tuning::DECAY + 3.0);
        assert!((state.alpha() - (acc + 0.5) / (tried + 1.0)).abs() < 1e-9, "{}", state.alpha());
        // A plain step in between makes the next drafting step cold again.
        m.record(0, 0, 1);
        m.verify_secs += 0.01;
        state.choose(&m);
        m.record(4, 4, 5);
        m.draft_secs += 1.0;
        m.verify_secs += 0.012;
        state.choose(&m);
        assert!((state.draft_cost() - 0.5).abs() < 1e-6, "cold step ignored: {}", state.draft_cost());
    }

    #[test]
    fn fixed_policy_and_parsing() {
        let mut f = DraftPolicy::Fixed(5).draft_len_fn();
        assert_eq!(f(&SpecMetrics::default()), 5);
        assert_eq!(parse_draft_len("auto").unwrap(), DraftLen::Auto);
        assert_eq!(parse_draft_len("AUTO").unwrap(), DraftLen::Auto);
        assert_eq!(parse_draft_len("4").unwrap(), DraftLen::Fixed(4));
        assert_eq!(parse_draft_len("0").unwrap(), DraftLen::Fixed(0));
        assert!(parse_draft_len("-1").is_err());
        assert!(parse_draft_len("x").is_err());
        assert!(parse_draft_len("1000").is_err());
    }

    #[test]
    fn curve_interpolation_is_linear_and_non_decreasing() {
        let c = interpolate_curve(&[(1, 2.0), (2, 3.0), (4, 5.0), (8, 4.0)], 10);
        assert_eq!(c.len(), 10);
        assert_eq!(&c[..4], &[1.0, 1.5, 2.0, 2.5]);
        // The dip at 8 is noise: held at 2.5, and past the last point held flat.
        assert!(c[4..].iter().all(|&x| (x - 2.5).abs() < 1e-12), "{c:?}");
        let state = AdaptiveState::new(4, vec![1.0, 1.5, 2.0]);
        assert!((state.cost(5) - 3.0).abs() < 1e-12, "extrapolates with the last slope");
    }
}
