//! The serving engine: one thread that owns the KV pool and runs [`EngineCore::step`] for
//! every request, fed by a channel; the [`Engine`] handle submits requests to it and reads its
//! published state.

use super::core::{EngineConfig, EngineCore, EngineModel, EngineSnapshot};
use super::loaded::LoadedModel;
use super::request::{EngineEvent, EngineRequest, SubmitError};
use super::step_cost_source::{self, CurrentStepCost, RefinePlan, Refinement, SharedStepCost, StepCostOrigin};
use crate::speculative::suffix::cache::{SuffixCache, SuffixCacheConfig};
use crate::speculative::{build_proposer, Caller, DrafterSpec, StepCost};
use anyhow::{Context, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

enum Command {
    Submit(Box<EngineRequest>, UnboundedSender<EngineEvent>),
    /// Ends every request with this message (shutdown after the grace period).
    AbortAll(String),
    Stop,
}

/// Handle to the engine thread. Dropping it stops the thread (requests still running end).
pub struct Engine {
    model: Arc<LoadedModel>,
    config: EngineConfig,
    commands: Sender<Command>,
    /// Requests submitted and not yet admitted (or gone).
    queued: Arc<AtomicUsize>,
    /// Published after every step (reading the pool itself would wait for a running forward).
    snapshot: Arc<Mutex<EngineSnapshot>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    kv_capacity: usize,
    /// The curve the engine plans with (with a drafter); the engine thread swaps in the full
    /// one once it has timed it.
    cost: SharedStepCost,
}

impl Engine {
    /// Builds the KV pool (and, with a drafter, checks it and reads or measures the step-cost
    /// curve) and starts the engine thread.
    pub fn start(model: Arc<LoadedModel>, mut config: EngineConfig) -> Result<Self> {
        if config.suffix_cache.is_none() && config.drafter.as_ref().is_some_and(DrafterSpec::uses_suffix) {
            config.suffix_cache = Some(Arc::new(SuffixCache::new(SuffixCacheConfig::default())));
        }
        let pool = model.model.new_kv_pool_typed(config.kv_tokens.max(1), config.kv_dtype);
        let stats = pool.stats();
        let kv_capacity = stats.total_blocks * stats.block_size;
        let (cost, refine) = match &config.drafter {
            Some(spec) => {
                // Fail at start, not on the first request, and load a draft model's weights now.
                build_proposer(spec, model.target(), Caller::default())
                    .with_context(|| format!("drafter {}", spec.label()))?;
                step_cost_source::at_start(&model, &config)?
            }
            None => (CurrentStepCost::default(), None),
        };
        let planned = cost.cost.clone();
        let cost = Arc::new(RwLock::new(cost));
        let queued = Arc::new(AtomicUsize::new(0));
        let snapshot = Arc::new(Mutex::new(EngineSnapshot {
            kv_total_blocks: stats.total_blocks,
            kv_free_blocks: stats.free_blocks,
            kv_block_size: stats.block_size,
            ..Default::default()
        }));
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = {
            let (model, config, shared_cost, queued, snapshot) =
                (model.clone(), config.clone(), cost.clone(), queued.clone(), snapshot.clone());
            std::thread::Builder::new().name("specula-engine".into()).spawn(move || {
                let core = EngineCore::new(
                    EngineModel { model: &model.model, tokenizer: Some(&model.tokenizer) },
                    model.stop_ids(),
                    pool,
                    &config,
                    planned,
                    queued,
                );
                run(core, &model, &config, rx, &snapshot, refine, &shared_cost)
            })?
        };
        Ok(Self { model, config, commands: tx, queued, snapshot, thread: Mutex::new(Some(thread)), kv_capacity, cost })
    }

    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The most tokens (prompt + output) one request can have: the model's context (or
    /// `max_model_len` below it), or the KV pool's capacity if smaller.
    pub fn context_limit(&self) -> usize {
        self.config.context_len(self.model.model.config.context_len).min(self.kv_capacity)
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the request and frees its KV blocks at the next step boundary.
    pub fn submit(&self, request: EngineRequest) -> Result<UnboundedReceiver<EngineEvent>, SubmitError> {
        let queued = self.queued.fetch_add(1, Ordering::SeqCst);
        if queued >= self.config.max_waiting {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(queued));
        }
        let (tx, rx) = unbounded_channel();
        if self.commands.send(Command::Submit(Box::new(request), tx)).is_err() {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::Stopped);
        }
        Ok(rx)
    }

    /// The suffix drafter's cache of recent requests, where the drafter has one.
    pub fn suffix_cache(&self) -> Option<&Arc<SuffixCache>> {
        self.config.suffix_cache.as_ref()
    }

    /// The step-cost curve the engine plans with now (with a drafter).
    pub fn step_cost(&self) -> Option<Arc<StepCost>> {
        self.cost.read().unwrap_or_else(|e| e.into_inner()).cost.clone()
    }

    /// Where that curve came from: `Quick` until the full one is timed in idle time.
    pub fn step_cost_origin(&self) -> Option<StepCostOrigin> {
        self.cost.read().unwrap_or_else(|e| e.into_inner()).origin
    }

    pub fn snapshot(&self) -> EngineSnapshot {
        let mut s = self.snapshot.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(cache) = &self.config.suffix_cache {
            let c = cache.read();
            (s.suffix_cache_bytes, s.suffix_cache_sequences, s.suffix_cache_evicted) =
                (c.bytes(), c.sequences(), c.evicted_sequences);
        }
        s
    }

    /// No request queued or running (as of the last step's snapshot).
    pub fn is_idle(&self) -> bool {
        let s = self.snapshot.lock().unwrap_or_else(|e| e.into_inner());
        self.queued.load(Ordering::SeqCst) == 0 && s.waiting == 0 && s.running == 0
    }

    /// The engine thread is still running (it ends on `shutdown`, or if a step panicked).
    pub fn is_running(&self) -> bool {
        self.thread.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|t| !t.is_finished())
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

/// The engine thread: take commands, step while there is work, publish the state; with nothing
/// to do, time the rest of the step-cost curve (`refine`) one forward at a time.
fn run(
    mut core: EngineCore<'_>,
    model: &LoadedModel,
    config: &EngineConfig,
    commands: Receiver<Command>,
    snapshot: &Mutex<EngineSnapshot>,
    refine: Option<RefinePlan>,
    shared_cost: &RwLock<CurrentStepCost>,
) {
    // Returns false when the thread should stop.
    let handle = |core: &mut EngineCore<'_>, cmd: Command| -> bool {
        match cmd {
            Command::Submit(req, sink) => {
                let proposer = match (&config.drafter, req.speculate) {
                    (Some(spec), true) => match build_proposer(
                        spec,
                        model.target(),
                        Caller { suffix_cache: config.suffix_cache.as_ref(), api_key: req.api_key.as_deref() },
                    ) {
                        Ok(p) => Some(p),
                        Err(e) => {
                            // Counted as queued at submit: the engine's add would decrement it.
                            let _ = sink.send(EngineEvent::Failed(format!("cannot build the drafter: {e:#}")));
                            core.drop_queued();
                            return true;
                        }
                    },
                    _ => None,
                };
                core.add(*req, proposer, Box::new(sink));
            }
            Command::AbortAll(message) => core.abort_all(&message),
            Command::Stop => return false,
        }
        true
    };
    let mut refinement = refine.and_then(|plan| match Refinement::new(model, plan, config) {
        Ok(r) => Some(r),
        Err(e) => {
            eprintln!("specula: warning: the full step-cost curve cannot be timed: {e:#}; keeping the quick one");
            None
        }
    });
    loop {
        if core.is_idle() {
            let cmd = match refinement.as_mut() {
                Some(r) => {
                    match commands.try_recv() {
                        Ok(cmd) => {
                            r.interrupted();
                            cmd
                        }
                        Err(TryRecvError::Disconnected) => return,
                        // Idle: one timing (at most one block's wait for a request arriving now).
                        Err(TryRecvError::Empty) => {
                            refinement = time_one_forward(refinement, &mut core, shared_cost);
                            continue;
                        }
                    }
                }
                None => match commands.recv() {
                    Ok(cmd) => cmd,
                    Err(_) => return,
                },
            };
            if !handle(&mut core, cmd) {
                return;
            }
        }
        while let Ok(cmd) = commands.try_recv() {
            if !handle(&mut core, cmd) {
                return;
            }
        }
        core.step();
        *snapshot.lock().unwrap_or_else(|e| e.into_inner()) = core.snapshot();
    }
}

/// One forward of the idle-time step-cost timing. When it was the last, the full curve replaces
/// the quick one (for the planner and for `Engine::step_cost`) and the refinement ends; so does
/// a failed forward, keeping the quick curve.
fn time_one_forward<'m>(
    mut refinement: Option<Refinement<'m>>,
    core: &mut EngineCore<'_>,
    shared_cost: &RwLock<CurrentStepCost>,
) -> Option<Refinement<'m>> {
    let r = refinement.as_mut()?;
    match r.advance() {
        Ok(false) => refinement,
        Ok(true) => {
            let cost = Arc::new(refinement.map(Refinement::finish).unwrap_or_else(StepCost::linear));
            core.set_step_cost(Some(cost.clone()));
            *shared_cost.write().unwrap_or_else(|e| e.into_inner()) =
                CurrentStepCost { cost: Some(cost), origin: Some(StepCostOrigin::Measured) };
            None
        }
        Err(e) => {
            eprintln!("specula: warning: timing the step-cost curve failed: {e:#}; keeping the quick one");
            None
        }
    }
}
