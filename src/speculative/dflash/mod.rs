//! DFlash block-diffusion drafting (design and checkpoint layout in `docs/dflash.md`).
//! `--drafter dflash:DIR` loads the drafters z-lab publishes, those SpecForge (0.2) and
//! speculators (0.9) train, and specula's own exports (see [`config`] for what each layout
//! differs in).
//!
//! A small non-causal Qwen3-style drafter proposes B − 1 tokens in one forward: the block
//! `[last committed token, MASK × (B − 1)]`, embedded with the *target's* embedding, attends to
//! the target's hidden states of the committed context (fused through `fc` + `hidden_norm` and
//! injected as keys/values in every layer) and to itself without a mask; the target's LM head
//! decodes positions 1..B − 1 by argmax.
//!
//! * [`config`]: `config.json` (`DFlashDraftModel`) in the layouts z-lab, SpecForge, specula and
//!   speculators write, and the checks against a target.
//! * [`model`]: the network ([`DflashDrafter`]) and the borrowed target head ([`TargetHead`]).
//! * [`proposer`]: the [`Proposer`](crate::speculative::Proposer) with the drafter's context cache.

pub mod config;
pub mod context_store;
pub mod model;
pub mod proposer;
#[cfg(test)]
mod tests;

pub use config::{default_target_layer_ids, DflashConfig, DflashLayout, LayerAttention};
pub use context_store::ContextStore;
pub use model::{expected_tensors, DflashDrafter, LayerKv, Packing, TargetHead};
pub use proposer::{DflashProposer, DflashSettings};

use super::weight_cache::WeightCache;
use crate::model::Transformer;
use anyhow::{Context, Result};
use candle_core::Device;
use std::path::Path;

/// Loads a drafter directory and checks it against `target` (hidden size, tapped layers, MASK
/// id); errors name the drafter and the problem. Its projections stay exact f32 (reference
/// checks); [`load_for_serving`] is what drafting loads.
pub fn load_for_target(dir: &Path, target: &Transformer, device: &Device) -> Result<DflashDrafter> {
    let config = DflashConfig::from_file(&dir.join("config.json"))?;
    config
        .check_target(&target.config)
        .with_context(|| format!("DFlash drafter {} cannot draft for this target", dir.display()))?;
    let mut drafter = DflashDrafter::load(dir, device)?;
    drafter
        .attach_target(target, &crate::model::KernelSettings::from_env())
        .with_context(|| format!("DFlash drafter {}: building its reduced LM head", dir.display()))?;
    Ok(drafter)
}

/// Parses the argument of `--drafter dflash:ARG`: a drafter directory, optionally followed by
/// `,block=N`, `,draft-max=N` (also spelled `max`) and `,window=N` (settings are peeled off the
/// end, so the path itself may contain commas).
pub fn parse_drafter_arg(arg: &str) -> Result<(std::path::PathBuf, DflashSettings)> {
    let mut settings = DflashSettings::default();
    let mut path = arg;
    while let Some((head, last)) = path.rsplit_once(',') {
        let Some((key, value)) = last.split_once('=') else { break };
        let slot = match key.trim() {
            "block" => &mut settings.block_size,
            "draft-max" | "max" => &mut settings.max_draft,
            "window" => &mut settings.context_window,
            _ => break,
        };
        let n = value
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n >= 1)
            .with_context(|| format!("dflash setting `{key}` needs a positive whole number, got `{value}`"))?;
        if slot.replace(n).is_some() {
            anyhow::bail!("dflash setting `{key}` given twice");
        }
        path = head;
    }
    if path.is_empty() {
        anyhow::bail!("dflash needs a drafter directory: --drafter dflash:PATH[,block=N][,draft-max=N][,window=N]");
    }
    if settings.block_size == Some(1) {
        anyhow::bail!("dflash block=1 leaves no room for a draft (the block holds the anchor and the masks)");
    }
    Ok((std::path::PathBuf::from(path), settings))
}

/// `dflash:PATH,...` as written back for labels (settings in a fixed order).
pub fn drafter_label(path: &Path, settings: &DflashSettings) -> String {
    let mut label = format!("dflash:{}", path.display());
    for (key, value) in
        [("block", settings.block_size), ("draft-max", settings.max_draft), ("window", settings.context_window)]
    {
        if let Some(v) = value {
            label.push_str(&format!(",{key}={v}"));
        }
    }
    label
}

/// [`load_for_target`], then the projections on the engine's 8-bit kernels: what drafting uses.
pub fn load_for_serving(dir: &Path, target: &Transformer) -> Result<DflashDrafter> {
    let mut drafter = load_for_target(dir, target, target.device())?;
    drafter.prepare_for_serving(&crate::model::KernelSettings::from_env())?;
    Ok(drafter)
}

/// A fresh DFlash proposer for one sequence of `target`. The drafter's weights are loaded once
/// per process (per directory) and shared; each proposer has its own context cache. The drafter
/// is checked against `target` every time (cheap), so one directory can serve only targets it
/// fits.
pub fn build_proposer(dir: &Path, settings: &DflashSettings, target: &Transformer) -> Result<DflashProposer> {
    static LOADED: WeightCache<DflashDrafter> = WeightCache::new();
    let drafter = LOADED.get_or_load(
        dir,
        |d| {
            let why = || format!("DFlash drafter {} cannot draft for this target", dir.display());
            d.config.check_target(&target.config).with_context(why)
        },
        || load_for_serving(dir, target),
    )?;
    DflashProposer::new(drafter, TargetHead::of(target), settings.clone())
}
