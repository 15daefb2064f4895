//! Autoregressive costs of one model: prefill and decode tokens/s at batch 1, and the
//! verify-cost curve cost(m)/cost(1) — the time to run m new tokens (logits for all of them,
//! as verification needs) on top of a fixed context, relative to one token. That curve caps
//! every speculative speedup on a CPU.

use super::median;
use super::profile::{ProfileReport, ProfileSettings};
use crate::model::{ForwardBatch, LogitsRows, Transformer};
use crate::speculative::step_cost::timing_filler;
use crate::speculative::{StepCost, StepCostSettings};
use anyhow::Result;
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct ArSettings {
    /// Prompt tokens for the prefill measurement.
    pub prefill_tokens: usize,
    /// Tokens generated for the decode measurement.
    pub decode_tokens: usize,
    /// Cached context under the verify measurements.
    pub verify_depth: usize,
    pub max_m: usize,
    pub repeats: usize,
    /// Sequences decoded together for the batched decode measurement (0 skips it).
    pub batch: usize,
    /// Cached tokens of each of those sequences when their decoding starts.
    pub batch_context: usize,
    /// Block sizes to profile per phase on top of `verify_depth` cached tokens (`None`: no
    /// profile); see [`super::profile`].
    pub profile: Option<Vec<usize>>,
}

