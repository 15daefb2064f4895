//! DFlash block-diffusion drafting (z-lab; `docs/dflash.md`, spec in
//! `shared/docs/dflash-spec.md`).
//!
//! A small non-causal Qwen3-style drafter proposes B − 1 tokens in one forward: the block
//! `[last committed token, MASK × (B − 1)]`, embedded with the *target's* embedding, attends to
//! the target's hidden states of the committed context (fused through `fc` + `hidden_norm` and
//! injected as keys/values in every layer) and to itself without a mask; the target's LM head
//! decodes positions 1..B − 1 by argmax.
//!
//! * [`config`]: the z-lab `config.json` (`DFlashDraftModel`) and the checks against a target.
//! * [`model`]: the network ([`DflashDrafter`]) and the borrowed target head ([`TargetHead`]).
//! * [`proposer`]: the [`Proposer`](crate::spec::Proposer) with the drafter's context cache.

pub mod config;
pub mod model;
pub mod proposer;
#[cfg(test)]
mod tests;

pub use config::{default_target_layer_ids, DflashConfig, LayerAttention};
pub use model::{expected_tensors, DflashDrafter, LayerKv, TargetHead};
pub use proposer::{DflashProposer, DflashSettings};

use crate::model::Transformer;
use anyhow::{Context, Result};
use candle_core::Device;
use std::path::Path;

/// Loads a drafter directory and checks it against `target` (hidden size, tapped layers, MASK
/// id); errors name the drafter and the problem.
pub fn load_for_target(dir: &Path, target: &Transformer, device: &Device) -> Result<DflashDrafter> {
    let config = DflashConfig::from_file(&dir.join("config.json"))?;
    config.check_target(&target.config).with_context(|| format!("DFlash drafter {} cannot draft for this target", dir.display()))?;
    DflashDrafter::load(dir, device)
}
