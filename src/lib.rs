//! specula: an LLM inference engine built around lossless speculative decoding.
//!
//! Layers (each readable alone):
//! - [`fetch`]: models and data sets from registry packages, verified and cached.
//! - [`model`]: GGUF weights, architectures, a forward over a packed batch that returns
//!   the logits rows and hidden-state taps asked for.
//! - [`kv`]: paged KV block pool, per-sequence block tables, rollback, freeing in `Drop`.
//! - [`tokenize`]: GGUF BPE tokenizers, chat templates, streaming detokenisation.
//! - [`sample`]: sampling settings and the one sampler used by plain decoding and the verifier.
//! - [`stats`]: bootstrap intervals, shared by the benchmarks and the trainer's τ estimate.
//! - [`speculative`]: the `Proposer` trait, one file per drafter, one pure verifier.
//! - [`engine`]: the step loop (schedule → propose → forward → verify → commit).
//! - [`train`]: training data for DFlash drafters, made by the target (`specula train data`).
//! - [`server`]: the OpenAI-compatible HTTP server, its playground page and load tool.
//! - [`cli`]: the `specula` command line.

pub mod bench;
pub mod cli;
pub mod cpu_identity;
pub mod datasets;
pub mod engine;
pub mod fetch;
pub mod grammar;
pub mod kv;
pub mod model;
mod parallel;
pub mod sample;
pub mod server;
pub mod speculative;
pub mod stats;
pub mod tokenize;
pub mod train;
mod vmath;
