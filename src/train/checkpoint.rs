//! Checkpoints both trainers write and resume from: the trainable parameters, the AdamW
//! moments and a JSON record of the run (`OUT/checkpoint/state.{safetensors,json}`), and the
//! atomic file writes exports use.

use super::optim::{AdamW, LrSchedule};
use super::progress::LogLine;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, Var};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

/// The state a checkpoint holds besides tensors; `S` is the trainer's settings.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointMeta<S> {
    pub step: usize,
    pub total_steps: usize,
    pub settings: S,
    pub config: serde_json::Value,
    pub draft_vocab: Option<Vec<u32>>,
    pub data_examples: usize,
    /// Training time so far (seconds, all runs of this directory and the ones started from).
    pub train_secs: f64,
    pub history: Vec<LogLine>,
    /// The learning-rate schedule in force (absent in checkpoints written before schedules
    /// could be extended: rebuilt from the settings).
    #[serde(default)]
    pub schedule: Option<LrSchedule>,
    /// The data directories trained on, by name.
    #[serde(default)]
    pub data: Vec<String>,
}

/// Writes the optimiser's parameters and moments and `meta`.
pub fn save<M: Serialize>(dir: &Path, opt: &AdamW, meta: &M) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut tensors = opt.state();
    for (name, p) in opt.params() {
        tensors.insert(name.clone(), p.as_tensor().clone());
    }
    // Written to temporary names and renamed: a run killed mid-write keeps the previous one.
    let (st_tmp, json_tmp) = (dir.join("state.safetensors.tmp"), dir.join("state.json.tmp"));
    candle_core::safetensors::save(&tensors, &st_tmp)?;
    std::fs::write(&json_tmp, serde_json::to_string_pretty(meta)?)?;
    std::fs::rename(&st_tmp, dir.join("state.safetensors"))?;
    std::fs::rename(&json_tmp, dir.join("state.json"))?;
    Ok(())
}

/// A checkpoint read back: its record, and its tensors (parameters by name, moments as
/// `adam.m.NAME` / `adam.v.NAME`).
pub struct Loaded<S> {
    pub meta: CheckpointMeta<S>,
    pub tensors: HashMap<String, Tensor>,
}

impl<S> Loaded<S> {
    /// The parameters `names` (sorted: the order gradients and moments follow) as variables.
    pub fn params(&self, mut names: Vec<String>) -> Result<Vec<(String, Var)>> {
        names.sort();
        names
            .into_iter()
            .map(|n| {
                let t = self.tensors.get(&n).with_context(|| format!("the checkpoint has no `{n}`"))?;
                Ok((n, Var::from_tensor(t)?))
            })
            .collect()
    }
}

/// Reads `dir`'s checkpoint.
pub fn load<S: DeserializeOwned>(dir: &Path, device: &Device) -> Result<Loaded<S>> {
    let text = std::fs::read_to_string(dir.join("state.json"))
        .with_context(|| format!("--resume: no checkpoint in {}", dir.display()))?;
    let meta: CheckpointMeta<S> =
        serde_json::from_str(&text).with_context(|| format!("{}/state.json is not a checkpoint", dir.display()))?;
    let tensors = candle_core::safetensors::load(dir.join("state.safetensors"), device)
        .with_context(|| format!("reading {}/state.safetensors", dir.display()))?;
    if meta.step > meta.total_steps {
        bail!("{}: step {} of {} steps", dir.display(), meta.step, meta.total_steps);
    }
    Ok(Loaded { meta, tensors })
}

/// Moves a finished temporary file into place, readable by everyone (the safetensors writer
/// creates owner-only files; an exported drafter is meant to be shared).
pub fn publish(tmp: &Path, path: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o644))?;
    }
    std::fs::rename(tmp, path)?;
    Ok(())
}

/// Settings a resumed run may change (its length, how often it checkpoints, how much it
/// validates); any other difference is refused.
pub const EXTENDABLE: &[&str] = &["steps", "epochs", "checkpoint_every", "val_examples"];

/// The schedule a resumed run follows: the checkpoint's own when the run is the same length on
/// the same data (an exact continuation), else that schedule extended at the checkpoint's step
/// to `total` ([`LrSchedule::extend`]: the moments kept, no second warm-up). `schedule_of`
/// rebuilds the schedule of a checkpoint written before schedules were saved. Settings other
/// than [`EXTENDABLE`] must match.
pub fn resumed_schedule<S: Serialize>(
    meta: &CheckpointMeta<S>,
    settings: &S,
    schedule_of: impl FnOnce(&S, usize) -> LrSchedule,
    total: usize,
    examples: usize,
) -> Result<LrSchedule> {
    let differ = differing_settings(&meta.settings, settings, EXTENDABLE)?;
    if !differ.is_empty() {
        bail!(
            "--resume with other settings than the checkpoint's ({}): only {} may change when a run is extended",
            differ.join(", "),
            EXTENDABLE.join(", ")
        );
    }
    let old = meta.schedule.unwrap_or_else(|| schedule_of(&meta.settings, meta.total_steps));
    if total == meta.total_steps && examples == meta.data_examples {
        return Ok(old);
    }
    if meta.step >= total {
        bail!(
            "--resume: the checkpoint is at step {} of {}, the run would end at step {total}: give more --steps",
            meta.step,
            meta.total_steps
        );
    }
    eprintln!(
        "extending the run from step {} ({} steps, {} examples) to {total} steps on {examples} examples: the same \
         moments, the learning rate decaying from {:.2e} without a new warm-up",
        meta.step,
        meta.total_steps,
        meta.data_examples,
        old.lr(meta.step)
    );
    Ok(old.extend(meta.step, total))
}

/// The settings (top-level fields) on which `a` and `b` differ, leaving out `free` ones (what
/// an extended run may change: its length, how often it checkpoints).
pub fn differing_settings<S: Serialize>(a: &S, b: &S, free: &[&str]) -> Result<Vec<String>> {
    let (serde_json::Value::Object(a), serde_json::Value::Object(b)) =
        (serde_json::to_value(a)?, serde_json::to_value(b)?)
    else {
        bail!("settings are not a record");
    };
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).filter(|k| !free.contains(&k.as_str())).collect();
    keys.sort();
    keys.dedup();
    Ok(keys.into_iter().filter(|k| a.get(*k) != b.get(*k)).cloned().collect())
}
