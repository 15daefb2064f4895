//! What a target forward costs as a function of its rows: the one step-cost model that the
//! draft-length policy, the server's draft budget and `bench` all use.
//!
//! On a CPU the curve is flat for a few rows (one weight read serves them all) and then linear
//! (compute-bound), so verifying a block of k + 1 tokens costs `secs(k + 1)`, which is what
//! every speedup is bounded by: τ / (secs(k + 1) / secs(1)).

use crate::kv::{KvDtype, SeqCache};
use crate::model::{ForwardBatch, LogitsRows, Transformer};
use anyhow::{bail, Result};
use std::time::Instant;

/// The longest draft any policy asks for, and the largest block (+1) the default measurement
/// covers: a DFlash block of 16 drafts 15 tokens.
pub const MAX_DRAFT: usize = 15;

/// Single-token steps run before any timing. Right after a prefill, one-token steps here run
/// up to twice as slow for the next ~100 ms (7–8 ms falling to 4 ms over 20–40 steps, whatever
/// the allocator's settings; the same follows 300 ms of idling), so timing one token first
/// inflated cost(1) about 1.5× and made verifying a block look that much cheaper than it is.
const WARMUP_STEPS: usize = 40;

/// How the curve is measured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepCostSettings {
    /// Tokens already cached in the one timed sequence.
    pub depth: usize,
    /// Row counts timed (ascending, starting at 1).
    pub sizes: Vec<usize>,
    /// Interleaved passes over all sizes; each size's cost is the median of its passes.
    pub rounds: usize,
}

impl StepCostSettings {
    /// The sizes a policy needs up to `max_rows` (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, …
    /// and `max_rows` itself); interpolated linearly in between.
    pub fn up_to(max_rows: usize) -> Self {
        let max_rows = max_rows.max(1);
        let mut sizes: Vec<usize> =
            [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128].into_iter().filter(|&m| m <= max_rows).collect();
        if sizes.last() != Some(&max_rows) {
            sizes.push(max_rows);
        }
        // 9 rounds: with 3, cost(4) and cost(8) measured on SmolLM2 moved by ±0.1–0.2 from one
        // run to the next, and the adaptive policy's drafting with them.
        Self { depth: 64, sizes, rounds: 9 }
    }

    /// A quick curve to serve with while the full one is measured in idle time: the sizes
    /// 1, 2, 4, 8 and 16 that `full` also times (linear between and past them), 3 rounds.
    pub fn quick(full: &Self) -> Self {
        let sizes = full.sizes.iter().copied().filter(|m| [1, 2, 4, 8, 16].contains(m)).collect();
        Self { depth: full.depth, sizes, rounds: 3 }
    }

    /// Every size from 1 to `max_rows` (for reports).
    pub fn every(max_rows: usize, depth: usize, rounds: usize) -> Self {
        Self { depth, sizes: (1..=max_rows.max(1)).collect(), rounds }
    }
}

impl Default for StepCostSettings {
    /// Blocks up to a full draft plus its pending token, on a short context.
    fn default() -> Self {
        Self::up_to(MAX_DRAFT + 1)
    }
}

/// Seconds of one forward over a number of rows that all want logits.
#[derive(Debug, Clone, PartialEq)]
pub struct StepCost {
    /// (rows, seconds), rows ascending from 1, seconds non-decreasing, per-row non-increasing.
    points: Vec<(usize, f64)>,
    /// The medians as measured, before smoothing (empty when built from points).
    measured: Vec<(usize, f64)>,
}

