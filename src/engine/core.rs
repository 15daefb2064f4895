//! The step loop every caller runs: the server's engine thread, `generate` (CLI, bench, tests).
//!
//! One step is four phases:
//! 1. **plan**: each decoding request bids for draft tokens; the scheduler picks the rows
//!    (decode rows, drafts where they pay, prefill chunks, admissions) within the row budget
//!    and the free KV blocks;
//! 2. **draft**: the proposers of the planned decoding requests draft;
//! 3. **forward**: one packed forward over every planned row;
//! 4. **verify and commit**: per request, the verifier keeps the agreeing prefix plus one
//!    target token, the KV cache rolls back to the committed tokens, the tokens stream to the
//!    request's sink, and the proposer observes what was committed.

use super::active::{Active, DraftChoice, EventSink, PromptLogprobs};
pub use super::config::{EngineConfig, EngineSnapshot};
use super::fleet::FleetAcceptance;
use super::kv_events::KvEventSender;
use super::request::{EngineEvent, EngineRequest, StepTrace, TokenChunk};
use super::scheduler::{SchedSeq, Scheduler, SchedulerConfig, Slot, SlotKind, StepPlan};
use super::sequence::{FinishReason, Sequence};
use super::text_stream::TextStream;
use crate::kv::{KvPool, PoolExhausted};
use crate::model::{ForwardBatch, ForwardOutput, LogitsRows, Transformer};
use crate::sample::token_logprob;
use crate::speculative::metrics::rank_outcomes;
use crate::speculative::planner::{DraftBid, DraftCost};
use crate::speculative::verify::penalize_verification_rows;
use crate::speculative::{verify, AdaptiveState, Draft, DraftLen, DraftTree, Proposer, StepCost, MAX_DRAFT};
use crate::tokenize::Tokenizer;
use anyhow::{Context, Result};
use candle_core::Tensor;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// The model side of the engine: the target, and its tokenizer when text is wanted.
#[derive(Clone, Copy)]
pub struct EngineModel<'a> {
    pub model: &'a Transformer,
    /// Detokenises outputs and applies stop strings; without it chunks carry ids only.
    pub tokenizer: Option<&'a Tokenizer>,
}

/// The engine's state and its step. Requests are added with [`EngineCore::add`], and every
/// [`EngineCore::step`] advances all of them by one forward.
pub struct EngineCore<'a> {
    target: EngineModel<'a>,
    stop_ids: Vec<u32>,
    pool: KvPool,
    sched: Scheduler<Active<'a>>,
    cost: Option<Arc<StepCost>>,
    draft_len: DraftLen,
    max_draft: usize,
    draft_tree: DraftTree,
    prefix_caching: bool,
    trace: bool,
    totals: EngineSnapshot,
    /// Requests added and not yet admitted (shared with whoever refuses new ones when full).
    queued: Arc<AtomicUsize>,
    fleet: FleetAcceptance,
    /// The context a sequence may grow to: the model's, or the configured limit below it.
    context_len: usize,
    /// The pool's event stream, for its drop counter.
    kv_events: Option<KvEventSender>,
}

/// What the forward phase produced for the verify phase.
struct StepForward {
    out: ForwardOutput,
    /// Each slot's cache length before the forward.
    cached_before: Vec<usize>,
    /// The union of the tap layers the planned requests' proposers asked for, ascending.
    tap_layers: Vec<usize>,
    secs: f64,
}

impl<'a> EngineCore<'a> {
    /// An engine over `pool`; `cost` weighs adaptive drafts (without it only fixed draft
    /// lengths draft). `queued` counts added requests not yet admitted; the engine decrements
    /// it as they leave the queue.
    pub fn new(
        target: EngineModel<'a>,
        stop_ids: Vec<u32>,
        pool: KvPool,
        config: &EngineConfig,
        cost: Option<Arc<StepCost>>,
        queued: Arc<AtomicUsize>,
    ) -> Self {
        if let Some(events) = &config.kv_events {
            pool.set_event_sink(Arc::new(events.clone()));
        }
        let stats = pool.stats();
        let target_context = target.model.config.context_len;
        let sched = Scheduler::new(SchedulerConfig {
            step_tokens: config.step_tokens,
            max_running: config.max_running,
            block_size: stats.block_size,
        });
        Self {
            target,
            stop_ids,
            pool,
            sched,
            cost,
            draft_len: config.draft_len,
            max_draft: config.max_draft.min(MAX_DRAFT),
            draft_tree: config.draft_tree,
            prefix_caching: config.prefix_caching,
            trace: config.trace,
            totals: EngineSnapshot::default(),
            queued,
            fleet: FleetAcceptance::default(),
            context_len: config.context_len(target_context),
            kv_events: config.kv_events.clone(),
        }
    }

