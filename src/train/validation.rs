//! Honest validation: a fixed held-out split that no training run reads, and τ estimated the
//! way serving measures it.
//!
//! **The split.** An example is held out when a hash of its `set/id` falls in one of
//! [`HELD_OUT_ONE_IN`] buckets ([`is_held_out`]). The rule depends on nothing but the example's
//! key, so it is the same for every run, every data directory and every order of shards: a
//! prompt held out once is held out always, and a drafter trained further (`--init-from`,
//! `--resume` with more data) never meets its validation examples in training. Training
//! examples whose prompt text equals a held-out one (ShareGPT repeats prompts under new ids)
//! are left out too. Each exported drafter records the rule it was trained under
//! (`training.json`, [`TrainingRecord`]); starting from a drafter trained under another rule is
//! refused, and from one that records none is allowed with a warning.
//!
//! **The estimate.** Validation τ is `committed tokens / verify steps` over the held-out
//! answers, simulating greedy serving with `k` drafted tokens per step
//! ([`simulate_verify_steps`]): each step drafts from the last committed position, keeps the
//! leading drafted tokens that equal the answer, and commits one more (the target's own). Hard
//! stretches take more steps, so they weigh as they do in serving; the old anchor estimate
//! (`1 + mean leading hits` over evenly drawn anchors) reads high.

use super::examples::TrainExample;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::Path;

/// One example in this many is held out.
pub const HELD_OUT_ONE_IN: u64 = 20;

/// The rule's name as drafters record it.
pub const VALIDATION_RULE: &str = "sha256(specula-validation:set/id) mod 20 == 0";

fn key_hash(key: &str) -> u64 {
    use sha2::Digest;
    let d = sha2::Sha256::digest(format!("specula-validation:{key}").as_bytes());
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
}

/// Whether the example `set/id` is held out.
pub fn is_held_out(key: &str) -> bool {
    key_hash(key).is_multiple_of(HELD_OUT_ONE_IN)
}

/// How a set of examples divides.
#[derive(Debug, Default)]
pub struct Split {
    pub train: Vec<TrainExample>,
    /// The held-out examples validated on (at most the cap, in a fixed order).
    pub val: Vec<TrainExample>,
    /// Held out but not validated on (over the cap).
    pub held_out_unused: usize,
    /// Training examples left out because their prompt text is a held-out one's.
    pub same_prompt_dropped: usize,
}

/// Splits `examples` by [`is_held_out`]; validation takes at most `cap` of the held-out ones
/// (by hash order: the same ones every run). `val_pool`, when given, supplies the held-out
/// examples instead (the target's answers when training on a data set's own): its held-out
/// examples are validated on and every example of `examples` held out by the rule or sharing a
/// prompt with them stays out of training.
pub fn split(examples: Vec<TrainExample>, val_pool: Option<Vec<TrainExample>>, cap: usize) -> Result<Split> {
    let (mut held, mut train): (Vec<_>, Vec<_>) = examples.into_iter().partition(|e| is_held_out(&e.key));
    if let Some(pool) = val_pool {
        held = pool.into_iter().filter(|e| is_held_out(&e.key)).collect();
    }
    let prompts: HashSet<u64> = held.iter().map(|e| e.prompt_hash).collect();
    let before = train.len();
    train.retain(|e| !prompts.contains(&e.prompt_hash));
    let same_prompt_dropped = before - train.len();
    if train.is_empty() {
        bail!("every example is held out for validation or shares a held-out prompt: nothing left to train on");
    }
    held.sort_by(|a, b| (key_hash(&a.key), &a.key).cmp(&(key_hash(&b.key), &b.key)));
    let held_out_unused = held.len().saturating_sub(cap);
    held.truncate(cap);
    train.sort_by(|a, b| a.key.cmp(&b.key));
    held.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(Split { train, val: held, held_out_unused, same_prompt_dropped })
}

/// What an exported drafter says about its training (`training.json` beside its weights).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainingRecord {
    /// The held-out rule every run that made these weights followed.
    pub validation_rule: String,
    /// Optimiser steps and seconds of training, summed over the runs that made the weights
    /// (including the ones it was started from).
    pub steps: usize,
    pub train_secs: f64,
    /// Target-feature seconds (caching them), summed likewise.
    #[serde(default)]
    pub feature_secs: f64,
    /// The data directories of each run, by name, with their example counts.
    pub runs: Vec<RecordedRun>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RecordedRun {
    pub data: Vec<String>,
    pub train_examples: usize,
    pub steps: usize,
    #[serde(default)]
    pub feature_secs: f64,
}

pub const RECORD_FILE: &str = "training.json";