impl StepCost {
    /// From (rows, seconds) points; sorted, made non-decreasing (a dip is noise) and per-row
    /// cost non-increasing (m rows never cost more than m single rows; a bump is noise from a
    /// busy machine).
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
        Self { points, measured: Vec::new() }
    }

    /// A curve where every row costs as much as a decode step (nothing is known).
    pub fn linear() -> Self {
        Self::from_points(vec![(1, 1.0), (2, 2.0)])
    }

    /// Times forwards of each size (logits for every row) on top of a `depth`-token context,
    /// the way a verify step runs them, and rolls back after each.
    pub fn measure(model: &Transformer, settings: &StepCostSettings) -> Result<Self> {
        let mut timer = StepCostTimer::new(model, settings, KvDtype::F16)?;
        while !timer.advance()? {}
        Ok(timer.finish())
    }

    /// A curve from the medians as measured (smoothed as [`Self::from_points`] does).
    pub fn from_measured(measured: Vec<(usize, f64)>) -> Self {
        Self { measured: measured.clone(), ..Self::from_points(measured) }
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

    /// cost(rows) / cost(1): what a verify block of `rows` costs in decode steps.
    pub fn relative(&self, rows: usize) -> f64 {
        self.secs(rows) / self.secs(1).max(1e-12)
    }

    /// The smoothed points the estimates come from.
    pub fn points(&self) -> &[(usize, f64)] {
        &self.points
    }

    /// The raw median of each measured size (for reports; empty when built from points).
    pub fn measured(&self) -> &[(usize, f64)] {
        &self.measured
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Ordinary-looking token ids for timing runs, away from the special ones at either end of the
/// vocabulary; `salt` gives a different sequence of the same kind.
pub fn timing_filler(vocab: usize, n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|i| ((vocab / 8 + (i * 7919 + salt * 104_729) % (vocab / 2).max(1)) % vocab) as u32).collect()
}

/// Measures a curve one forward at a time, so that a caller can stop between any two (the
/// engine times in idle time and serves a request that arrives after at most one block).
/// Times forwards of each size (logits for every row) on top of a `depth`-token context of one
/// sequence, after a warm-up of single-token steps, in `rounds` interleaved passes over all
/// sizes, so that every size sees the same conditions; each size's cost is the median.
pub struct StepCostTimer<'m> {
    model: &'m Transformer,
    settings: StepCostSettings,
    cache: SeqCache,
    block: Vec<u32>,
    /// Warm-up steps still to run before the next timing.
    warm_up_left: usize,
    /// Each size's timings so far, in seconds.
    times: Vec<Vec<f64>>,
    /// The next timing: pass `round`, size `settings.sizes[size]`.
    round: usize,
    size: usize,
}

impl<'m> StepCostTimer<'m> {
    /// Prefills the context in a pool of its own (`kv_dtype`, as the engine's) and queues the
    /// warm-up.
    pub fn new(model: &'m Transformer, settings: &StepCostSettings, kv_dtype: KvDtype) -> Result<Self> {
        if settings.sizes.first() != Some(&1) || settings.sizes.windows(2).any(|w| w[0] >= w[1]) {
            bail!("the step-cost sizes must ascend from 1 row");
        }
        let settings = StepCostSettings { rounds: settings.rounds.max(1), ..settings.clone() };
        let max_m = settings.sizes.last().copied().unwrap_or(1);
        let pool = model.new_kv_pool_typed(settings.depth + max_m + 16, kv_dtype);
        let mut cache = pool.new_sequence();
        let context = timing_filler(model.config.vocab, settings.depth, 0);
        let mut batch = ForwardBatch::new();
        batch.push(&context, &mut cache, LogitsRows::None);
        model.forward(&mut batch)?;
        drop(batch);
        Ok(Self {
            model,
            block: timing_filler(model.config.vocab, max_m, 1),
            cache,
            warm_up_left: WARMUP_STEPS,
            times: vec![Vec::with_capacity(settings.rounds); settings.sizes.len()],
            round: 0,
            size: 0,
            settings,
        })
    }

    /// The model ran other work since the last step (or sat idle): warm up again before the
    /// next timing, which would otherwise read slow.
    pub fn interrupted(&mut self) {
        self.warm_up_left = WARMUP_STEPS;
    }

