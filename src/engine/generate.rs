//! One request, start to finish, on the engine's own step loop: an [`EngineCore`] holding a
//! single request, stepped until it ends. The CLI's `generate`, `bench` and the tests run
//! exactly what `serve` runs.

use super::active::EventSink;
use super::core::{EngineConfig, EngineCore, EngineModel};
use super::fleet::FleetAcceptance;
use super::request::{Completion, EngineEvent, EngineRequest, StepTrace, TokenChunk};
use super::sequence::FinishReason;
use crate::kv::KvPool;
use crate::sample::SamplingParams;
use crate::speculative::{DraftLen, DraftTree, Proposer, SpecMetrics, StepCost, MAX_DRAFT};
use anyhow::{bail, Result};
use std::cell::RefCell;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub struct GenerateOptions {
    /// Tokens that end generation (the model's end-of-sequence ids; empty: none).
    pub stop_ids: Vec<u32>,
    /// Rows per forward: the prefill chunk.
    pub step_tokens: usize,
    /// Draft length per step (with a proposer). `Auto` needs `step_cost`.
    pub draft_len: DraftLen,
    /// Longest draft `DraftLen::Auto` may choose.
    pub max_draft: usize,
    /// Draft trees where the drafter can (`Auto`: as large as pays).
    pub draft_tree: DraftTree,
    /// The target's step-cost curve, for `DraftLen::Auto`.
    pub step_cost: Option<Arc<StepCost>>,
    /// Record every step in [`Generation::trace`].
    pub trace: bool,
    /// The grammar the output must match (structured outputs).
    pub constraint: Option<crate::grammar::Constraint>,
    /// What the drafter achieved on earlier requests: the request starts from it (as it would
    /// on a running server) and leaves its own steps in it. None: nothing is known beforehand.
    pub history: Option<Arc<Mutex<FleetAcceptance>>>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            stop_ids: Vec::new(),
            step_tokens: 512,
            draft_len: DraftLen::Fixed(0),
            max_draft: MAX_DRAFT,
            draft_tree: DraftTree::Auto,
            step_cost: None,
            trace: false,
            constraint: None,
            history: None,
        }
    }
}

impl GenerateOptions {
    /// Chains of `n` draft tokens per step.
    pub fn fixed_draft(n: usize) -> Self {
        Self { draft_len: DraftLen::Fixed(n), draft_tree: DraftTree::Off, ..Self::default() }
    }

    /// Draft trees of `n` nodes per step, from drafters that can draft them (chains from the
    /// others).
    pub fn fixed_tree(n: usize) -> Self {
        Self { draft_len: DraftLen::Fixed(n), draft_tree: DraftTree::Max(n.max(1)), ..Self::default() }
    }
}

/// Result of one generation.
#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// Detokenised output (when the engine had a tokenizer).
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Until the first token.
    pub prefill_secs: f64,
    /// After the first token.
    pub decode_secs: f64,
    pub metrics: SpecMetrics,
    pub trace: Vec<StepTrace>,
}

impl Generation {
    pub fn prefill_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }

    /// Tokens after the first, per second of decoding (the first comes from prefill).
    pub fn decode_tps(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
}

/// The history, also after a panic elsewhere left its lock poisoned (it holds only counts).
fn lock_history(h: &Mutex<FleetAcceptance>) -> std::sync::MutexGuard<'_, FleetAcceptance> {
    h.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the request's events leave behind.
#[derive(Default)]
struct Outcome {
    tokens: Vec<u32>,
    text: String,
    first_token_at: Option<Instant>,
    end: Option<Result<Completion, String>>,
}

/// `generate`'s event sink: chunks go to the caller's callback as they are committed.
struct Collector<'c> {
    on_chunk: &'c mut dyn FnMut(&TokenChunk),
    outcome: &'c RefCell<Outcome>,
}

impl EventSink for Collector<'_> {
    fn send(&mut self, event: EngineEvent) -> bool {
        let mut o = self.outcome.borrow_mut();
        match event {
            EngineEvent::Tokens(chunk) => {
                o.first_token_at.get_or_insert_with(Instant::now);
                o.tokens.extend_from_slice(&chunk.ids);
                o.text.push_str(&chunk.text());
                (self.on_chunk)(&chunk);
            }
            EngineEvent::Done(c) => {
                o.text.push_str(&c.tail);
                o.end = Some(Ok(*c));
            }
            EngineEvent::Failed(e) => o.end = Some(Err(e)),
        }
        true
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// Generates for `prompt` until a stop token or string, `max_tokens` or the context end.
/// `proposer` drafts; without one every step is plain decoding. The sequence's KV blocks come
/// from `pool` and go back to it at the end.
pub fn generate(
    target: EngineModel<'_>,
    pool: &KvPool,
    prompt: &[u32],
    params: SamplingParams,
    proposer: Option<&mut dyn Proposer>,
    opts: &GenerateOptions,
    on_chunk: &mut dyn FnMut(&TokenChunk),
) -> Result<Generation> {
    let stats = pool.stats();
    if prompt.len() + 1 > stats.total_blocks * stats.block_size {
        bail!("the prompt has {} tokens: it does not fit in the KV cache", prompt.len());
    }
    if matches!(opts.draft_len, DraftLen::Auto) && proposer.is_some() && opts.step_cost.is_none() {
        bail!("an adaptive draft length needs the target's step-cost curve");
    }
    let config = EngineConfig {
        step_tokens: opts.step_tokens.max(1),
        max_running: 1,
        draft_len: opts.draft_len,
        max_draft: opts.max_draft,
        draft_tree: opts.draft_tree,
        // One request: nothing to share, and a later run must not start from an earlier one's
        // cached prompt (bench compares runs on the same pool).
        prefix_caching: false,
        trace: opts.trace,
        ..EngineConfig::default()
    };
    let outcome = RefCell::new(Outcome::default());
    let started = Instant::now();
    {
        let mut core = EngineCore::new(
            target,
            opts.stop_ids.clone(),
            pool.clone(),
            &config,
            opts.step_cost.clone(),
            Arc::new(AtomicUsize::new(1)),
        );
        if let Some(h) = &opts.history {
            core.set_fleet_acceptance(lock_history(h).clone());
        }
        let request = EngineRequest {
            speculate: proposer.is_some(),
            constraint: opts.constraint.clone(),
            ..EngineRequest::new(prompt.to_vec(), params)
        };
        let proposer = proposer.map(|p| Box::new(p) as Box<dyn Proposer + '_>);
        core.add(request, proposer, Box::new(Collector { on_chunk, outcome: &outcome }));
        while !core.is_idle() {
            core.step();
        }
        if let Some(h) = &opts.history {
            *lock_history(h) = core.fleet_acceptance().clone();
        }
    }
    let ended = Instant::now();
    let o = outcome.into_inner();
    let completion = match o.end {
        Some(Ok(c)) => c,
        Some(Err(e)) => bail!("{e}"),
        None => bail!("the engine ended the request without a result"),
    };
    let first = o.first_token_at.unwrap_or(ended);
    Ok(Generation {
        tokens: o.tokens,
        text: o.text,
        finish: completion.finish,
        prompt_tokens: prompt.len(),
        prefill_secs: first.duration_since(started).as_secs_f64(),
        decode_secs: ended.duration_since(first).as_secs_f64(),
        metrics: completion.metrics,
        trace: completion.trace,
    })
}