impl TrainingRecord {
    /// The record of a drafter directory: None when it has none (made before records, or
    /// elsewhere).
    pub fn read(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(RECORD_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        Ok(Some(serde_json::from_str(&text).with_context(|| format!("{} is not a training record", path.display()))?))
    }

    pub fn empty() -> Self {
        Self { validation_rule: VALIDATION_RULE.into(), steps: 0, train_secs: 0.0, feature_secs: 0.0, runs: Vec::new() }
    }

    /// A directory's record without its last run (the run being resumed), and that run's
    /// feature seconds: what a resumed run adds itself to.
    pub fn without_last_run(dir: &Path) -> Result<(Option<Self>, f64)> {
        let Some(mut r) = Self::read(dir)? else { return Ok((None, 0.0)) };
        let Some(last) = r.runs.pop() else { return Ok((Some(r), 0.0)) };
        r.steps = r.steps.saturating_sub(last.steps);
        r.feature_secs = (r.feature_secs - last.feature_secs).max(0.0);
        Ok((Some(r), last.feature_secs))
    }

    /// The record of a drafter trained from `base` (None: from scratch) by one more run:
    /// `run`'s steps and feature seconds added, `train_secs` the lineage's total so far.
    pub fn extended(base: Option<&Self>, run: RecordedRun, train_secs: f64) -> Self {
        let mut r = base.cloned().unwrap_or_else(Self::empty);
        r.steps += run.steps;
        r.train_secs = train_secs;
        r.feature_secs += run.feature_secs;
        r.runs.push(run);
        r
    }

    pub fn write(&self, dir: &Path) -> Result<()> {
        std::fs::write(dir.join(RECORD_FILE), serde_json::to_string_pretty(self)? + "\n")?;
        Ok(())
    }

    /// Checks that a drafter started from (`--init-from`) was trained under this split.
    /// Returns a warning to print when it records nothing.
    pub fn check_init_from(dir: &Path) -> Result<(Option<Self>, Option<String>)> {
        match Self::read(dir)? {
            Some(r) if r.validation_rule != VALIDATION_RULE => bail!(
                "--init-from {}: trained with the held-out rule `{}`, this trainer holds out `{VALIDATION_RULE}`: \
                 its training may have read today's validation examples",
                dir.display(),
                r.validation_rule
            ),
            Some(r) => Ok((Some(r), None)),
            None => Ok((
                None,
                Some(format!(
                    "--init-from {}: no {RECORD_FILE}, so which examples it trained on is unknown; validation \
                     may read high if they include held-out ones",
                    dir.display()
                )),
            )),
        }
    }
}

/// Greedy serving simulated over one answer: `accepted(p)` is how many of the `k` tokens
/// drafted from anchor `p` (the last committed position) lead-match the answer. Starting at
/// the first response position, each verify step commits `accepted + 1` tokens. Returns
/// (committed tokens, verify steps); positions past `len − 1` end the walk.
pub fn simulate_verify_steps(first: usize, len: usize, mut accepted: impl FnMut(usize) -> usize) -> (usize, usize) {
    let (mut p, mut committed, mut steps) = (first, 0, 0);
    while p + 1 < len {
        let a = accepted(p).min(len - 1 - p);
        committed += a + 1;
        steps += 1;
        p += a + 1;
    }
    (committed, steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(key: &str, prompt: u64) -> TrainExample {
        TrainExample {
            key: key.into(),
            prompt_hash: prompt,
            tokens: vec![1, 2, 3],
            loss_mask: vec![0, 1, 1],
            source: 0,
        }
    }

    #[test]
    fn the_split_is_a_function_of_the_key_alone() {
        let keys: Vec<String> = (0..2000).map(|i| format!("sharegpt/{i}")).collect();
        let held = keys.iter().filter(|k| is_held_out(k)).count();
        // 1 in 20 of 2,000, give or take the hash's spread.
        assert!((70..130).contains(&held), "{held}");
        let a = split(keys.iter().enumerate().map(|(i, k)| ex(k, i as u64)).collect(), None, 1000).unwrap();
        let b =
            split(keys.iter().rev().enumerate().map(|(i, k)| ex(k, 5000 + i as u64)).collect(), None, 1000).unwrap();
        let names = |s: &Split| s.val.iter().map(|e| e.key.clone()).collect::<Vec<_>>();
        assert_eq!(names(&a), names(&b));
        assert_eq!(a.val.len(), held);
        assert!(a.train.iter().all(|e| !is_held_out(&e.key)));
        // A cap takes the same first ones every time.
        let c = split(keys.iter().map(|k| ex(k, 0)).collect::<Vec<_>>(), None, 10);
        assert!(c.is_err(), "every example shares the held-out prompt");
        let c = split(keys.iter().enumerate().map(|(i, k)| ex(k, i as u64)).collect(), None, 10).unwrap();
        assert_eq!(c.val.len(), 10);
        assert_eq!(c.held_out_unused, held - 10);
        assert_eq!(c.train.len(), a.train.len());
    }

    #[test]
    fn a_training_example_with_a_held_out_prompt_is_left_out() {
        let held = (0..200).map(|i| format!("s/{i}")).find(|k| is_held_out(k)).unwrap();
        let free: Vec<String> = (0..200).map(|i| format!("s/{i}")).filter(|k| !is_held_out(k)).take(3).collect();
        let examples = vec![ex(&held, 7), ex(&free[0], 7), ex(&free[1], 8), ex(&free[2], 9)];
        let s = split(examples, None, 10).unwrap();
        assert_eq!(s.same_prompt_dropped, 1);
        assert_eq!(s.train.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(), [free[1].as_str(), free[2].as_str()]);
    }

    #[test]
    fn the_walk_commits_accepted_plus_one_per_step() {
        // Nothing accepted: one token per step.
        assert_eq!(simulate_verify_steps(3, 10, |_| 0), (6, 6));
        // Everything accepted at k = 3: four tokens per step; the last step drafts past the
        // answer's end and commits what is left plus the target's own token (τ = 1 + 7/3).
        assert_eq!(simulate_verify_steps(0, 10, |_| 3), (10, 3));
        // Hard stretches take more steps: an easy half (3 accepted) and a hard half (none)
        // give τ 1.6 where the mean over anchors says 2.5.
        let (c, s) = simulate_verify_steps(0, 17, |p| if p < 8 { 3 } else { 0 });
        assert_eq!((c, s), (16, 10));
    }
}
