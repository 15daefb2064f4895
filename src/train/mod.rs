//! Training drafters (DFlash, EAGLE-3): the data they learn from, made by the target itself, the
//! target's features, and the trainer.
//!
//! - [`data`]: `specula train data`: the target answers prompts on the batching engine and the
//!   prompt + response token ids (with a loss mask over the response) are written as JSON-line
//!   shards, resumably. Evaluation sets are refused ([`data::EVAL_SETS`]).
//! - [`features`]: the target's tapped hidden states per token, computed on the fly or cached
//!   once in f16.
//! - [`dflash`]: `specula train dflash`: the objective, the optimiser, checkpoints and export.
//! - [`eagle3`]: `specula train eagle3`: training-time test on the same data, features and
//!   optimiser; export in the published EAGLE-3 layout.

pub mod data;
pub mod dflash;
pub mod eagle3;
pub mod features;
