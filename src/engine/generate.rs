//! One request, start to finish: chunked prefill, then steps of
//! propose → forward (pending token + draft) → verify → commit → rollback.

use super::metrics::SpecMetrics;
use super::sequence::{FinishReason, Sequence};
use crate::kv::PoolExhausted;
use crate::model::{ForwardBatch, LogitsRows, Transformer};
use crate::speculative::verify::penalize_verification_rows;
use crate::speculative::{verify, Draft, Proposer};
use anyhow::Result;
use std::time::Instant;

/// How a committed token was produced, for display and tracing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenSource {
    /// A draft token the target accepted.
    Draft,
    /// Sampled from the target (first token, correction, or bonus).
    Target,
}

#[derive(Debug, Clone, Copy)]
pub struct TokenEvent {
    pub token: u32,
    pub source: TokenSource,
}

/// Per-step record for `--trace`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepTrace {
    pub draft: Vec<u32>,
    pub accepted: usize,
    pub next_token: u32,
}

pub struct GenerateOptions {
    /// Rows per prefill forward.
    pub prefill_chunk: usize,
    /// Chooses the draft length of each step from the metrics so far (0 = plain decode).
    pub draft_len: Box<dyn FnMut(&SpecMetrics) -> usize + Send>,
    /// Record every step in [`Generation::trace`].
    pub trace: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self { prefill_chunk: 512, draft_len: Box::new(|_| 0), trace: false }
    }
}

impl GenerateOptions {
    pub fn fixed_draft(n: usize) -> Self {
        Self { draft_len: Box::new(move |_| n), ..Self::default() }
    }
}

/// Result of one generation.
#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
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