    pub fn is_idle(&self) -> bool {
        self.sched.is_idle()
    }

    /// Plans later requests and steps with another step-cost curve (a refined one); requests
    /// already admitted keep theirs.
    pub fn set_step_cost(&mut self, cost: Option<Arc<StepCost>>) {
        self.cost = cost;
    }

    /// The pool's state and the counters so far.
    pub fn snapshot(&self) -> EngineSnapshot {
        let stats = self.pool.stats();
        let mut s = self.totals.clone();
        s.waiting = self.sched.waiting.len();
        s.running = self.sched.running.len();
        s.kv_total_blocks = stats.total_blocks;
        s.kv_free_blocks = stats.free_blocks;
        s.kv_cached_blocks = stats.cached_blocks;
        s.kv_block_size = stats.block_size;
        s.kv_events_dropped = self.kv_events.as_ref().map_or(0, KvEventSender::dropped);
        s
    }

    fn unqueue(&self, n: usize) {
        self.queued.fetch_sub(n, Ordering::SeqCst);
    }

    /// Acceptance and drafting costs seen on the requests verified so far.
    pub fn fleet_acceptance(&self) -> &FleetAcceptance {
        &self.fleet
    }

    /// Starts from acceptance seen elsewhere (an earlier engine's [`Self::fleet_acceptance`]).
    pub fn set_fleet_acceptance(&mut self, fleet: FleetAcceptance) {
        self.fleet = fleet;
    }

    /// Queues a request. `proposer` drafts for it (None: plain decoding).
    pub fn add(
        &mut self,
        req: EngineRequest,
        mut proposer: Option<Box<dyn Proposer + 'a>>,
        sink: Box<dyn EventSink + 'a>,
    ) {
        let ctx = self.context_len;
        let invalid = if req.prompt.is_empty() {
            Some("the prompt is empty".to_string())
        } else if req.prompt.len() >= ctx {
            Some(format!("the prompt has {} tokens, the context holds {ctx}", req.prompt.len()))
        } else {
            None
        };
        // Draft trees, where asked for and the drafter can: the most nodes per step.
        let max_nodes = match (self.draft_tree, proposer.as_mut()) {
            (DraftTree::Off, _) | (_, None) => None,
            (tree, Some(p)) => p.set_trees(true).then_some(match tree {
                DraftTree::Max(n) => n.min(self.max_draft),
                _ => self.max_draft,
            }),
        };
        let draft = match (&proposer, self.draft_len) {
            (None, _) => DraftChoice::None,
            (Some(_), DraftLen::Fixed(n)) => DraftChoice::Fixed(n.min(max_nodes.unwrap_or(n))),
            (Some(p), DraftLen::Auto) => match &self.cost {
                Some(cost) => {
                    let max_tokens = req.params.max_tokens.unwrap_or(ctx.saturating_sub(req.prompt.len()));
                    let shape = p.draft_cost_shape();
                    let probe = self.fleet.start_with_probe(cost, shape, self.max_draft, req.prompt.len(), max_tokens);
                    let shapes: Vec<_> = (0..p.sources()).map(|s| p.source_cost_shape(s)).collect();
                    let mut policy =
                        AdaptiveState::with_sources(max_nodes.unwrap_or(self.max_draft), cost.clone(), &shapes, probe);
                    if max_nodes.is_some() {
                        policy.enable_trees();
                    }
                    let fleet = &self.fleet;
                    policy.set_fleet_priors(|d| fleet.verify_excess(d), fleet.catch_up_secs_per_token());
                    DraftChoice::Adaptive(policy)
                }
                None => DraftChoice::None,
            },
        };
        let mut cache = self.pool.new_sequence();
        // Proposers that read the target's hidden states (DFlash) restore only what they can
        // restore themselves; the rest of the prompt runs through the target.
        let restorable = proposer.as_ref().map_or(usize::MAX, |p| p.restorable_prefix(&req.prompt));
        // Prompt log-probs need every prompt row through the target.
        let cached_prompt_tokens = if self.prefix_caching && invalid.is_none() && req.prompt_logprobs.is_none() {
            cache.attach_prefix_limited(&req.prompt, restorable)
        } else {
            0
        };
        self.totals.prefix_cache_hit_tokens += cached_prompt_tokens as u64;
        let mut active = Active {
            seq: Sequence::new(&req.prompt, cache, req.params.clone()),
            pool: self.pool.clone(),
            text: self.target.tokenizer.map(|_| TextStream::new(req.params.stop_strings.clone())),
            sink,
            proposer,
            draft,
            metrics: Default::default(),
            trace: self.trace.then(Vec::new),
            drafts_delivered: 0,
            needs_begin: true,
            admitted: false,
            preemptions: 0,
            cached_prompt_tokens,
            bid: DraftBid::default(),
            trees: max_nodes.map(|_| true),
            done: false,
            abandoned: false,
            ignore_eos: req.ignore_eos,
            logprobs: req.logprobs,
            prompt_logprobs: req.prompt_logprobs.map(|top_n| PromptLogprobs {
                top_n,
                recorded: Vec::new(),
                sent: false,
            }),
            constraint: req.constraint,
        };
        if let Some(message) = invalid {
            self.unqueue(1);
            active.fail(message);
            self.totals.failed_requests += 1;
            return;
        }
        self.sched.waiting.push_back(active);
    }

