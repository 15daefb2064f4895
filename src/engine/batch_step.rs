//! The serving engine: one thread that owns the KV pool and runs every request, fed by a
//! channel. Each step is schedule → propose → one packed forward → per-sequence verify →
//! commit / rollback → stream, the single-sequence loop of [`super::generate`] batched:
//! decoding sequences bring their pending token plus their draft, prefilling ones a chunk of
//! their prompt, all in one forward.

use super::draft_budget::{DraftBid, StepCostModel};
use super::generate::{commit, TokenEvent, TokenSource};
use super::loaded::LoadedModel;
use super::metrics::SpecMetrics;
use super::request::{Completion, EngineEvent, EngineRequest, SubmitError, TokenChunk, Usage};
use super::scheduler::{SchedSeq, Scheduler, SchedulerConfig, Slot, SlotKind};
use super::sequence::{FinishReason, Sequence};
use super::text_stream::TextStream;
use crate::kv::{KvDtype, KvPool, PoolExhausted};
use crate::model::{ForwardBatch, ForwardOutput, LogitsRows};
use crate::speculative::policy::{alpha_estimate, AdaptiveState};
use crate::speculative::verify::penalize_verification_rows;
use crate::speculative::{build_proposer, verify, Draft, DrafterSpec, Proposer};
use anyhow::{Context, Result};
use candle_core::Tensor;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// Settings of the serving engine.
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
    /// Longest draft per sequence and step.
    pub max_draft: usize,
    /// Step-cost curve for the draft budget; None = measured at start (with a drafter).
    pub step_cost: Option<StepCostModel>,
    /// Reuse the K/V of full prompt blocks already computed for an earlier request with the
    /// same leading tokens (vLLM's automatic prefix caching). Outputs are unchanged.
    pub prefix_caching: bool,
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
            max_draft: 8,
            step_cost: None,
            prefix_caching: true,
        }
    }
}

/// Engine state for metrics and health checks, published after every step (reading the pool
/// itself would wait for a running forward).
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
    pub drafted: u64,
    pub accepted: u64,
    pub preemptions: u64,
    /// Seconds spent in steps (forward + bookkeeping).
    pub busy_secs: f64,
    /// Of those, seconds in the model's forward: the rest is drafting, sampling,
    /// verification, detokenising and streaming.
    pub forward_secs: f64,
    pub finished_requests: u64,
    pub failed_requests: u64,
    pub cancelled_requests: u64,
}

enum Command {
    Submit(Box<EngineRequest>, UnboundedSender<EngineEvent>),
    /// Ends every request with this message (shutdown after the grace period).
    AbortAll(String),
    Stop,
}

struct Shared {
    /// Requests submitted and not yet admitted (or gone).
    queued: AtomicUsize,
    snapshot: Mutex<EngineSnapshot>,
}

/// Handle to the engine thread. Dropping it stops the thread (requests still running end).
pub struct Engine {
    model: Arc<LoadedModel>,
    config: EngineConfig,
    commands: Sender<Command>,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    kv_capacity: usize,
    cost: Option<StepCostModel>,
}

