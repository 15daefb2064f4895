//! The step loop: schedule → propose → forward → verify → commit.
//!
//! Speculation is not a mode: every step runs the sequence's pending token plus the k draft
//! tokens its proposer offers (k = 0 is plain decoding), verifies them with the one verifier,
//! commits the accepted prefix plus one target token, and rolls the KV cache back to the
//! committed length.

mod generate;
mod loaded;
mod metrics;
mod sequence;
mod text_stream;

pub use generate::{generate, GenerateOptions, Generation, StepTrace, TokenEvent, TokenSource};
pub use loaded::LoadedModel;
pub use metrics::SpecMetrics;
pub use sequence::{FinishReason, Sequence};
pub use text_stream::TextStream;