    /// A request counted as queued that never reached [`Self::add`] (its drafter could not be
    /// built).
    pub fn drop_queued(&mut self) {
        self.unqueue(1);
        self.totals.failed_requests += 1;
    }

    /// Ends every queued and running request with `Failed(message)`.
    pub fn abort_all(&mut self, message: &str) {
        let all: Vec<Active> = self.sched.waiting.drain(..).chain(self.sched.running.drain(..)).collect();
        for mut a in all {
            if !a.admitted {
                self.unqueue(1);
            }
            a.fail(message.to_string());
            self.totals.failed_requests += 1;
        }
    }

    /// Drops requests whose receiver is gone; dropping frees their KV blocks.
    pub fn reap_abandoned(&mut self) {
        let mut gone = 0;
        let mut unqueued = 0;
        self.sched.waiting.retain(|a| {
            let keep = !a.sink.is_closed();
            if !keep {
                gone += 1;
                unqueued += usize::from(!a.admitted);
            }
            keep
        });
        self.sched.running.retain(|a| {
            let keep = !a.sink.is_closed();
            gone += usize::from(!keep);
            keep
        });
        self.unqueue(unqueued);
        self.totals.cancelled_requests += gone as u64;
    }

    /// One step over every request: plan → draft → forward → verify and commit.
    pub fn step(&mut self) {
        self.reap_abandoned();
        if self.sched.is_idle() {
            return;
        }
        let started = Instant::now();
        if let Some(plan) = self.plan() {
            let mut drafts = self.draft(&plan);
            let drafted: usize = drafts.iter().map(|d| d.tokens.len()).sum();
            let accepted_before = self.totals.accepted;
            if let Some(fwd) = self.forward(&plan, &drafts) {
                self.verify_and_commit(&plan, &mut drafts, &fwd);
                tracing::debug!(
                    target: "specula::engine",
                    seqs = plan.slots.len(),
                    rows = fwd.out.row_ranges.iter().map(|r| r.len()).sum::<usize>(),
                    drafted,
                    accepted = self.totals.accepted - accepted_before,
                    forward_ms = fwd.secs * 1e3,
                    step_ms = started.elapsed().as_secs_f64() * 1e3,
                    waiting = self.sched.waiting.len(),
                    "step"
                );
            }
        }
        self.remove_done();
        self.totals.busy_secs += started.elapsed().as_secs_f64();
    }

    /// The context a sequence may grow to.
    fn context_len(&self) -> usize {
        self.context_len
    }