impl Default for ArSettings {
    fn default() -> Self {
        Self {
            prefill_tokens: 512,
            decode_tokens: 64,
            verify_depth: 256,
            max_m: 16,
            repeats: 5,
            batch: 8,
            batch_context: 128,
            profile: None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct VerifyPoint {
    pub m: usize,
    pub ms: f64,
    /// cost(m) / cost(1).
    pub ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ArReport {
    pub prefill_tps: f64,
    pub decode_tps: f64,
    /// Aggregate tokens/s of `batch` sequences decoding one token each per forward, as a
    /// server does with that many clients; `None` when not measured.
    pub batch_decode_tps: Option<f64>,
    pub verify: Vec<VerifyPoint>,
    /// Where the time of a verify block goes, per phase (with `--profile`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<ProfileReport>,
}

/// Deterministic filler tokens (the step-cost measurement's), so runs are comparable without
/// depending on a tokenizer.
fn filler(n: usize, vocab: usize) -> Vec<u32> {
    timing_filler(vocab, n, 0)
}

pub fn run(model: &Transformer, s: &ArSettings) -> Result<ArReport> {
    let vocab = model.config.vocab;
    let ctx = model.config.context_len;
    for (what, len) in [
        ("--prefill-tokens", s.prefill_tokens),
        ("--verify-depth + --max-m", s.verify_depth + s.max_m),
        (
            "--verify-depth + --profile-m",
            s.profile.as_ref().map_or(0, |sizes| s.verify_depth + sizes.iter().copied().max().unwrap_or(0)),
        ),
        ("--decode-tokens", s.decode_tokens + 4),
        (
            "--batch-context + --batch + --decode-tokens",
            (s.batch > 0) as usize * (s.batch_context + s.batch + s.decode_tokens),
        ),
    ] {
        if len > ctx {
            anyhow::bail!("{what} needs sequences of {len} tokens; the model's context is {ctx}");
        }
    }
    // The verify curve sizes its own pool (`time_blocks`).
    let one_seq = s.prefill_tokens.max(s.decode_tokens + 8) + 64;
    let batched = s.batch * (s.batch_context + s.batch + s.decode_tokens + 16);
    let pool = model.new_kv_pool(one_seq.max(batched));

    // Prefill: one chunk of `prefill_tokens`, last-row logits.
    let prompt = filler(s.prefill_tokens, vocab);
    // One untimed pass first, as llama-bench does: candle repacks each weight matrix on its
    // first use (and again into AMX tiles on the first batch of 32+ rows), a one-off cost
    // that would otherwise land in the first timed sample.
    {
        let mut cache = pool.new_sequence();
        let mut b = ForwardBatch::new();
        b.push(&prompt, &mut cache, LogitsRows::Last);
        model.forward(&mut b)?;
    }
    let mut times = Vec::new();
    for _ in 0..s.repeats {
        let mut cache = pool.new_sequence();
        let t = Instant::now();
        let mut b = ForwardBatch::new();
        b.push(&prompt, &mut cache, LogitsRows::Last);
        model.forward(&mut b)?;
        times.push(t.elapsed().as_secs_f64());
    }
    let prefill_tps = s.prefill_tokens as f64 / median(&mut times);

    // Decode: one token at a time from a short context, last-row logits.
    let mut times = Vec::new();
    for _ in 0..s.repeats {
        let mut cache = pool.new_sequence();
        let mut b = ForwardBatch::new();
        let start = filler(4, vocab);
        b.push(&start, &mut cache, LogitsRows::Last);
        model.forward(&mut b)?;
        let t = Instant::now();
        let mut tok = [start[3]];
        for i in 0..s.decode_tokens {
            let mut b = ForwardBatch::new();
            b.push(&tok, &mut cache, LogitsRows::Last);
            let out = model.forward(&mut b)?;
            let row = out.seq_logits(0)?;
            tok = [crate::sample::argmax(&row[0]).min(vocab as u32 - 1) ^ (i as u32 & 1)];
        }
        times.push(t.elapsed().as_secs_f64());
    }
    let decode_tps = s.decode_tokens as f64 / median(&mut times);

    // Verify curve: m tokens on top of `verify_depth` cached ones, all rows' logits, then
    // roll back, exactly as a speculative step does: the step-cost measurement itself, at
    // every m.
    let settings = StepCostSettings::every(s.max_m, s.verify_depth, s.repeats.max(3));
    let cost = StepCost::measure(model, &settings)?;
    let mut verify: Vec<VerifyPoint> =
        cost.measured().iter().map(|&(m, secs)| VerifyPoint { m, ms: secs * 1e3, ratio: 0.0 }).collect();
    let base = verify[0].ms;
    for p in verify.iter_mut() {
        p.ratio = p.ms / base;
    }

    let batch_decode_tps = if s.batch > 0 { Some(batch_decode(model, &pool, s)?) } else { None };
    drop(pool);

    let profile = match &s.profile {
        Some(sizes) => Some(super::profile::run(
            model,
            &ProfileSettings { sizes: sizes.clone(), depth: s.verify_depth, rounds: s.repeats.max(3), peak_secs: 0.3 },
        )?),
        None => None,
    };
    Ok(ArReport { prefill_tps, decode_tps, batch_decode_tps, verify, profile })
}

/// Decode throughput of `s.batch` sequences in one packed forward per step, each starting
/// from its own `s.batch_context`-token context: a server's decode step with that many
/// clients, without the server. Compared with `prefill_tps` it says how close batched
/// decoding comes to the compute-bound rate.
fn batch_decode(model: &Transformer, pool: &crate::kv::KvPool, s: &ArSettings) -> Result<f64> {
    let vocab = model.config.vocab;
    let mut times = Vec::new();
    for _ in 0..s.repeats {
        let mut caches: Vec<_> = (0..s.batch).map(|_| pool.new_sequence()).collect();
        let mut next: Vec<[u32; 1]> = Vec::with_capacity(s.batch);
        for (i, cache) in caches.iter_mut().enumerate() {
            // Different contexts per sequence, so no two rows compute the same thing.
            let context = filler(s.batch_context + i, vocab);
            let mut b = ForwardBatch::new();
            b.push(&context[i..], cache, LogitsRows::Last);
            let out = model.forward(&mut b)?;
            next.push([crate::sample::argmax(&out.seq_logits(0)?[0]).min(vocab as u32 - 1)]);
        }
        let t = Instant::now();
        for _ in 0..s.decode_tokens {
            let mut b = ForwardBatch::new();
            for (tok, cache) in next.iter().zip(caches.iter_mut()) {
                b.push(tok, cache, LogitsRows::Last);
            }
            let out = model.forward(&mut b)?;
            let picked: Vec<u32> = (0..s.batch)
                .map(|i| Ok(crate::sample::argmax(&out.seq_logits(i)?[0]).min(vocab as u32 - 1)))
                .collect::<Result<_>>()?;
            drop(b);
            for (tok, p) in next.iter_mut().zip(picked) {
                tok[0] = p;
            }
        }
        times.push(t.elapsed().as_secs_f64());
    }
    Ok((s.batch * s.decode_tokens) as f64 / median(&mut times))
}
