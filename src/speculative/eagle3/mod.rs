//! EAGLE-3 chain drafting (design in `docs/eagle3.md`). `--drafter eagle3:DIR` loads
//! checkpoints in the layout vLLM, SGLang and SpecForge share and in speculators' (0.9) layout
//! (see [`config`]).
//!
//! One Llama decoder layer reads the token embedding concatenated with a feature: first the
//! fusion (`fc`) of three target hidden states, then its own previous output. Each draft token
//! costs one single-row pass and a head over the draft vocabulary.
//!
//! * [`config`]: the drafter's `config.json` in both layouts (`LlamaForCausalLMEagle3`,
//!   speculators' `Eagle3DraftModel`) and the checks against a target.
//! * [`model`]: the network ([`Eagle3Drafter`]).
//! * [`proposer`]: the [`Proposer`](crate::speculative::Proposer) with the drafter's K/V cache.

pub mod config;
pub mod model;
pub mod proposer;

pub use config::{default_aux_layer_ids, Eagle3Config};
pub use model::Eagle3Drafter;
pub use proposer::{Eagle3Proposer, Eagle3Settings};

use super::dflash::TargetHead;
use super::weight_cache::WeightCache;
use crate::model::Transformer;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Loads a drafter directory for drafting: checked against `target` (widths, vocabulary,
/// taps), its projections on the engine's 8-bit kernels.
pub fn load_for_target(dir: &Path, target: &Transformer) -> Result<Eagle3Drafter> {
    let config = Eagle3Config::from_file(&dir.join("config.json"))?;
    config
        .check_target(&target.config)
        .with_context(|| format!("EAGLE-3 drafter {} cannot draft for this target", dir.display()))?;
    let mut drafter = Eagle3Drafter::load(dir, target.device())?;
    if !drafter.has_embedding() && drafter.config.hidden != target.config.hidden {
        anyhow::bail!(
            "EAGLE-3 drafter {}: it has no `embed_tokens` and its width {} is not the target's {}",
            dir.display(),
            drafter.config.hidden,
            target.config.hidden
        );
    }
    drafter.prepare_for_serving(&crate::model::KernelSettings::from_env())?;
    Ok(drafter)
}

/// Parses the argument of `--drafter eagle3:ARG`: a drafter directory, optionally followed by
/// `,draft-max=N` (also spelled `max`; peeled off the end, so the path itself may contain commas).
pub fn parse_drafter_arg(arg: &str) -> Result<(PathBuf, Eagle3Settings)> {
    let mut settings = Eagle3Settings::default();
    let mut path = arg;
    if let Some((head, last)) = path.rsplit_once(',') {
        if let Some(("draft-max" | "max", value)) = last.split_once('=').map(|(k, v)| (k.trim(), v)) {
            let n =
                value.trim().parse::<usize>().ok().filter(|&n| n >= 1).with_context(|| {
                    format!("eagle3 setting `draft-max` needs a positive whole number, got `{value}`")
                })?;
            settings.max_draft = Some(n);
            path = head;
        }
    }
    if path.is_empty() {
        anyhow::bail!("eagle3 needs a drafter directory: --drafter eagle3:PATH[,draft-max=N]");
    }
    Ok((PathBuf::from(path), settings))
}

/// `eagle3:PATH[,draft-max=N]` as written back for labels.
pub fn drafter_label(path: &Path, settings: &Eagle3Settings) -> String {
    match settings.max_draft {
        Some(n) => format!("eagle3:{},draft-max={n}", path.display()),
        None => format!("eagle3:{}", path.display()),
    }
}

/// A fresh EAGLE-3 proposer for one sequence of `target`; the weights are loaded once per
/// process (per directory) and shared.
pub fn build_proposer(dir: &Path, settings: &Eagle3Settings, target: &Transformer) -> Result<Eagle3Proposer> {
    static LOADED: WeightCache<Eagle3Drafter> = WeightCache::new();
    let drafter = LOADED.get_or_load(
        dir,
        |d| {
            let why = || format!("EAGLE-3 drafter {} cannot draft for this target", dir.display());
            d.config.check_target(&target.config).with_context(why)
        },
        || load_for_target(dir, target),
    )?;
    let taps = drafter.config.tap_layers(target.config.n_layers);
    Eagle3Proposer::new(drafter, TargetHead::of(target), taps, settings.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafter_argument_parses_path_and_max() {
        assert_eq!(parse_drafter_arg("a/b").unwrap(), (PathBuf::from("a/b"), Eagle3Settings::default()));
        let (p, s) = parse_drafter_arg("a,b,max=4").unwrap();
        assert_eq!((p, s.max_draft), (PathBuf::from("a,b"), Some(4)));
        assert!(parse_drafter_arg("a,max=0").is_err());
        assert!(parse_drafter_arg("").is_err());
        assert_eq!(drafter_label(Path::new("d"), &Eagle3Settings { max_draft: Some(3) }), "eagle3:d,draft-max=3");
        assert_eq!(parse_drafter_arg("d,draft-max=3").unwrap().1.max_draft, Some(3));
    }
}