    /// Phase 1: draft bids, then the scheduler's plan. None when nothing runs this step.
    fn plan(&mut self) -> Option<StepPlan<Active<'a>>> {
        let ctx = self.context_len();
        for a in self.sched.running.iter_mut() {
            a.bid = DraftBid::default();
            if !a.is_decoding() {
                continue;
            }
            let room_ctx = ctx.saturating_sub(a.seq.tokens.len() + 1);
            let room_max =
                a.seq.params.max_tokens.map_or(usize::MAX, |m| m.saturating_sub(a.seq.generated().len() + 1));
            let room = room_ctx.min(room_max);
            a.bid = match &mut a.draft {
                DraftChoice::None => DraftBid::default(),
                DraftChoice::Fixed(n) => DraftBid { max_len: (*n).min(room), exact: true, ..DraftBid::default() },
                DraftChoice::Adaptive(policy) => {
                    let (source, pending) = a.proposer.as_mut().map_or((0, 0), |p| {
                        let mut source = p.next_source(&a.seq.tokens);
                        // Two drafters could draft: the one whose expected gain is larger does.
                        if let Some(other) = p.alternative_source(&a.seq.tokens) {
                            if policy.source_speedup(other) > policy.source_speedup(source) {
                                source = other;
                            }
                            p.select_source(source);
                        }
                        (source, p.pending_catch_up(&a.seq.tokens))
                    });
                    let want = policy.choose_for(source, &a.metrics, pending).min(room);
                    if let Some((drafter, excess)) = policy.take_excess_sample() {
                        self.fleet.record_excess(drafter, excess);
                    }
                    // A tree only where the best draft of this size has a runner-up in it.
                    if a.trees.is_some() {
                        a.trees = Some(policy.tree_pays(want));
                    }
                    let (own_accepted, own_tried) = policy.acceptance_counts();
                    let draft = policy.draft_cost();
                    let alpha = self.fleet.alpha_for(own_accepted, own_tried);
                    DraftBid {
                        alpha,
                        tree: policy.rank_rates(),
                        max_len: want,
                        draft_secs: DraftCost { r: draft.r * policy.step_secs(), ..draft },
                        verify_excess: policy.verify_excess(),
                        exact: policy.is_probing() && want > 0,
                    }
                }
            };
        }