impl Engine {
    /// Builds the KV pool (and, with a drafter, checks it and measures the step-cost curve)
    /// and starts the engine thread.
    pub fn start(model: Arc<LoadedModel>, config: EngineConfig) -> Result<Self> {
        let pool = model.model.new_kv_pool_typed(config.kv_tokens.max(1), config.kv_dtype);
        let stats = pool.stats();
        let kv_capacity = stats.total_blocks * stats.block_size;
        let cost = match &config.drafter {
            Some(spec) => {
                // Fail at start, not on the first request, and load a draft model's weights now.
                build_proposer(spec, &model).with_context(|| format!("drafter {}", spec.label()))?;
                match &config.step_cost {
                    Some(c) => Some(c.clone()),
                    None => Some(StepCostModel::measure(&model.model, config.step_tokens.clamp(1, 64))?),
                }
            }
            None => None,
        };
        let sched = Scheduler::new(SchedulerConfig {
            step_tokens: config.step_tokens,
            max_running: config.max_running,
            block_size: stats.block_size,
        });
        let shared = Arc::new(Shared {
            queued: AtomicUsize::new(0),
            snapshot: Mutex::new(EngineSnapshot {
                kv_total_blocks: stats.total_blocks,
                kv_free_blocks: stats.free_blocks,
                kv_block_size: stats.block_size,
                ..Default::default()
            }),
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let curve = cost.as_ref().map(|c| c.relative_curve(config.max_draft + 1)).unwrap_or_default();
        let engine_cost = cost.clone();
        let worker = Worker {
            stop_ids: model.stop_ids(),
            model: model.clone(),
            pool,
            sched,
            commands: rx,
            shared: shared.clone(),
            cost,
            curve,
            drafter: config.drafter.clone(),
            max_draft: config.max_draft,
            prefix_caching: config.prefix_caching,
            totals: EngineSnapshot::default(),
            fleet: FleetAcceptance::default(),
        };
        let thread = std::thread::Builder::new().name("specula-engine".into()).spawn(move || worker.run())?;
        Ok(Self {
            model,
            config,
            commands: tx,
            shared,
            thread: Mutex::new(Some(thread)),
            kv_capacity,
            cost: engine_cost,
        })
    }

    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The most tokens (prompt + output) one request can have: the model's context, or the
    /// KV pool's capacity if smaller.
    pub fn context_limit(&self) -> usize {
        self.model.model.config.context_len.min(self.kv_capacity)
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the request and frees its KV blocks at the next step boundary.
    pub fn submit(&self, request: EngineRequest) -> Result<UnboundedReceiver<EngineEvent>, SubmitError> {
        let queued = self.shared.queued.fetch_add(1, Ordering::SeqCst);
        if queued >= self.config.max_waiting {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(queued));
        }
        let (tx, rx) = unbounded_channel();
        if self.commands.send(Command::Submit(Box::new(request), tx)).is_err() {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Stopped);
        }
        Ok(rx)
    }

    /// The step-cost curve measured at start (with a drafter): (rows, seconds) points.
    pub fn step_cost(&self) -> Option<&StepCostModel> {
        self.cost.as_ref()
    }

    pub fn snapshot(&self) -> EngineSnapshot {
        self.shared.snapshot.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Ends every queued and running request with `Failed(message)`.
    pub fn abort_all(&self, message: &str) {
        let _ = self.commands.send(Command::AbortAll(message.to_string()));
    }

    /// Stops the engine thread and waits for it.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Stop);
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One request inside the engine.
struct Active {
    seq: Sequence,
    pool: KvPool,
    text: TextStream,
    sink: UnboundedSender<EngineEvent>,
    proposer: Option<Box<dyn Proposer>>,
    policy: Option<AdaptiveState>,
    metrics: SpecMetrics,
    /// Accepted draft tokens that were committed (a stop token ends a commit early).
    drafts_delivered: u64,
    /// The proposer must (re)start from the committed tokens before the next forward.
    needs_begin: bool,
    /// Admitted at least once (it no longer counts as queued).
    admitted: bool,
    preemptions: u32,
    /// Prompt tokens attached from the prefix cache at arrival.
    cached_prompt_tokens: usize,
    bid: DraftBid,
    /// Finished, failed or abandoned: removed (and its KV freed) at the end of the step.
    done: bool,
    /// Its receiver went away (a client that disconnected).
    abandoned: bool,
    /// End-of-sequence tokens do not end this request.
    ignore_eos: bool,
}

impl SchedSeq for Active {
    fn cached(&self) -> usize {
        self.seq.cache.len()
    }
    fn total(&self) -> usize {
        self.seq.tokens.len()
    }
    fn blocks_held(&self) -> usize {
        self.seq.cache.blocks().len()
    }
    fn release_kv(&mut self) {
        self.seq.cache = self.pool.new_sequence();
        self.needs_begin = true;
        self.preemptions += 1;
    }
    fn draft_bid(&self) -> DraftBid {
        self.bid
    }
}

impl Active {
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.seq.prompt_len,
            completion_tokens: self.seq.generated().len(),
            draft_n: self.metrics.drafted,
            draft_n_accepted: self.drafts_delivered,
            verify_steps: self.metrics.steps,
            preemptions: self.preemptions,
            cached_prompt_tokens: self.cached_prompt_tokens,
        }
    }

    fn send(&mut self, event: EngineEvent) {
        if self.sink.send(event).is_err() {
            self.done = true;
            self.abandoned = true;
        }
    }

    fn finish(&mut self, finish: FinishReason) {
        let tail = self.text.finish();
        let usage = self.usage();
        self.send(EngineEvent::Done(Completion { finish, tail, usage }));
        self.done = true;
    }

    fn fail(&mut self, message: String) {
        self.send(EngineEvent::Failed(message));
        self.done = true;
    }
}

struct Worker {
    model: Arc<LoadedModel>,
    pool: KvPool,
    sched: Scheduler<Active>,
    commands: Receiver<Command>,
    shared: Arc<Shared>,
    cost: Option<StepCostModel>,
    /// Single-sequence verify curve for the per-request draft policies.
    curve: Vec<f64>,
    drafter: Option<DrafterSpec>,
    max_draft: usize,
    prefix_caching: bool,
    stop_ids: Vec<u32>,
    totals: EngineSnapshot,
    /// Acceptance seen across all requests: the prior for each request's own estimate.
    fleet: FleetAcceptance,
}

/// Decayed counts of accepted draft positions and positions tried, over every request the
/// engine has verified. A new request has no acceptance history of its own; starting it from
/// what this drafter achieves on this server's traffic, rather than from a fixed guess plus
/// optimism, keeps short requests from over-drafting when acceptance is poor, which at high
/// load made speculation slower than plain batching.
#[derive(Debug, Clone, Default)]
struct FleetAcceptance {
    accepted: f64,
    tried: f64,
}

impl FleetAcceptance {
    /// Half-life of about 350 draft positions: follows a change of traffic within seconds.
    const DECAY: f64 = 0.998;
    /// Weight, in tried positions, the fleet estimate gets in a request's own estimate.
    const PRIOR_WEIGHT: f64 = 4.0;

    fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        // Positions tried: the accepted ones and the first rejected one, if any.
        let tried = (accepted + 1).min(drafted) as f64;
        let decay = Self::DECAY.powf(tried);
        self.accepted = self.accepted * decay + accepted as f64;
        self.tried = self.tried * decay + tried;
    }

    /// Upper confidence bound on α: optimistic while the server has seen few drafts (so
    /// speculation gets tried at all), converging on the observed rate.
    fn alpha(&self) -> f64 {
        let mean = (self.accepted + 0.5) / (self.tried + 1.0);
        (mean + 1.0 / (1.0 + self.tried).sqrt()).min(1.0)
    }

    /// A request's α: its own decayed counts, with the fleet estimate as prior.
    fn alpha_for(&self, own_accepted: f64, own_tried: f64) -> f64 {
        alpha_estimate(own_accepted, own_tried, self.alpha(), Self::PRIOR_WEIGHT)
    }
}

impl Worker {
    fn run(mut self) {
        loop {
            if self.sched.is_idle() {
                match self.commands.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
            while let Ok(cmd) = self.commands.try_recv() {
                if !self.handle(cmd) {
                    return;
                }
            }
            self.reap_abandoned();
            if !self.sched.is_idle() {
                let t = Instant::now();
                self.step();
                self.totals.busy_secs += t.elapsed().as_secs_f64();
            }
            self.publish();
        }
    }

    /// Returns false when the thread should stop.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit(req, sink) => self.accept(*req, sink),
            Command::AbortAll(message) => {
                let all: Vec<Active> = self.sched.waiting.drain(..).chain(self.sched.running.drain(..)).collect();
                for mut a in all {
                    if !a.admitted {
                        self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                    }
                    a.fail(message.clone());
                    self.totals.failed_requests += 1;
                }
            }
            Command::Stop => return false,
        }
        true
    }

    fn accept(&mut self, req: EngineRequest, sink: UnboundedSender<EngineEvent>) {
        let proposer = match (&self.drafter, req.speculate) {
            (Some(spec), true) => match build_proposer(spec, &self.model) {
                Ok(p) => Some(p),
                Err(e) => {
                    self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                    let _ = sink.send(EngineEvent::Failed(format!("cannot build the drafter: {e:#}")));
                    self.totals.failed_requests += 1;
                    return;
                }
            },
            _ => None,
        };
        let policy = proposer.as_ref().map(|_| AdaptiveState::new(self.max_draft, self.curve.clone()));
        let text = TextStream::new(req.params.stop_strings.clone());
        let ignore_eos = req.ignore_eos;
        let mut cache = self.pool.new_sequence();
        // Proposers that read the target's hidden states (EAGLE-3, DFlash) need every prompt
        // position computed, so they prefill everything.
        let needs_taps = proposer.as_ref().is_some_and(|p| !p.tap_layers().is_empty());
        let cached_prompt_tokens =
            if self.prefix_caching && !needs_taps { cache.attach_prefix(&req.prompt) } else { 0 };
        self.totals.prefix_cache_hit_tokens += cached_prompt_tokens as u64;
        let seq = Sequence::new(&req.prompt, cache, req.params);
        self.sched.waiting.push_back(Active {
            seq,
            pool: self.pool.clone(),
            text,
            sink,
            proposer,
            policy,
            metrics: SpecMetrics::default(),
            drafts_delivered: 0,
            needs_begin: true,
            admitted: false,
            preemptions: 0,
            cached_prompt_tokens,
            bid: DraftBid::default(),
            done: false,
            abandoned: false,
            ignore_eos,
        });
    }

    /// Drops requests whose receiver is gone; dropping frees their KV blocks.
    fn reap_abandoned(&mut self) {
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
        self.shared.queued.fetch_sub(unqueued, Ordering::SeqCst);
        self.totals.cancelled_requests += gone as u64;
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

    fn publish(&mut self) {
        let stats = self.pool.stats();
        let mut s = self.totals.clone();
        s.waiting = self.sched.waiting.len();
        s.running = self.sched.running.len();
        s.kv_total_blocks = stats.total_blocks;
        s.kv_free_blocks = stats.free_blocks;
        s.kv_cached_blocks = stats.cached_blocks;
        s.kv_block_size = stats.block_size;
        *self.shared.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }

    /// The context a sequence may grow to: the model's context (the server keeps prompt +
    /// max_tokens within the pool).
    fn context_len(&self) -> usize {
        self.model.model.config.context_len
    }

    fn step(&mut self) {
        let ctx = self.context_len();
        // Draft wishes of decoding sequences, from their own policies.
        for a in self.sched.running.iter_mut() {
            a.bid = DraftBid::default();
            let decoding = a.seq.tokens.len() - a.seq.cache.len() == 1;
            if let (true, Some(policy)) = (decoding, a.policy.as_mut()) {
                let room_ctx = ctx.saturating_sub(a.seq.tokens.len() + 1);
                let room_max =
                    a.seq.params.max_tokens.map_or(usize::MAX, |m| m.saturating_sub(a.seq.generated().len() + 1));
                let want = policy.choose(&a.metrics).min(room_ctx).min(room_max);
                let secs_per_token =
                    if a.metrics.drafted > 0 { a.metrics.draft_secs / a.metrics.drafted as f64 } else { 0.0 };
                let (own_accepted, own_tried) = policy.acceptance_counts();
                let alpha = self.fleet.alpha_for(own_accepted, own_tried);
                a.bid = DraftBid { alpha, max_len: want, secs_per_token };
            }
        }

        self.unpin_waiting_prefixes();
        let stats = self.pool.stats();
        let plan = self.sched.schedule(stats.free_blocks, stats.total_blocks, self.cost.as_ref());
        self.totals.preemptions += plan.preempted as u64;
        for mut a in plan.unfittable {
            if !a.admitted {
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            }
            // Only reachable when a request outgrows the pool; the server's limits prevent it.
            a.finish(FinishReason::ContextFull);
            self.totals.finished_requests += 1;
        }
        for &i in &plan.admitted {
            let a = &mut self.sched.running[i];
            if !a.admitted {
                a.admitted = true;
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            }
        }
        if plan.slots.is_empty() {
            return;
        }

        // Proposers (re)start where needed, then draft.
        let stop_ids = &self.stop_ids;
        let mut drafts: Vec<Draft> = Vec::with_capacity(plan.slots.len());
        for slot in &plan.slots {
            let a = &mut self.sched.running[slot.index];
            let mut draft = Draft::default();
            if let Some(p) = a.proposer.as_mut() {
                let result = (|| -> Result<Draft> {
                    if a.needs_begin {
                        p.begin(&a.seq.tokens)?;
                        a.needs_begin = false;
                    }
                    match slot.kind {
                        SlotKind::Decode { draft: k } if k > 0 => {
                            let t = Instant::now();
                            let mut d = p.propose(&a.seq.tokens, k)?;
                            // Nothing after a stop token can be committed: do not verify it.
                            let ends = |t: &u32| {
                                (!a.ignore_eos && stop_ids.contains(t)) || a.seq.params.stop_token_ids.contains(t)
                            };
                            let stop = d.tokens.iter().position(ends);
                            d.tokens.truncate(k.min(stop.map_or(usize::MAX, |i| i + 1)));
                            if let Some(probs) = d.probs.as_mut() {
                                probs.truncate(d.tokens.len());
                            }
                            a.metrics.draft_secs += t.elapsed().as_secs_f64();
                            Ok(d)
                        }
                        _ => Ok(Draft::default()),
                    }
                })();
                match result {
                    Ok(d) => draft = d,
                    Err(e) => a.fail(format!("drafter error: {e:#}")),
                }
            }
            drafts.push(draft);
        }

        // One packed forward.
        let inputs: Vec<Vec<u32>> = plan
            .slots
            .iter()
            .zip(&drafts)
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
        let t_forward = Instant::now();
        let result = {
            let mut batch = ForwardBatch::new();
            batch.tap_layers = tap_layers.clone();
            let mut slots = plan.slots.iter().zip(&inputs).peekable();
            for (i, a) in self.sched.running.iter_mut().enumerate() {
                let Some((slot, input)) = slots.peek() else { break };
                if slot.index != i {
                    continue;
                }
                let rows = match slot.kind {
                    SlotKind::Decode { .. } => LogitsRows::All,
                    SlotKind::Prefill { last: true } => LogitsRows::Last,
                    SlotKind::Prefill { last: false } => LogitsRows::None,
                };
                batch.push(input, &mut a.seq.cache, rows);
                slots.next();
            }
            self.model.model.forward(&mut batch)
        };
        let forward_secs = t_forward.elapsed().as_secs_f64();
        self.totals.forward_secs += forward_secs;
        let out = match result {
            Ok(out) => out,
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
                    self.remove_done();
                }
                return;
            }
            Err(e) => {
                for slot in &plan.slots {
                    self.sched.running[slot.index].fail(format!("forward failed: {e:#}"));
                    self.totals.failed_requests += 1;
                }
                self.remove_done();
                return;
            }
        };
        self.totals.steps += 1;
        self.totals.rows += inputs.iter().map(|i| i.len() as u64).sum::<u64>();

        for (j, slot) in plan.slots.iter().enumerate() {
            let draft = std::mem::take(&mut drafts[j]);
            if let Err(e) = self.finish_slot(j, slot, draft, cached_before[j], &out, &tap_layers, forward_secs) {
                let a = &mut self.sched.running[slot.index];
                a.fail(format!("{e:#}"));
                self.totals.failed_requests += 1;
            }
        }
        self.remove_done();
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

    /// Verifies, commits, rolls back and streams one sequence's part of the step.
    #[allow(clippy::too_many_arguments)]
    fn finish_slot(
        &mut self,
        j: usize,
        slot: &Slot,
        draft: Draft,
        cached_before: usize,
        out: &ForwardOutput,
        tap_layers: &[usize],
        forward_secs: f64,
    ) -> Result<()> {
        let ctx = self.context_len();
        let model = self.model.clone();
        let stop_ids = &self.stop_ids;
        let a = &mut self.sched.running[slot.index];
        if a.done {
            return Ok(());
        }
        // This sequence's taps, in the order its proposer asked for them.
        let taps_for = |a: &Active, rows: usize| -> Result<Vec<Tensor>> {
            let Some(p) = a.proposer.as_ref() else { return Ok(Vec::new()) };
            if p.tap_layers().is_empty() {
                return Ok(Vec::new());
            }
            let all = out.seq_taps(j)?;
            p.tap_layers()
                .iter()
                .map(|l| {
                    let k = tap_layers.iter().position(|t| t == l).context("tap layer missing")?;
                    Ok(all[k].narrow(0, 0, rows)?)
                })
                .collect()
        };
        if self.prefix_caching && matches!(slot.kind, SlotKind::Prefill { .. }) {
            a.seq.cache.publish_prefix(&a.seq.tokens[..a.seq.prompt_len]);
        }
        if let SlotKind::Prefill { last: false } = slot.kind {
            self.totals.prefill_tokens += slot.rows as u64;
            let taps = taps_for(a, slot.rows)?;
            if let Some(p) = a.proposer.as_mut() {
                p.observe(&a.seq.tokens, cached_before..cached_before + slot.rows, &taps)?;
            }
            return Ok(());
        }
        let decoding = matches!(slot.kind, SlotKind::Decode { .. });
        if !decoding {
            self.totals.prefill_tokens += slot.rows as u64;
        }

        let mut rows = out.seq_logits(j)?;
        penalize_verification_rows(&mut rows, a.seq.generated(), &draft.tokens, &a.seq.params);
        let verdict = verify(&draft, &rows, &a.seq.params, &mut a.seq.rng);
        // Keep the fed pending tokens and the accepted drafts; forget rejected drafts.
        let kept = cached_before + slot.rows + verdict.accepted;
        a.seq.cache.truncate(kept);
        let committed = verdict.committed(&draft.tokens);
        let first_token = a.seq.generated().is_empty();
        if !first_token {
            a.metrics.record(draft.tokens.len(), verdict.accepted, committed.len());
            // The forward served every sequence at once; charge this one its rows' share.
            let total_rows = out.row_ranges.iter().map(|r| r.len()).sum::<usize>().max(1);
            a.metrics.verify_secs += forward_secs * out.row_ranges[j].len() as f64 / total_rows as f64;
            self.totals.verify_steps += 1;
            self.totals.drafted += draft.tokens.len() as u64;
            self.fleet.record(draft.tokens.len(), verdict.accepted);
        }

        let mut chunk = TokenChunk::default();
        let tokenizer = &model.tokenizer;
        let text = &mut a.text;
        let mut on_token = |ev: TokenEvent| {
            let piece = text.push(tokenizer, ev.token);
            chunk.ids.push(ev.token);
            chunk.sources.push(ev.source);
            chunk.pieces.push(piece);
            !text.stopped()
        };
        let stop_ids: &[u32] = if a.ignore_eos { &[] } else { stop_ids };
        let finish = commit(&mut a.seq, &committed, verdict.accepted, stop_ids, &mut on_token, ctx);
        self.totals.generated_tokens += chunk.ids.len() as u64;
        let from_draft = chunk.sources.iter().filter(|s| **s == TokenSource::Draft).count() as u64;
        a.drafts_delivered += from_draft;
        self.totals.accepted += from_draft;
        if !chunk.is_empty() {
            a.send(EngineEvent::Tokens(chunk));
        }
        match finish {
            Some(reason) => {
                a.finish(reason);
                self.totals.finished_requests += 1;
            }
            None => {
                let taps = taps_for(a, kept - cached_before)?;
                if let Some(p) = a.proposer.as_mut() {
                    p.observe(&a.seq.tokens, cached_before..kept, &taps)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::FleetAcceptance;

    #[test]
    fn fleet_acceptance_starts_optimistic_and_converges_on_what_it_sees() {
        let mut fleet = FleetAcceptance::default();
        assert_eq!(fleet.alpha(), 1.0, "nothing seen yet: try speculation");
        // A drafter that gets the first of four positions right one time in five.
        for i in 0..400 {
            fleet.record(4, usize::from(i % 5 == 0));
        }
        let a = fleet.alpha();
        assert!(a < 0.3, "after poor acceptance the estimate must fall: {a}");
        // A new request starts from the fleet's estimate, and its own evidence moves it.
        let fresh = fleet.alpha_for(0.0, 0.0);
        assert!((fresh - a).abs() < 1e-12);
        assert!(fleet.alpha_for(20.0, 20.0) > 0.8, "a request that keeps matching earns its drafts");
        // Good acceptance later is learnt within a few hundred positions.
        for _ in 0..300 {
            fleet.record(4, 4);
        }
        assert!(fleet.alpha() > 0.8, "{}", fleet.alpha());
    }
}
