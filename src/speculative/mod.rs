//! Speculative decoding: the `Proposer` trait (one file per drafter), one pure verifier, the
//! draft-length policy, and a factory that builds a drafter from a `--drafter` string.

pub mod dflash;
pub mod draft_model;
pub mod factory;
pub mod ngram;
pub mod policy;
pub mod proposer;
pub mod verify;

pub use factory::{build_proposer, DrafterSpec};
pub use proposer::Proposer;
pub use verify::{verify, Draft, Verdict};