        self.unpin_waiting_prefixes();
        self.attach_published_prefixes();
        let stats = self.pool.stats();
        let mut plan = self.sched.schedule(stats.free_blocks, stats.total_blocks, self.cost.as_deref());
        self.totals.preemptions += plan.preempted as u64;
        for mut a in std::mem::take(&mut plan.unfittable) {
            if !a.admitted {
                self.unqueue(1);
            }
            // Only reachable when a request outgrows the pool; the server's limits prevent it.
            a.finish(FinishReason::ContextFull);
            self.totals.finished_requests += 1;
        }
        for &i in &plan.admitted {
            let a = &mut self.sched.running[i];
            if !a.admitted {
                a.admitted = true;
                self.queued.fetch_sub(1, Ordering::SeqCst);
            }
        }
        (!plan.slots.is_empty()).then_some(plan)
    }

    /// Phase 2: proposers (re)start where needed, then draft what the plan granted. A draft is
    /// cut after a stop token: nothing after one can be committed.
    fn draft(&mut self, plan: &StepPlan<Active<'a>>) -> Vec<Draft> {
        let stop_ids = &self.stop_ids;
        plan.slots
            .iter()
            .map(|slot| {
                let a = &mut self.sched.running[slot.index];
                // The drafter's work of this step, for the fleet's cost estimates (scalars only:
                // this runs for every request every step).
                let m = &a.metrics;
                let before = (m.draft_secs, m.catch_up_tokens, m.catch_up_secs);
                let result = draft_for(a, slot, stop_ids);
                if let Ok(d) = &result {
                    let m = &a.metrics;
                    self.fleet.record_costs(
                        d.tokens.len(),
                        m.draft_secs - before.0,
                        (m.catch_up_tokens - before.1) as usize,
                        m.catch_up_secs - before.2,
                    );
                }
                result.unwrap_or_else(|e| {
                    a.fail(format!("drafter error: {e:#}"));
                    self.totals.failed_requests += 1;
                    Draft::default()
                })
            })
            .collect()
    }

    /// Phase 3: one packed forward over every planned row. None when it failed (the affected
    /// requests are dealt with here).
    fn forward(&mut self, plan: &StepPlan<Active<'a>>, drafts: &[Draft]) -> Option<StepForward> {
        // A tree's rows: the pending token follows the cache, each node its parent.
        let tree_parents: Vec<Option<Vec<u32>>> =
            drafts.iter().map(|d| d.is_tree().then(|| d.forward_parents())).collect();
        let inputs: Vec<Vec<u32>> = plan
            .slots
            .iter()
            .zip(drafts)
            .map(|(slot, d)| {
                let s = &self.sched.running[slot.index].seq;
                let start = s.cache.len();
                let mut input = s.tokens[start..start + slot.rows].to_vec();
                input.extend_from_slice(&d.tokens);
                input
            })
            .collect();
        let cached_before: Vec<usize> =
            plan.slots.iter().map(|s| self.sched.running[s.index].seq.cache.len()).collect();
        let mut tap_layers: Vec<usize> = plan
            .slots
            .iter()
            .filter_map(|s| self.sched.running[s.index].proposer.as_ref())
            .flat_map(|p| p.tap_layers().iter().copied())
            .collect();
        tap_layers.sort_unstable();
        tap_layers.dedup();

        let t = Instant::now();
        let result = {
            let mut batch = ForwardBatch::new();
            batch.tap_layers = tap_layers.clone();
            let mut slots = plan.slots.iter().zip(inputs.iter().zip(&tree_parents)).peekable();
            for (i, a) in self.sched.running.iter_mut().enumerate() {
                let Some((slot, (input, parents))) = slots.peek() else { break };
                if slot.index != i {
                    continue;
                }
                let rows = match slot.kind {
                    SlotKind::Decode { .. } => LogitsRows::All,
                    SlotKind::Prefill { .. } if a.prompt_logprobs.is_some() => LogitsRows::All,
                    SlotKind::Prefill { last: true } => LogitsRows::Last,
                    SlotKind::Prefill { last: false } => LogitsRows::None,
                };
                match parents {
                    Some(parents) => batch.push_tree(input, &mut a.seq.cache, rows, parents),
                    None => batch.push(input, &mut a.seq.cache, rows),
                }
                slots.next();
            }
            self.target.model.forward(&mut batch)
        };
        let secs = t.elapsed().as_secs_f64();
        self.totals.forward_secs += secs;
        match result {
            Ok(out) => {
                self.totals.steps += 1;
                self.totals.rows += inputs.iter().map(|i| i.len() as u64).sum::<u64>();
                Some(StepForward { out, cached_before, tap_layers, secs })
            }
            Err(e) if e.is::<PoolExhausted>() => {
                // The plan is checked against the pool, so the accounting is off somewhere:
                // free the newest sequence's blocks and plan again (a lone sequence that
                // cannot grow has outgrown the pool).
                if self.sched.running.len() > 1 {
                    if let Some(mut victim) = self.sched.running.pop() {
                        victim.release_kv();
                        self.sched.waiting.push_front(victim);
                        self.totals.preemptions += 1;
                    }
                } else if let Some(a) = self.sched.running.first_mut() {
                    a.finish(FinishReason::ContextFull);
                    self.totals.finished_requests += 1;
                }
                None
            }
            Err(e) => {
                for slot in &plan.slots {
                    self.sched.running[slot.index].fail(format!("forward failed: {e:#}"));
                    self.totals.failed_requests += 1;
                }
                None
            }
        }
    }

    /// Phase 4, for every planned request.
    fn verify_and_commit(&mut self, plan: &StepPlan<Active<'a>>, drafts: &mut [Draft], fwd: &StepForward) {
        for (j, slot) in plan.slots.iter().enumerate() {
            let draft = std::mem::take(&mut drafts[j]);
            if let Err(e) = self.verify_slot(j, slot, draft, fwd) {
                let a = &mut self.sched.running[slot.index];
                a.fail(format!("{e:#}"));
                self.totals.failed_requests += 1;
            }
        }
    }

    /// Verifies, commits, rolls back and streams one request's part of the step, then lets
    /// its proposer observe what was committed.
    fn verify_slot(&mut self, j: usize, slot: &Slot, draft: Draft, fwd: &StepForward) -> Result<()> {
        let ctx = self.context_len();
        let tokenizer = self.target.tokenizer;
        let cached_before = fwd.cached_before[j];
        let a = &mut self.sched.running[slot.index];
        if a.done {
            return Ok(());
        }
        if self.prefix_caching && matches!(slot.kind, SlotKind::Prefill { .. }) {
            a.seq.cache.publish_prefix(&a.seq.tokens[..a.seq.prompt_len]);
        }
        if matches!(slot.kind, SlotKind::Prefill { .. }) && a.prompt_logprobs.is_some() {
            record_prompt_logprobs(a, fwd, j, cached_before, slot.rows)?;
        }
        if let SlotKind::Prefill { last: false } = slot.kind {
            self.totals.prefill_tokens += slot.rows as u64;
            let taps = slot_taps(a, fwd, j, &(0..slot.rows).collect::<Vec<_>>())?;
            if let Some(p) = a.proposer.as_mut() {
                p.observe(&a.seq.tokens, cached_before..cached_before + slot.rows, &taps)?;
            }
            return Ok(());
        }
        if !matches!(slot.kind, SlotKind::Decode { .. }) {
            self.totals.prefill_tokens += slot.rows as u64;
        }

        let mut rows = if matches!(slot.kind, SlotKind::Prefill { .. }) && a.prompt_logprobs.is_some() {
            // Every row came back; the last one picks the first token.
            fwd.out.seq_logits_rows(j, slot.rows - 1..slot.rows)?
        } else {
            fwd.out.seq_logits(j)?
        };
        penalize_verification_rows(&mut rows, a.seq.generated(), &draft, &a.seq.params);
        if let Some(c) = a.constraint.as_mut() {
            if draft.is_tree() {
                c.mask_tree_rows(&mut rows, &draft.tokens, &draft.forward_parents())?;
            } else {
                c.mask_rows(&mut rows, &draft.tokens)?;
            }
        }
        let verdict = verify(&draft, &rows, &a.seq.params, &mut a.seq.rng);
        // Keep the fed pending tokens and the accepted drafts; forget rejected drafts (in a
        // tree, the accepted path moves into place first).
        let kept = cached_before + slot.rows + verdict.accepted;
        // The forward rows of the committed tokens' distributions, and of the kept K/V.
        let path_rows: Vec<usize> = verdict.rows().iter().map(|r| r + slot.rows - 1).collect();
        if draft.is_tree() {
            a.seq.cache.keep_rows(cached_before + slot.rows - 1, &verdict.rows());
        }
        a.seq.cache.truncate(kept);
        let committed = verdict.committed(&draft.tokens);
        // Row i is the distribution committed token i was chosen from.
        let logprobs = match a.logprobs {
            Some(n) => committed
                .iter()
                .zip(&path_rows)
                .map(|(&t, &r)| token_logprob(&rows[r - (slot.rows - 1)], &a.seq.params, t, n))
                .collect(),
            None => Vec::new(),
        };
        // Per depth walked: siblings tried and the rank accepted (0: the drafter's first choice).
        let ranks = rank_outcomes(&draft, &verdict);
        if !a.seq.generated().is_empty() {
            a.metrics.record_draft(&draft, verdict.accepted, committed.len(), &ranks);
            // The forward served every sequence at once; charge this one its rows' share.
            let total_rows = fwd.out.row_ranges.iter().map(|r| r.len()).sum::<usize>().max(1);
            a.metrics.verify_secs += fwd.secs * fwd.out.row_ranges[j].len() as f64 / total_rows as f64;
            if fwd.out.row_ranges.len() > 1 {
                a.metrics.shared_steps += 1;
            }
            self.totals.verify_steps += 1;
            self.totals.drafted += draft.tokens.len() as u64;
            // The fleet's α is the drafter's first choices' acceptance, as the policy's is.
            let first_accepted = ranks.iter().filter(|(_, taken)| *taken == Some(0)).count();
            self.fleet.record_positions(ranks.len(), first_accepted);
            self.totals.tree_steps += u64::from(draft.is_tree());
            self.totals.draft_steps += u64::from(!draft.tokens.is_empty());
            for rank in ranks.iter().filter_map(|&(_, taken)| taken) {
                self.totals.accepted_by_rank[rank.min(3)] += 1;
            }
            if let Some(trace) = a.trace.as_mut() {
                trace.push(StepTrace {
                    draft: draft.tokens.clone(),
                    parents: draft.parents.clone(),
                    path: if draft.is_tree() { verdict.path.clone() } else { Vec::new() },
                    accepted: verdict.accepted,
                    next_token: verdict.next_token,
                });
            }
        }

        let mut chunk = TokenChunk::default();
        let draft_ranks: Vec<usize> = ranks.iter().filter_map(|&(_, r)| r).collect();
        let finish = a.commit(&committed, logprobs, &draft_ranks, &self.stop_ids, tokenizer, ctx, &mut chunk);
        if let Some(c) = a.constraint.as_mut() {
            c.commit(&chunk.ids)?;
        }
        // A stop among the accepted drafts ends the commit early: the cache must not keep
        // K/V for tokens that were never committed.
        a.seq.cache.truncate(kept.min(a.seq.tokens.len()));
        self.totals.generated_tokens += chunk.ids.len() as u64;
        let from_draft = chunk.ids.len().min(verdict.accepted) as u64;
        a.drafts_delivered += from_draft;
        self.totals.accepted += from_draft;
        if !chunk.is_empty() {
            chunk.prompt_logprobs = a.take_prompt_logprobs();
            a.send(EngineEvent::Tokens(chunk));
        }
        match finish {
            Some(reason) => {
                a.finish(reason);
                self.totals.finished_requests += 1;
            }
            None if !a.done => {
                let tap_rows: Vec<usize> = (0..slot.rows - 1).chain(path_rows).collect();
                let taps = slot_taps(a, fwd, j, &tap_rows)?;
                if let Some(p) = a.proposer.as_mut() {
                    p.observe(&a.seq.tokens, cached_before..kept, &taps)?;
                }
            }
            None => {}
        }
        Ok(())
    }

    /// Drops finished sequences (freeing their KV blocks), counting the abandoned ones.
    fn remove_done(&mut self) {
        let mut abandoned = 0;
        self.sched.running.retain(|a| {
            abandoned += u64::from(a.abandoned);
            !a.done
        });
        self.totals.cancelled_requests += abandoned;
    }

    /// A request that found nothing in the prefix cache on arrival looks again before it is
    /// admitted: the `n` choices of one request, or requests sent together with a shared
    /// system prompt, then reuse the blocks the first of them has prefilled since.
    fn attach_published_prefixes(&mut self) {
        if !self.prefix_caching {
            return;
        }
        // Only the head of the queue, the next to be admitted: blocks pinned by requests
        // further back would be taken from the running ones, which then get preempted, and
        // from the head, which then cannot fit; the pool could go round in circles.
        for a in self.sched.waiting.iter_mut().take(1) {
            if a.admitted || !a.seq.cache.is_empty() || a.prompt_logprobs.is_some() {
                continue;
            }
            let prompt = &a.seq.tokens[..a.seq.prompt_len];
            let restorable = a.proposer.as_ref().map_or(usize::MAX, |p| p.restorable_prefix(prompt));
            let attached = a.seq.cache.attach_prefix_limited(prompt, restorable);
            a.cached_prompt_tokens = attached;
            self.totals.prefix_cache_hit_tokens += attached as u64;
        }
    }

    /// Waiting requests hold the prefix blocks they attached on arrival. With nothing running,
    /// those of the requests behind the queue head are the only thing that can keep the head
    /// from fitting: then they let go (and prefill those tokens themselves later), so the pool
    /// never deadlocks on cached prefixes.
    fn unpin_waiting_prefixes(&mut self) {
        if !self.sched.running.is_empty() {
            return;
        }
        let stats = self.pool.stats();
        let Some(head) = self.sched.waiting.front() else { return };
        let need = (head.seq.tokens.len() + 1).div_ceil(stats.block_size).saturating_sub(head.seq.cache.blocks().len());
        if need <= stats.free_blocks {
            return;
        }
        for a in self.sched.waiting.iter_mut().skip(1) {
            if !a.seq.cache.is_empty() && !a.admitted {
                a.seq.cache = self.pool.new_sequence();
                self.totals.prefix_cache_hit_tokens =
                    self.totals.prefix_cache_hit_tokens.saturating_sub(a.cached_prompt_tokens as u64);
                a.cached_prompt_tokens = 0;
            }
        }
    }
}

