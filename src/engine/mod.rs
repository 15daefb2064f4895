//! The engine: requests, the scheduler, and the one step loop (plan → draft → forward →
//! verify and commit) that the server, `generate`, `bench` and the tests all run.
//!
//! Speculation is not a mode: every step runs each sequence's pending token plus the k draft
//! tokens its proposer offers (k = 0 is plain decoding), verifies them with the one verifier,
//! commits the accepted prefix plus one target token, and rolls the KV cache back to the
//! committed length.
//!
//! - [`core`]: [`EngineCore`], the step loop over a batch of requests.
//! - [`handle`]: [`Engine`], the server's engine thread around it.
//! - [`generate`]: one request on the same loop (CLI, bench, tests).
//! - `scheduler` (with `speculative::planner`): which rows run in a step, and how many draft tokens each
//!   decoding request gets.

mod active;
mod config;
mod core;
mod fleet;
mod generate;
mod handle;
mod kv_events;
mod loaded;
mod request;
mod scheduler;
mod sequence;
mod step_cost_source;
mod text_stream;

pub use self::core::{EngineConfig, EngineCore, EngineModel, EngineSnapshot};
pub use crate::speculative::planner::{allocate_drafts, DraftBid};
pub use active::EventSink;
pub use fleet::FleetAcceptance;
pub use generate::{generate, GenerateOptions, Generation};
pub use handle::Engine;
pub use kv_events::{KvEventSender, KV_EVENT_QUEUE};
pub use loaded::LoadedModel;
pub use request::{
    Completion, EngineEvent, EngineRequest, StepTrace, SubmitError, TokenChunk, TokenLogprob, TokenSource, Usage,
};
pub use scheduler::{SchedSeq, Scheduler, SchedulerConfig, Slot, SlotKind, StepPlan};
pub use sequence::{FinishReason, Sequence};
pub use step_cost_source::StepCostOrigin;
pub use text_stream::TextStream;