    /// Runs one forward (a warm-up step or one timing); true once every timing is done.
    pub fn advance(&mut self) -> Result<bool> {
        if self.is_done() {
            return Ok(true);
        }
        if self.warm_up_left > 0 {
            self.run(1)?;
            self.warm_up_left -= 1;
            return Ok(false);
        }
        let secs = self.run(self.settings.sizes[self.size])?;
        self.times[self.size].push(secs);
        self.size += 1;
        if self.size == self.settings.sizes.len() {
            (self.size, self.round) = (0, self.round + 1);
        }
        Ok(self.is_done())
    }

    pub fn is_done(&self) -> bool {
        self.round >= self.settings.rounds
    }

    pub fn settings(&self) -> &StepCostSettings {
        &self.settings
    }

    /// The curve from the medians (of the passes so far; every size has one once
    /// [`Self::advance`] returned true).
    pub fn finish(self) -> StepCost {
        let measured = self
            .settings
            .sizes
            .iter()
            .zip(self.times)
            .filter(|(_, t)| !t.is_empty())
            .map(|(&m, mut t)| (m, median(&mut t)))
            .collect();
        StepCost::from_measured(measured)
    }

    /// Seconds of one forward of `m` new tokens, rolled back after.
    fn run(&mut self, m: usize) -> Result<f64> {
        let depth = self.settings.depth;
        let t = Instant::now();
        let mut batch = ForwardBatch::new();
        batch.push(&self.block[..m], &mut self.cache, LogitsRows::All);
        let out = self.model.forward(&mut batch)?;
        let _rows = out.seq_logits(0)?;
        let secs = t.elapsed().as_secs_f64();
        drop(batch);
        self.cache.truncate(depth);
        Ok(secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CPU-like curve: flat up to 4 rows, then linear.
    pub(crate) fn cpu_curve() -> StepCost {
        StepCost::from_points(vec![(1, 10.0), (2, 10.5), (4, 11.0), (8, 20.0), (16, 38.0), (32, 74.0), (64, 146.0)])
    }

    #[test]
    fn interpolates_and_extrapolates() {
        let c = cpu_curve();
        assert_eq!(c.secs(1), 10.0);
        assert!((c.secs(3) - 10.75).abs() < 1e-9);
        assert!((c.secs(12) - 29.0).abs() < 1e-9);
        assert!((c.secs(128) - 290.0).abs() < 1e-9, "{}", c.secs(128));
        let rel: Vec<f64> = (1..=4).map(|m| c.relative(m)).collect();
        assert_eq!(rel, vec![1.0, 1.05, 1.075, 1.1]);
        // Dips are noise, and so is a block dearer than its rows one by one.
        let d = StepCost::from_points(vec![(1, 2.0), (2, 1.0), (4, 3.0)]);
        assert_eq!(d.secs(2), 2.0);
        let b = StepCost::from_points(vec![(1, 1.0), (2, 3.0), (4, 3.5)]);
        assert_eq!(b.points(), &[(1, 1.0), (2, 2.0), (4, 3.5)]);
        // Past the last point: the last segment's slope.
        let e = StepCost::from_points(vec![(1, 1.0), (2, 1.5), (3, 2.0)]);
        assert!((e.relative(5) - 3.0).abs() < 1e-12);
    }

    #[test]
    fn default_sizes_cover_a_full_draft() {
        let s = StepCostSettings::default();
        assert_eq!(s.sizes, vec![1, 2, 3, 4, 6, 8, 12, 16]);
        assert_eq!(StepCostSettings::up_to(20).sizes.last(), Some(&20));
        assert_eq!(StepCostSettings::every(4, 10, 3).sizes, vec![1, 2, 3, 4]);
        assert_eq!(StepCostSettings::quick(&StepCostSettings::up_to(64)).sizes, vec![1, 2, 4, 8, 16]);
        assert_eq!(StepCostSettings::quick(&StepCostSettings::up_to(6)).sizes, vec![1, 2, 4]);
    }
}
