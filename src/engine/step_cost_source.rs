//! Where the engine's step-cost curve comes from: given, read from the cache, or measured.
//!
//! Measuring the full curve takes tens of seconds on a 1.5B model, too long to keep a server
//! from answering. So a start without a cached curve times a quick one (a few sizes, few
//! rounds), serves with it, and the engine thread times the full curve while it has nothing
//! else to do ([`Refinement`]), one forward at a time, then swaps it in and caches it. Timing
//! never runs beside requests: it would slow them and read them as cost. The curve only
//! chooses draft lengths; outputs are the same with any curve.

use super::config::EngineConfig;
use super::loaded::LoadedModel;
use crate::speculative::step_cost_cache::{self, StepCostKey};
use crate::speculative::{StepCost, StepCostSettings, StepCostTimer};
use anyhow::Result;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// Where the curve the engine plans with came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepCostOrigin {
    /// `EngineConfig::step_cost`.
    Given,
    /// The cache, measured at an earlier start.
    Cached,
    /// The quick curve of this start; the full one is being timed in idle time.
    Quick,
    /// The full curve, measured by this engine.
    Measured,
}

/// The curve the engine plans with, swapped once refined; read by [`super::Engine::step_cost`].
#[derive(Debug, Default)]
pub(super) struct CurrentStepCost {
    pub cost: Option<Arc<StepCost>>,
    pub origin: Option<StepCostOrigin>,
}

pub(super) type SharedStepCost = Arc<RwLock<CurrentStepCost>>;

/// What remains to do after the start: time the full curve, and where to cache it.
pub(super) struct RefinePlan {
    settings: StepCostSettings,
    cache: Option<(PathBuf, StepCostKey)>,
}

/// The full measurement: blocks up to a full batch of decode rows (the draft budget weighs the
/// whole step), and at least a full draft.
fn full_settings(config: &EngineConfig) -> StepCostSettings {
    StepCostSettings::up_to(config.step_tokens.clamp(config.max_draft + 1, 64))
}

/// The curve to start serving with (with a drafter), and the refinement still to run.
pub(super) fn at_start(model: &LoadedModel, config: &EngineConfig) -> Result<(CurrentStepCost, Option<RefinePlan>)> {
    if let Some(cost) = &config.step_cost {
        return Ok((CurrentStepCost { cost: Some(cost.clone()), origin: Some(StepCostOrigin::Given) }, None));
    }
    let settings = full_settings(config);
    let cache = config.step_cost_dir.as_ref().and_then(|dir| {
        match StepCostKey::new(&model.model, &model.path, config.kv_dtype, &settings, dir) {
            Ok(key) => Some((dir.clone(), key)),
            Err(e) => {
                eprintln!("specula: warning: step cost not cached: {e:#}");
                None
            }
        }
    });
    if let Some((dir, key)) = &cache {
        let path = key.path_in(dir);
        if config.remeasure_step_cost {
            eprintln!("specula: step cost: measuring again as asked (the cache at {} is replaced)", path.display());
        } else {
            let t = Instant::now();
            match step_cost_cache::load(dir, key) {
                Ok(Some(cost)) => {
                    eprintln!(
                        "specula: step cost from the cache {} ({} ms; --remeasure-step-cost to measure again)",
                        path.display(),
                        t.elapsed().as_millis()
                    );
                    let current = CurrentStepCost { cost: Some(Arc::new(cost)), origin: Some(StepCostOrigin::Cached) };
                    return Ok((current, None));
                }
                Ok(None) => {}
                Err(e) => eprintln!("specula: warning: ignoring the step-cost cache: {e:#}; measuring again"),
            }
        }
    }
    let quick = StepCostSettings::quick(&settings);
    let t = Instant::now();
    let mut timer = StepCostTimer::new(&model.model, &quick, config.kv_dtype)?;
    while !timer.advance()? {}
    let cost = timer.finish();
    eprintln!(
        "specula: step cost measured quickly ({} sizes in {:.1} s); the full curve ({} sizes) is timed when idle",
        quick.sizes.len(),
        t.elapsed().as_secs_f64(),
        settings.sizes.len()
    );
    let current = CurrentStepCost { cost: Some(Arc::new(cost)), origin: Some(StepCostOrigin::Quick) };
    Ok((current, Some(RefinePlan { settings, cache })))
}

/// The full curve being timed on the engine thread, one forward per [`Self::advance`].
pub(super) struct Refinement<'m> {
    timer: StepCostTimer<'m>,
    cache: Option<(PathBuf, StepCostKey)>,
    /// Seconds spent timing so far (idle time only).
    secs: f64,
}

impl<'m> Refinement<'m> {
    pub fn new(model: &'m LoadedModel, plan: RefinePlan, config: &EngineConfig) -> Result<Self> {
        let timer = StepCostTimer::new(&model.model, &plan.settings, config.kv_dtype)?;
        Ok(Self { timer, cache: plan.cache, secs: 0.0 })
    }

    /// The engine served requests since the last forward: warm up again before timing.
    pub fn interrupted(&mut self) {
        self.timer.interrupted();
    }

    /// One forward; the full curve once the last one ran.
    pub fn advance(&mut self) -> Result<bool> {
        let t = Instant::now();
        let done = self.timer.advance();
        self.secs += t.elapsed().as_secs_f64();
        done
    }

    /// The measured curve, cached where asked (a failure to write is reported, not fatal).
    pub fn finish(self) -> StepCost {
        let sizes = self.timer.settings().sizes.len();
        let cost = self.timer.finish();
        let cached = match &self.cache {
            Some((dir, key)) => match step_cost_cache::save(dir, key, &cost, self.secs) {
                Ok(path) => format!("; cached in {}", path.display()),
                Err(e) => format!("; not cached: {e:#}"),
            },
            None => String::new(),
        };
        let points: Vec<String> = cost.points().iter().map(|(r, t)| format!("{r}: {:.1}", t * 1e3)).collect();
        eprintln!(
            "specula: step cost measured in full ({sizes} sizes in {:.1} s of idle time{cached}); rows: ms {}",
            self.secs,
            points.join(", ")
        );
        cost
    }
}