/// One request's part of the draft phase.
fn draft_for(a: &mut Active, slot: &Slot, stop_ids: &[u32]) -> Result<Draft> {
    let Some(p) = a.proposer.as_mut() else { return Ok(Draft::default()) };
    if a.needs_begin {
        p.begin(&a.seq.tokens)?;
        a.needs_begin = false;
    }
    let SlotKind::Decode { draft: k } = slot.kind else { return Ok(Draft::default()) };
    if k == 0 {
        return Ok(Draft::default());
    }
    let t = Instant::now();
    let caught_up = p.catch_up(&a.seq.tokens)?;
    if caught_up > 0 {
        a.metrics.catch_up_tokens += caught_up as u64;
        a.metrics.catch_up_secs += t.elapsed().as_secs_f64();
    }
    let t = Instant::now();
    if let Some(on) = a.trees {
        p.set_trees(on);
    }
    let mut d = p.propose(&a.seq.tokens, k)?;
    if d.is_tree() {
        // Nothing after a stop token can be committed, and tokens the grammar forbids would
        // only be rejected: do not spend rows on them.
        d.truncate(k);
        d.retain(|_, path| !path[..path.len() - 1].iter().any(|&t| a.is_stop(t, stop_ids)));
        if let Some(c) = a.constraint.as_mut() {
            d.retain(|_, path| c.allowed_prefix(path) == path.len());
        }
    } else {
        let stop = d.tokens.iter().position(|&t| a.is_stop(t, stop_ids));
        d.truncate(k.min(stop.map_or(usize::MAX, |i| i + 1)));
        if let Some(c) = a.constraint.as_mut() {
            let allowed = c.allowed_prefix(&d.tokens);
            d.truncate(allowed);
        }
    }
    a.metrics.draft_secs += t.elapsed().as_secs_f64();
    Ok(d)
}

