//! What a client hands the serving engine, and what streams back to it.

use super::sequence::FinishReason;
use crate::grammar::Constraint;
use crate::sample::SamplingParams;
pub use crate::sample::TokenLogprob;
use crate::speculative::SpecMetrics;
use serde::Serialize;

/// How a committed token was produced, for display and tracing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenSource {
    /// A draft token the target accepted.
    Draft,
    /// An accepted draft token that was not the drafter's first choice at its position: a
    /// draft tree's other branch won.
    DraftBranch,
    /// Sampled from the target (first token, correction, or bonus).
    Target,
}

/// One verify step of one request, recorded when the engine is asked to trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StepTrace {
    pub draft: Vec<u32>,
    /// A draft tree's parent rows (empty for a chain; see [`crate::speculative::Draft`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub parents: Vec<u32>,
    /// The accepted nodes, in order (a chain: the first `accepted`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub path: Vec<usize>,
    pub accepted: usize,
    /// The target's token after the accepted drafts (a bonus when all were accepted).
    pub next_token: u32,
}

/// One generation request: prompt token ids and sampling settings (already validated).
#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Let the server-wide drafter speculate for this request (when there is one).
    pub speculate: bool,
    /// Do not stop at the model's end-of-sequence tokens (only at `max_tokens`, the context,
    /// stop strings or `params.stop_token_ids`).
    pub ignore_eos: bool,
    /// Report each generated token's log-probability with this many alternatives
    /// ([`crate::sample::token_logprob`]).
    pub logprobs: Option<usize>,
    /// Report the log-probability of every prompt token after the first, with this many
    /// alternatives. The whole prompt then runs through the target (no prefix cache).
    pub prompt_logprobs: Option<usize>,
    /// The output must match this grammar (structured outputs); it masks every row the
    /// request samples or verifies from.
    pub constraint: Option<Constraint>,
    /// The caller's API key, for drafters that share what they learn only within one
    /// caller's requests (the suffix drafter's `api-key` scope).
    pub api_key: Option<String>,
}

impl EngineRequest {
    /// A request with nothing but a prompt and sampling settings.
    pub fn new(prompt: Vec<u32>, params: SamplingParams) -> Self {
        Self {
            prompt,
            params,
            speculate: true,
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
            api_key: None,
        }
    }
}

/// Tokens one step committed for one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenChunk {
    pub ids: Vec<u32>,
    pub sources: Vec<TokenSource>,
    /// `pieces[i]`: text that became safe to show after `ids[i]` (stop strings and split
    /// UTF-8 characters hold text back, so a piece can be empty or carry earlier text).
    pub pieces: Vec<String>,
    /// `logprobs[i]` belongs to `ids[i]`, when the request asked for log-probs (else empty).
    pub logprobs: Vec<TokenLogprob>,
    /// In a request's first chunk, when it asked for them: prompt tokens 1.. with their
    /// log-probs.
    pub prompt_logprobs: Vec<TokenLogprob>,
}

impl TokenChunk {
    pub fn text(&self) -> String {
        self.pieces.concat()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Token counts of a finished request; `draft_n` / `draft_n_accepted` count speculation like
/// llama.cpp's `timings`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Draft tokens proposed for this request.
    pub draft_n: u64,
    /// Draft tokens the target accepted and the request received (an accepted stop token
    /// is not counted: it ends the output instead of joining it).
    pub draft_n_accepted: u64,
    /// Target forward steps after the first token (each commits accepted drafts + 1).
    pub verify_steps: u64,
    /// Times the request's KV cache was dropped to make room and recomputed later.
    pub preemptions: u32,
    /// Prompt tokens whose K/V came from the prefix cache (OpenAI's
    /// `prompt_tokens_details.cached_tokens`).
    pub cached_prompt_tokens: usize,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub finish: FinishReason,
    /// Text released at the end (held back until then in case a stop string began there).
    pub tail: String,
    pub usage: Usage,
    /// The request's speculation counters (τ, acceptance per position, draft and verify time).
    pub metrics: SpecMetrics,
    /// Every verify step, when the engine traces (empty otherwise).
    pub trace: Vec<StepTrace>,
    /// Prompt tokens 1.. with their log-probs, when the request asked for them and no chunk
    /// carried them (the request ended before its first token).
    pub prompt_logprobs: Vec<TokenLogprob>,
}

/// Streamed to the request's receiver, in order: any number of `Tokens`, then one `Done` or
/// one `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Tokens(TokenChunk),
    Done(Box<Completion>),
    /// The request could not be completed (a drafter error, a forward error, shutdown).
    Failed(String),
}

/// Why a request was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is overloaded: {0} requests are already waiting")]
    QueueFull(usize),
    #[error("the engine has stopped")]
    Stopped,
}