/// Generates for `seq` until a stop token (`stop_ids`), `max_tokens`, the context end, or
/// `on_token` returning false. `proposer` drafts; without one every step is plain decoding.
pub fn generate(
    model: &Transformer,
    seq: &mut Sequence,
    stop_ids: &[u32],
    mut proposer: Option<&mut dyn Proposer>,
    opts: &mut GenerateOptions,
    on_token: &mut dyn FnMut(TokenEvent) -> bool,
) -> Result<Generation> {
    let context_len = model.config.context_len;
    if seq.tokens.is_empty() {
        anyhow::bail!("the prompt is empty");
    }
    if seq.tokens.len() >= context_len {
        anyhow::bail!("the prompt has {} tokens, the model's context holds {context_len}", seq.tokens.len());
    }
    let taps_wanted: Vec<usize> = proposer.as_ref().map(|p| p.tap_layers().to_vec()).unwrap_or_default();
    if let Some(p) = proposer.as_deref_mut() {
        p.begin(&seq.tokens)?;
    }
    let mut metrics = SpecMetrics::default();
    let mut trace = Vec::new();
    let started = Instant::now();

    // Prefill in chunks; the last chunk's last row gives the first token.
    let prompt_len = seq.tokens.len();
    let first_logits = loop {
        let start = seq.cache.len();
        let end = (start + opts.prefill_chunk.max(1)).min(prompt_len);
        let last = end == prompt_len;
        let tokens = seq.tokens[start..end].to_vec();
        let mut batch = ForwardBatch::new();
        batch.tap_layers = taps_wanted.clone();
        batch.push(&tokens, &mut seq.cache, if last { LogitsRows::Last } else { LogitsRows::None });
        let out = match model.forward(&mut batch) {
            Ok(out) => out,
            Err(e) if e.is::<PoolExhausted>() => anyhow::bail!("{e}: the prompt does not fit in the KV cache"),
            Err(e) => return Err(e),
        };
        if let Some(p) = proposer.as_deref_mut() {
            p.observe(&seq.tokens, start..end, &out.seq_taps(0)?)?;
        }
        if last {
            break out.seq_logits(0)?;
        }
    };
    let prefill_secs = started.elapsed().as_secs_f64();
    let decode_start = Instant::now();

    let mut rows = first_logits;
    penalize_verification_rows(&mut rows, seq.generated(), &[], &seq.params);
    let first = verify(&Draft::default(), &rows, &seq.params, &mut seq.rng).next_token;
    let mut finish = commit(seq, &[first], 0, stop_ids, on_token, context_len);

    while finish.is_none() {
        // Propose, bounded by the context and by max_tokens (a draft past either is wasted).
        let room_ctx = context_len.saturating_sub(seq.tokens.len() + 1);
        let room_max = seq.params.max_tokens.map_or(usize::MAX, |m| m.saturating_sub(seq.generated().len() + 1));
        let want = (opts.draft_len)(&metrics).min(room_ctx).min(room_max);
        let t0 = Instant::now();
        let mut draft = match (proposer.as_deref_mut(), want) {
            (Some(p), w) if w > 0 => p.propose(&seq.tokens, w)?,
            _ => Draft::default(),
        };
        draft.tokens.truncate(want);
        if let Some(probs) = draft.probs.as_mut() {
            probs.truncate(draft.tokens.len());
        }
        metrics.draft_secs += t0.elapsed().as_secs_f64();

        // Verify: the pending token plus the draft, logits for every row.
        let t1 = Instant::now();
        let cached_before = seq.cache.len();
        let mut input = seq.pending().to_vec();
        input.extend_from_slice(&draft.tokens);
        let mut batch = ForwardBatch::new();
        batch.tap_layers = taps_wanted.clone();
        batch.push(&input, &mut seq.cache, LogitsRows::All);
        let out = match model.forward(&mut batch) {
            Ok(out) => out,
            Err(e) if e.is::<PoolExhausted>() => {
                finish = Some(FinishReason::ContextFull);
                break;
            }
            Err(e) => return Err(e),
        };
        let mut rows = out.seq_logits(0)?;
        penalize_verification_rows(&mut rows, seq.generated(), &draft.tokens, &seq.params);
        let verdict = verify(&draft, &rows, &seq.params, &mut seq.rng);
        metrics.verify_secs += t1.elapsed().as_secs_f64();

        // Roll back the target's cache to the committed tokens: the pending token and the
        // accepted drafts stay; rejected drafts are forgotten.
        let kept = cached_before + 1 + verdict.accepted;
        seq.cache.truncate(kept);
        let committed = verdict.committed(&draft.tokens);
        metrics.record(draft.tokens.len(), verdict.accepted, committed.len());
        if opts.trace {
            trace.push(StepTrace {
                draft: draft.tokens.clone(),
                accepted: verdict.accepted,
                next_token: verdict.next_token,
            });
        }
        finish = commit(seq, &committed, verdict.accepted, stop_ids, on_token, context_len);
        // A stop token among the accepted drafts, max_tokens or a consumer that stopped
        // listening can end the step before every accepted draft is committed: the cache
        // must not keep K/V for tokens that were never committed.
        seq.cache.truncate(seq.tokens.len());
        if let (Some(p), None) = (proposer.as_deref_mut(), finish) {
            let taps = out.seq_taps(0)?;
            let n = kept - cached_before;
            let taps: Vec<_> = taps.iter().map(|t| t.narrow(0, 0, n)).collect::<candle_core::Result<_>>()?;
            p.observe(&seq.tokens, cached_before..kept, &taps)?;
        }
    }
    let decode_secs = decode_start.elapsed().as_secs_f64();
    Ok(Generation {
        tokens: seq.generated().to_vec(),
        finish: finish.unwrap_or(FinishReason::Stop),
        prompt_tokens: prompt_len,
        prefill_secs,
        decode_secs,
        metrics,
        trace,
    })
}

/// Appends committed tokens one by one, stopping at a stop token (not kept), `max_tokens`,
/// the context end, or a consumer that stops listening. The first `from_draft` tokens were
/// accepted drafts.
pub(super) fn commit(
    seq: &mut Sequence,
    tokens: &[u32],
    from_draft: usize,
    stop_ids: &[u32],
    on_token: &mut dyn FnMut(TokenEvent) -> bool,
    context_len: usize,
) -> Option<FinishReason> {
    for (i, &t) in tokens.iter().enumerate() {
        if stop_ids.contains(&t) || seq.params.stop_token_ids.contains(&t) {
            seq.finish = Some(FinishReason::Stop);
            return seq.finish;
        }
        seq.tokens.push(t);
        seq.counts.add(t);
        let source = if i < from_draft { TokenSource::Draft } else { TokenSource::Target };
        if !on_token(TokenEvent { token: t, source }) {
            seq.finish = Some(FinishReason::Stop);
            return seq.finish;
        }
        if seq.params.max_tokens.is_some_and(|m| seq.generated().len() >= m) {
            seq.finish = Some(FinishReason::Length);
            return seq.finish;
        }
        if seq.tokens.len() >= context_len {
            seq.finish = Some(FinishReason::ContextFull);
            return seq.finish;
        }
    }
    None
}
