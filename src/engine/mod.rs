//! The step loop: schedule → propose → forward → verify → commit.
//!
//! Speculation is not a mode: every step runs the sequence's pending token plus the k draft
//! tokens its proposer offers (k = 0 is plain decoding), verifies them with the one verifier,
//! commits the accepted prefix plus one target token, and rolls the KV cache back to the
//! committed length.

mod batch_step;
mod draft_budget;
mod generate;
mod loaded;
mod metrics;
mod request;
mod scheduler;
mod sequence;
mod text_stream;

pub use batch_step::{Engine, EngineConfig, EngineSnapshot};
pub use draft_budget::{allocate_drafts, DraftBid, StepCostModel};
pub use generate::{generate, GenerateOptions, Generation, StepTrace, TokenEvent, TokenSource};
pub use loaded::LoadedModel;
pub use metrics::SpecMetrics;
pub use request::{Completion, EngineEvent, EngineRequest, SubmitError, TokenChunk, Usage};
pub use scheduler::{SchedSeq, Scheduler, SchedulerConfig, Slot, SlotKind, StepPlan};
pub use sequence::{FinishReason, Sequence};
pub use text_stream::TextStream;
