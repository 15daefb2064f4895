//! Speculative decoding: the `Proposer` trait (one file per drafter) and one pure verifier.

pub mod proposer;
pub mod verify;

pub use proposer::Proposer;
pub use verify::{verify, Draft, Verdict};
