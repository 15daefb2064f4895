//! Speculative decoding: the `Proposer` trait (one file or folder per drafter), drafts (chains
//! and trees), one pure verifier, the step-cost model, the draft planner and the statistics it
//! plans from, and a factory that builds a drafter from a `--drafter` string. Depends on `model`, `kv`, `tokenize` and `sample`, never on `engine`.

pub mod combined;
pub mod dflash;
pub mod draft;
pub mod draft_model;
pub mod eagle3;
pub mod factory;
mod fused;
pub mod metrics;
pub mod ngram;
pub mod nn;
pub mod planner;
pub mod policy;
pub mod proposer;
pub mod step_cost;
pub mod step_cost_cache;
pub mod suffix;
pub mod verify;
mod weight_cache;

pub use factory::{build_proposer, Caller, DrafterSpec, Target};
pub use metrics::SpecMetrics;
pub use policy::{parse_draft_len, parse_draft_tree, AdaptiveState, DraftLen, DraftTree};
pub use proposer::{DraftCostShape, Proposer};
pub use step_cost::{StepCost, StepCostSettings, StepCostTimer, MAX_DRAFT};
pub use verify::{verify, Draft, Verdict};
