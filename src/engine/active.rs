//! One request inside the engine: its sequence, drafter, draft policy, counters, and the sink
//! its events go to.

use super::request::{Completion, EngineEvent, StepTrace, TokenChunk, TokenLogprob, TokenSource, Usage};
use super::scheduler::SchedSeq;
use super::sequence::{FinishReason, Sequence};
use super::text_stream::TextStream;
use crate::grammar::Constraint;
use crate::kv::KvPool;
use crate::speculative::planner::DraftBid;
use crate::speculative::{AdaptiveState, Proposer, SpecMetrics};
use crate::tokenize::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

/// Where a request's events go: the server's channel to its HTTP handler, or `generate`'s
/// callback.
pub trait EventSink {
    /// Delivers one event; false when the receiver is gone.
    fn send(&mut self, event: EngineEvent) -> bool;
    /// The receiver is gone (a client that disconnected): the request can be dropped.
    fn is_closed(&self) -> bool;
}

impl EventSink for UnboundedSender<EngineEvent> {
    fn send(&mut self, event: EngineEvent) -> bool {
        UnboundedSender::send(self, event).is_ok()
    }
    fn is_closed(&self) -> bool {
        UnboundedSender::is_closed(self)
    }
}

/// How a request's draft length is chosen each step.
pub(super) enum DraftChoice {
    /// No drafter: plain decoding.
    None,
    /// Exactly this many tokens whenever they fit (`--draft-len N`).
    Fixed(usize),
    /// The request's own estimate of what pays, weighed against the rest of the batch.
    Adaptive(AdaptiveState),
}

pub(super) struct Active<'a> {
    pub seq: Sequence,
    pub pool: KvPool,
    /// Detokenised text and stop strings (when the engine has a tokenizer).
    pub text: Option<TextStream>,
    pub sink: Box<dyn EventSink + 'a>,
    pub proposer: Option<Box<dyn Proposer + 'a>>,
    pub draft: DraftChoice,
    pub metrics: SpecMetrics,
    pub trace: Option<Vec<StepTrace>>,
    /// Accepted draft tokens that were committed (a stop token ends a commit early).
    pub drafts_delivered: u64,
    /// The proposer must (re)start from the committed tokens before the next forward.
    pub needs_begin: bool,
    /// Admitted at least once (it no longer counts as queued).
    pub admitted: bool,
    pub preemptions: u32,
    /// Prompt tokens attached from the prefix cache at arrival.
    pub cached_prompt_tokens: usize,
    pub bid: DraftBid,
    /// Its drafter drafts trees (None: chains only), and whether this step's draft is one.
    pub trees: Option<bool>,
    /// Finished, failed or abandoned: removed (and its KV freed) at the end of the step.
    pub done: bool,
    /// Its receiver went away (a client that disconnected).
    pub abandoned: bool,
    /// End-of-sequence tokens do not end this request.
    pub ignore_eos: bool,
    /// Alternatives per generated token's log-prob, when asked for.
    pub logprobs: Option<usize>,
    /// The prompt's log-probs, when asked for.
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// The grammar the output must match, in the state of the committed output.
    pub constraint: Option<Constraint>,
}

/// A request's prompt log-probs: recorded while its prompt is prefilled, delivered with its
/// first output tokens (or at the end, when there are none).
pub(super) struct PromptLogprobs {
    /// Alternatives per token.
    pub top_n: usize,
    /// Prompt tokens 1.., in order; a recomputation after preemption skips what is here.
    pub recorded: Vec<TokenLogprob>,
    /// Already handed to the sink (a recomputation records nothing then).
    pub sent: bool,
}

impl SchedSeq for Active<'_> {
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

impl Active<'_> {
    pub fn is_decoding(&self) -> bool {
        self.seq.tokens.len() - self.seq.cache.len() == 1
    }

    /// Whether `token` ends this request.
    pub fn is_stop(&self, token: u32, stop_ids: &[u32]) -> bool {
        (!self.ignore_eos && stop_ids.contains(&token)) || self.seq.params.stop_token_ids.contains(&token)
    }

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

    pub fn send(&mut self, event: EngineEvent) {
        if !self.sink.send(event) {
            self.done = true;
            self.abandoned = true;
        }
    }

    pub fn finish(&mut self, finish: FinishReason) {
        let tail = self.text.as_mut().map(|t| t.finish()).unwrap_or_default();
        let completion = Completion {
            finish,
            tail,
            usage: self.usage(),
            metrics: self.metrics.clone(),
            trace: self.trace.take().unwrap_or_default(),
            prompt_logprobs: self.take_prompt_logprobs(),
        };
        self.send(EngineEvent::Done(Box::new(completion)));
        self.done = true;
    }

    /// The prompt's log-probs, once: for the first chunk or the completion.
    pub fn take_prompt_logprobs(&mut self) -> Vec<TokenLogprob> {
        match self.prompt_logprobs.as_mut() {
            Some(p) if !p.sent => {
                p.sent = true;
                std::mem::take(&mut p.recorded)
            }
            _ => Vec::new(),
        }
    }

    pub fn fail(&mut self, message: String) {
        self.send(EngineEvent::Failed(message));
        self.done = true;
    }

    /// Appends committed tokens one by one into `chunk`, stopping at a stop token (not kept),
    /// a stop string, `max_tokens` or the context end. The first `draft_ranks.len()` tokens
    /// were accepted drafts, each of that sibling rank; `logprobs[i]`, when given, belongs to
    /// `tokens[i]`.
    #[allow(clippy::too_many_arguments)]
    pub fn commit(
        &mut self,
        tokens: &[u32],
        logprobs: Vec<TokenLogprob>,
        draft_ranks: &[usize],
        stop_ids: &[u32],
        tokenizer: Option<&Tokenizer>,
        context_len: usize,
        chunk: &mut TokenChunk,
    ) -> Option<FinishReason> {
        let mut logprobs = logprobs.into_iter();
        for (i, &t) in tokens.iter().enumerate() {
            if self.is_stop(t, stop_ids) {
                return Some(FinishReason::Stop);
            }
            self.seq.tokens.push(t);
            let piece = match (self.text.as_mut(), tokenizer) {
                (Some(text), Some(tok)) => text.push(tok, t),
                _ => String::new(),
            };
            chunk.ids.push(t);
            chunk.sources.push(match draft_ranks.get(i) {
                Some(0) => TokenSource::Draft,
                Some(_) => TokenSource::DraftBranch,
                None => TokenSource::Target,
            });
            chunk.pieces.push(piece);
            if let Some(lp) = logprobs.next() {
                chunk.logprobs.push(lp);
            }
            if self.text.as_ref().is_some_and(|t| t.stopped()) {
                return Some(FinishReason::Stop);
            }
            if self.seq.params.max_tokens.is_some_and(|m| self.seq.generated().len() >= m) {
                return Some(FinishReason::Length);
            }
            if self.seq.tokens.len() >= context_len {
                return Some(FinishReason::ContextFull);
            }
        }
        None
    }
}