/// Records the log-probs of the prompt tokens that prefill slot `j`'s rows predict (row r,
/// at position `cached_before + r`, predicts the token after it), one row at a time: a
/// prefill chunk's logits rows are large.
fn record_prompt_logprobs(
    a: &mut Active,
    fwd: &StepForward,
    j: usize,
    cached_before: usize,
    rows: usize,
) -> Result<()> {
    let prompt_len = a.seq.prompt_len;
    let Some(PromptLogprobs { top_n, recorded, sent: false }) = a.prompt_logprobs.as_mut() else { return Ok(()) };
    for r in 0..rows {
        // Prompt token `p` (1-based: token 0 has no log-prob) is recorded at index p - 1.
        let p = cached_before + r + 1;
        if p >= prompt_len {
            break;
        }
        if p != recorded.len() + 1 {
            continue;
        }
        let row = fwd.out.seq_logits_rows(j, r..r + 1)?;
        recorded.push(token_logprob(&row[0], &a.seq.params, a.seq.tokens[p], *top_n));
    }
    Ok(())
}

/// Rows `rows` of slot `j`'s taps (the committed ones), in the order its proposer asked for
/// the layers.
fn slot_taps(a: &Active, fwd: &StepForward, j: usize, rows: &[usize]) -> Result<Vec<Tensor>> {
    let Some(p) = a.proposer.as_ref() else { return Ok(Vec::new()) };
    if p.tap_layers().is_empty() {
        return Ok(Vec::new());
    }
    let all = fwd.out.seq_taps(j)?;
    // A chain's committed rows are its first ones; a tree's are gathered.
    let prefix = rows.iter().enumerate().all(|(i, &r)| i == r);
    let index = if prefix {
        None
    } else {
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        Some(Tensor::new(ids.as_slice(), all.first().map_or(&candle_core::Device::Cpu, |t| t.device()))?)
    };
    p.tap_layers()
        .iter()
        .map(|l| {
            let k = fwd.tap_layers.iter().position(|t| t == l).context("tap layer missing")?;
            Ok(match &index {
                None => all[k].narrow(0, 0, rows.len())?,
                Some(index) => all[k].index_select(index, 0)?,
            })
        })
        .collect()
}

impl<'a> From<&'a Transformer> for EngineModel<'a> {
    fn from(model: &'a Transformer) -> Self {
        Self { model, tokenizer: None }
    }
}
