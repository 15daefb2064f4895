//! The engine's settings, and the counters it publishes.

use super::kv_events::KvEventSender;
use crate::kv::KvDtype;
use crate::speculative::suffix::cache::SuffixCache;
use crate::speculative::{DraftLen, DraftTree, DrafterSpec, StepCost, MAX_DRAFT};
use std::path::PathBuf;
use std::sync::Arc;

/// Settings of the engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// KV pool capacity in tokens (shared by all requests).
    pub kv_tokens: usize,
    pub kv_dtype: KvDtype,
    /// Rows per forward: decode rows, draft rows and prefill chunks together.
    pub step_tokens: usize,
    /// Sequences decoding together at most.
    pub max_running: usize,
    /// Requests waiting for admission at most; beyond, `submit` refuses.
    pub max_waiting: usize,
    /// Server-wide drafter; each request gets its own proposer built from it.
    pub drafter: Option<DrafterSpec>,
    /// Draft length per request and step: `Auto` chooses up to `max_draft` where it pays.
    pub draft_len: DraftLen,
    /// Longest draft per request and step.
    pub max_draft: usize,
    /// Whether drafters that can draft trees do, and their most nodes per step.
    pub draft_tree: DraftTree,
    /// Step-cost curve for adaptive drafting; None = from the cache in `step_cost_dir`, else
    /// measured (with a drafter): a quick curve at start, the full one in idle time.
    pub step_cost: Option<Arc<StepCost>>,
    /// Where measured step-cost curves are kept between starts
    /// (`speculative::step_cost_cache::default_dir()` for the server); None = nothing read or
    /// written.
    pub step_cost_dir: Option<PathBuf>,
    /// Measure the step-cost curve even when the cache has one, and replace it.
    pub remeasure_step_cost: bool,
    /// Reuse the K/V of full prompt blocks already computed for an earlier request with the
    /// same leading tokens (vLLM's automatic prefix caching). Outputs are unchanged.
    pub prefix_caching: bool,
    /// Record every verify step of every request (`Completion::trace`).
    pub trace: bool,
    /// The suffix drafter's cache of recent requests; None = a fresh one with default
    /// settings where the drafter has a `suffix` part.
    pub suffix_cache: Option<Arc<SuffixCache>>,
    /// The most tokens (prompt + output) one request may have, below the model's own context
    /// (llama.cpp's `--ctx-size`, vLLM's `--max-model-len`); None = the model's context.
    pub max_model_len: Option<usize>,
    /// Where the pool reports prefix blocks published and evicted (vLLM's KV-cache events,
    /// for prefix-aware routers); None = not reported.
    pub kv_events: Option<KvEventSender>,
}

impl EngineConfig {
    /// The context a sequence may grow to on a model whose own context is `model_context`.
    pub fn context_len(&self, model_context: usize) -> usize {
        self.max_model_len.map_or(model_context, |limit| limit.min(model_context))
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_tokens: 8192,
            kv_dtype: KvDtype::F16,
            step_tokens: 256,
            max_running: 32,
            max_waiting: 64,
            drafter: None,
            draft_len: DraftLen::Auto,
            max_draft: MAX_DRAFT,
            draft_tree: DraftTree::Auto,
            step_cost: None,
            step_cost_dir: None,
            remeasure_step_cost: false,
            prefix_caching: true,
            trace: false,
            suffix_cache: None,
            max_model_len: None,
            kv_events: None,
        }
    }
}

/// Engine counters and state for metrics and health checks.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct EngineSnapshot {
    pub waiting: usize,
    pub running: usize,
    pub kv_total_blocks: usize,
    pub kv_free_blocks: usize,
    /// Blocks holding a published prompt prefix (held by a request or kept for reuse).
    pub kv_cached_blocks: usize,
    pub kv_block_size: usize,
    /// Forward steps run.
    pub steps: u64,
    /// Rows (tokens) through the forward, all kinds.
    pub rows: u64,
    /// Prompt (and recomputed) tokens prefilled.
    pub prefill_tokens: u64,
    /// Prompt tokens whose K/V came from the prefix cache instead of a prefill.
    pub prefix_cache_hit_tokens: u64,
    /// Tokens committed to requests.
    pub generated_tokens: u64,
    /// Decode (verification) steps summed over sequences.
    pub verify_steps: u64,
    /// Draft tokens verified (a tree's nodes count one each), and those accepted.
    pub drafted: u64,
    pub accepted: u64,
    /// Verify steps that had a draft (vLLM's `num_drafts`).
    pub draft_steps: u64,
    /// Verify steps whose draft was a tree.
    pub tree_steps: u64,
    /// Accepted draft tokens by sibling rank (0: the drafter's first choice; 3 and beyond
    /// counted together).
    pub accepted_by_rank: [u64; 4],
    pub preemptions: u64,
    /// Seconds spent in steps (forward + bookkeeping).
    pub busy_secs: f64,
    /// Of those, seconds in the model's forward: the rest is drafting, sampling,
    /// verification, detokenising and streaming.
    pub forward_secs: f64,
    pub finished_requests: u64,
    pub failed_requests: u64,
    pub cancelled_requests: u64,
    /// The suffix drafter's cache of recent requests (zero without one): bytes held,
    /// requests held, and requests evicted to stay within its budget.
    pub suffix_cache_bytes: usize,
    pub suffix_cache_sequences: usize,
    pub suffix_cache_evicted: u64,
    /// KV-cache events dropped because their publisher lagged.
    pub kv_events_dropped: u64,
}
