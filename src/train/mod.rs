//! Training drafters (DFlash, EAGLE-3): the data they learn from, made by the target itself, the
//! target's features, and the two trainers on one kit.
//!
//! - [`data`]: `specula train data`: the target answers prompts on the batching engine and the
//!   prompt + response token ids (with a loss mask over the response) are written as JSON-line
//!   shards, resumably. Evaluation sets are refused ([`data::EVAL_SETS`]).
//! - The kit both trainers use: [`examples`] (examples and their order), [`validation`] (the
//!   fixed held-out split and the serving-shaped τ estimate), [`vocab`] (the draft vocabulary
//!   and its coverage), [`features`] (the target's tapped hidden states, online or cached in
//!   f16), [`optim`] (AdamW, the schedule), [`checkpoint`] and [`progress`] (tallies, logs,
//!   the observer).
//! - [`dflash`] and [`eagle3`]: each trainer is its objective and its run loop; export in the
//!   layouts serving (and the reference implementations) load.

pub mod checkpoint;
pub mod data;
pub mod dflash;
pub mod eagle3;
pub mod examples;
pub mod features;
pub mod optim;
pub mod progress;
pub mod validation;
pub mod vocab;
