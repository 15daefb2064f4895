//! Sampling: a request's sampling settings and the one sampler shared by plain decoding and the
//! speculative verifier ([`crate::speculative::verify`]), so the two cannot drift apart.
//!
//! # Order of processing in [`probabilities`]
//! Penalties ([`apply_penalties`]) act on the raw logits first, as in OpenAI and vLLM. Then:
//! 1. **temperature**: `logits / T`. `T <= 0` means greedy: the distribution is a one-hot at the
//!    argmax (ties → lowest token id) and nothing below applies.
//! 2. **top-k** (`top_k`, 0 = off): keep exactly the k highest logits; ties at the boundary go to
//!    the lower token id, so the result never depends on sort stability.
//! 3. softmax over the survivors, then **top-p** (`top_p`, 1.0 = off): keep the smallest set of most
//!    probable tokens whose probability mass reaches `top_p` (always at least one token).
//! 4. **min-p** (`min_p`, 0 = off): drop tokens whose probability is below `min_p` × the highest
//!    probability.
//! 5. renormalise.
//!
//! llama.cpp's default chain runs top-k → top-p → min-p → temperature (temperature last) and vLLM
//! runs temperature → min-p → top-k → top-p; all three agree at `T = 1` and whenever min-p is off
//! (top-k commutes with temperature, and top-p after top-k works on the renormalised survivors in
//! every one of them).
//!
//! # Randomness
//! [`SamplerRng`] is a small explicit PRNG (xoshiro256++ seeded through SplitMix64), so a seed gives
//! the same stream on every machine and across `rand` upgrades. [`sample`] draws exactly one `u64`
//! per sampled token at `T > 0` and none when greedy; the verifier relies on that so that a drafter
//! that proposes nothing yields the same stream as plain decoding.

use std::cmp::Ordering;
use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Sampling settings of one request (OpenAI-style fields plus llama.cpp's top-k and min-p).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; `<= 0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Nucleus sampling mass in (0, 1]; 1.0 = off.
    pub top_p: f32,
    /// Drop tokens below `min_p` × the top probability, in [0, 1]; 0 = off.
    pub min_p: f32,
    /// Seed for a reproducible stream; `None` = seeded from the OS.
    pub seed: Option<u64>,
    /// Maximum number of generated tokens; `None` = until a stop condition or the context ends.
    pub max_tokens: Option<usize>,
    /// Generation stops before the first occurrence of any of these strings (see [`scan_stop_strings`]).
    pub stop_strings: Vec<String>,
    /// Generation stops after any of these token ids (in addition to the model's end-of-sequence).
    pub stop_token_ids: Vec<u32>,
    /// OpenAI presence penalty in [-2, 2]: subtracted once from every token already generated.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty in [-2, 2]: subtracted once per previous occurrence of a token.
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    /// OpenAI's defaults: temperature 1, every filter and penalty off.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            max_tokens: None,
            stop_strings: Vec::new(),
            stop_token_ids: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// A sampling setting outside its valid range, named so an API can answer with a clear 400.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter `{field}`: {reason}")]
pub struct InvalidSamplingParams {
    pub field: &'static str,
    pub reason: String,
}

impl SamplingParams {
    /// Deterministic argmax decoding with no filters or penalties.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// Whether tokens are chosen by argmax (`temperature <= 0`).
    pub fn is_greedy(&self) -> bool {
        // A NaN that slipped past validation also takes the deterministic path.
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    /// Whether [`apply_penalties`] would change any logit.
    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Checks every field's range; the error names the field and the offending value.
    pub fn validate(&self) -> Result<(), InvalidSamplingParams> {
        let fail = |field, reason: String| Err(InvalidSamplingParams { field, reason });
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return fail("temperature", format!("must be a finite number >= 0 (0 = greedy), got {}", self.temperature));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return fail("top_p", format!("must be in (0, 1] (1 = off), got {}", self.top_p));
        }
        if !(self.min_p.is_finite() && (0.0..=1.0).contains(&self.min_p)) {
            return fail("min_p", format!("must be in [0, 1] (0 = off), got {}", self.min_p));
        }
        for (field, value) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            if !(value.is_finite() && (-2.0..=2.0).contains(&value)) {
                return fail(field, format!("must be in [-2, 2], got {value}"));
            }
        }
        if self.max_tokens == Some(0) {
            return fail("max_tokens", "must be at least 1".to_string());
        }
        if let Some(i) = self.stop_strings.iter().position(|s| s.is_empty()) {
            return fail("stop", format!("stop string #{i} is empty"));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Random numbers
// ---------------------------------------------------------------------------------------------

/// Reproducible PRNG for sampling: xoshiro256++ with its state expanded from a `u64` seed by
/// SplitMix64 (the seeding its authors recommend). Explicit so streams never change with a
/// dependency upgrade.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SamplerRng {
    state: [u64; 4],
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SamplerRng {
    pub fn from_seed(seed: u64) -> Self {
        let mut sm = seed;
        // SplitMix64 outputs are never all zero for four consecutive draws, so the state is valid.
        Self { state: [splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm)] }
    }

    /// Seeded from the operating system's entropy (for requests without a seed).
    pub fn from_entropy() -> Self {
        Self::from_seed(rand::random())
    }

    /// The request's own stream: seeded by `params.seed`, or from entropy when there is none.
    pub fn for_params(params: &SamplingParams) -> Self {
        params.seed.map_or_else(Self::from_entropy, Self::from_seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        let [s0, s1, s2, s3] = &mut self.state;
        let result = s0.wrapping_add(*s3).rotate_left(23).wrapping_add(*s0);
        let t = *s1 << 17;
        *s2 ^= *s0;
        *s3 ^= *s1;
        *s1 ^= *s2;
        *s0 ^= *s3;
        *s2 ^= t;
        *s3 = s3.rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Lets drafters use `rand`'s distributions on the same stream type.
impl rand::RngCore for SamplerRng {
    fn next_u32(&mut self) -> u32 {
        (SamplerRng::next_u64(self) >> 32) as u32
    }
    fn next_u64(&mut self) -> u64 {
        SamplerRng::next_u64(self)
    }
    fn fill_bytes(&mut self, dst: &mut [u8]) {
        for chunk in dst.chunks_mut(8) {
            let bytes = SamplerRng::next_u64(self).to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Distributions and sampling
// ---------------------------------------------------------------------------------------------

/// Index of the largest logit; ties → lowest id; NaN entries are skipped. Returns 0 for an empty
/// or all-NaN slice.
pub fn argmax(logits: &[f32]) -> u32 {
    // Two passes the compiler vectorises (the largest value, then where it first occurs)
    // instead of one branchy scan: this runs on every row of every step, over the whole
    // vocabulary. If every entry is NaN nothing equals the max.
    let max = max_logit(logits);
    logits.iter().position(|&v| v == max).map_or(0, |i| i as u32)
}

/// The largest logit that is not NaN (−∞ when there is none), in 16 running maxima: one in
/// order waits on every comparison. Exact in any order.
fn max_logit(logits: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            // `f32::max` ignores a NaN argument.
            *m = m.max(v);
        }
    }
    rest.iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// One token that survived the filters so far.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    id: u32,
    logit: f32,
    /// Unnormalised probability `exp((logit − max)/T)`.
    weight: f64,
}

/// Most likely first; equal logits → lower id first. A total order, so partial selection and
/// sorting agree and results never depend on sort stability.
fn more_likely_first(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Keeps the smallest most-likely-first prefix whose weight reaches `top_p` of the total.
/// Sorts only as many candidates as needed (a partial selection of 64, then 8× more), because
/// a full sort of a 150k vocabulary for every token would dominate a small model's decode step.
fn keep_top_p(candidates: &mut Vec<Candidate>, top_p: f64) {
    let total: f64 = candidates.iter().map(|c| c.weight).sum();
    let target = top_p * total;
    let n = candidates.len();
    let mut m = n.min(64);
    loop {
        if m < n {
            candidates.select_nth_unstable_by(m - 1, more_likely_first);
        }
        candidates[..m].sort_unstable_by(more_likely_first);
        let mut cumulative = 0.0;
        for i in 0..m {
            cumulative += candidates[i].weight;
            if cumulative >= target {
                candidates.truncate(i + 1);
                return;
            }
        }
        if m == n {
            return; // rounding kept the sum just below the target: keep everything
        }
        m = (m * 8).min(n);
    }
}

/// The weights `exp((logit − max)/T)` ([`crate::vmath::exp_gap`]) of the tokens that top-k,
/// top-p and min-p keep (zeros elsewhere), and their sum. None when greedy, and when nothing is
/// possible (no logits, or all −∞ or NaN).
fn filtered_weights(logits: &[f32], params: &SamplingParams) -> Option<(Vec<f32>, f64)> {
    let max = max_logit(logits);
    if params.is_greedy() || max == f32::NEG_INFINITY {
        return None;
    }
    let mut weights = vec![0.0f32; logits.len()];
    crate::vmath::exp_gaps(logits, max, 1.0 / params.temperature, &mut weights);
    let filtered = (params.top_k > 0 && params.top_k < logits.len()) || params.top_p < 1.0 || params.min_p > 0.0;
    if !filtered {
        let total = sum_f64(&weights, |w| w as f64);
        return Some((weights, total));
    }
    let mut candidates: Vec<Candidate> = logits
        .iter()
        .zip(&weights)
        .enumerate()
        .filter(|(_, (&l, _))| l > f32::NEG_INFINITY) // also drops NaN
        .map(|(i, (&l, &w))| Candidate { id: i as u32, logit: l, weight: w as f64 })
        .collect();
    if params.top_k > 0 && params.top_k < candidates.len() {
        candidates.select_nth_unstable_by(params.top_k - 1, more_likely_first);
        candidates.truncate(params.top_k);
    }
    if params.top_p < 1.0 {
        keep_top_p(&mut candidates, params.top_p as f64);
    }
    if params.min_p > 0.0 {
        let top = candidates.iter().map(|c| c.weight).fold(0.0, f64::max);
        let threshold = params.min_p as f64 * top;
        candidates.retain(|c| c.weight >= threshold);
    }
    weights.fill(0.0);
    let mut total = 0.0;
    for c in candidates {
        weights[c.id as usize] = c.weight as f32;
        total += c.weight;
    }
    Some((weights, total))
}

/// `weights` divided by their sum `total`.
fn normalise(mut weights: Vec<f32>, total: f64) -> Vec<f32> {
    let inv_total = 1.0 / total;
    for w in weights.iter_mut() {
        *w = (*w as f64 * inv_total) as f32;
    }
    weights
}

/// The distribution [`sample`] draws from: dense, one entry per logit, zeros for filtered-out
/// tokens, summing to 1 (for a non-empty input). Greedy params give a one-hot at the argmax.
/// The verifier computes the target's `p` with this, and stochastic drafters should compute their
/// `q` with it too (see [`sample_with_probabilities`]).
pub fn probabilities(logits: &[f32], params: &SamplingParams) -> Vec<f32> {
    match filtered_weights(logits, params) {
        Some((weights, total)) => normalise(weights, total),
        None => {
            let mut probs = vec![0.0f32; logits.len()];
            if !logits.is_empty() {
                // Greedy, or nothing is possible: the argmax rather than a division by 0.
                probs[argmax(logits) as usize] = 1.0;
            }
            probs
        }
    }
}

/// `Σ f(x)` over `xs` in eight running sums: one sum in order would wait on every addition
/// (a 49k vocabulary, twice per sampled token).
fn sum_f64(xs: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    let mut sums = [0.0f64; 8];
    let chunks = xs.chunks_exact(8);
    let rest: f64 = chunks.remainder().iter().map(|&x| f(x)).sum();
    for chunk in chunks {
        for (s, &x) in sums.iter_mut().zip(chunk) {
            *s += f(x);
        }
    }
    sums.iter().sum::<f64>() + rest
}

/// A weight as a draw counts it: non-positive and non-finite ones are 0.
#[inline]
fn usable(w: f32) -> f64 {
    if w > 0.0 && w.is_finite() {
        w as f64
    } else {
        0.0
    }
}

/// Draws an index with probability proportional to `weights` (need not sum to 1; non-positive and
/// non-finite entries count as 0) using exactly one `u64` from `rng`. `None`, drawing nothing,
/// when no weight is positive.
pub fn sample_from_weights(weights: &[f32], rng: &mut SamplerRng) -> Option<u32> {
    draw(weights, sum_f64(weights, usable), rng)
}

/// [`sample_from_weights`] given the weights' sum. The running sum goes block by block, and
/// token by token only inside the block where it passes the drawn point: one sum in order
/// over a 49k vocabulary would wait on every addition.
fn draw(weights: &[f32], total: f64, rng: &mut SamplerRng) -> Option<u32> {
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    draw_at(weights, rng.next_f64() * total)
}

/// The first index whose running sum of `weights` passes `target` (the last positive one if
/// rounding leaves the target past the end).
fn draw_at(weights: &[f32], target: f64) -> Option<u32> {
    const BLOCK: usize = 256;
    let mut cumulative = 0.0;
    for (b, block) in weights.chunks(BLOCK).enumerate() {
        let sum = sum_f64(block, usable);
        if cumulative + sum <= target {
            cumulative += sum;
            continue;
        }
        for (i, &w) in block.iter().enumerate() {
            let w = usable(w);
            if w > 0.0 {
                cumulative += w;
                if target < cumulative {
                    return Some((b * BLOCK + i) as u32);
                }
            }
        }
    }
    // The target fell past the end through rounding.
    weights.iter().rposition(|&w| usable(w) > 0.0).map(|i| i as u32)
}

/// Chooses the next token: argmax when greedy (draws nothing from `rng`), otherwise one draw from
/// the distribution [`probabilities`] returns. Plain decoding and the verifier's bonus token both
/// come from here. Returns 0 for empty logits.
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut SamplerRng) -> u32 {
    // From the unnormalised weights: the same distribution, one pass fewer.
    filtered_weights(logits, params)
        .and_then(|(weights, total)| draw(&weights, total, rng))
        .unwrap_or_else(|| argmax(logits))
}

/// [`sample`] that also returns the distribution the token was drawn from: what a stochastic
/// drafter reports as its `q` so that speculative rejection sampling stays exact.
/// Same token and same `rng` use as [`sample`].
pub fn sample_with_probabilities(logits: &[f32], params: &SamplingParams, rng: &mut SamplerRng) -> (u32, Vec<f32>) {
    match filtered_weights(logits, params) {
        Some((weights, total)) => {
            let token = draw(&weights, total, rng).unwrap_or_else(|| argmax(logits));
            (token, normalise(weights, total))
        }
        None => (argmax(logits), probabilities(logits, params)),
    }
}

/// Numerically stable `log(softmax(logits))` (max-shifted, accumulated in f64). Used to compare
/// log-probabilities with reference implementations. NaN logits give NaN.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = max_logit(logits);
    let shifted = |l: f32| if l == max { 0.0 } else { l as f64 - max as f64 };
    let log_sum: f64 = logits.iter().map(|&l| shifted(l).exp()).sum::<f64>().ln();
    logits.iter().map(|&l| (shifted(l) - log_sum) as f32).collect()
}

/// Most alternatives [`token_logprob`] reports per token (OpenAI's limit for `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A token's log-probability under the distribution it was chosen from, and the most likely
/// tokens of that distribution.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// Up to the requested number of `(token, logprob)`, most likely first (ties: lower id).
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability in `logits` as the request samples from them: log-softmax of the
/// (already penalised) logits divided by the temperature (undivided when greedy). Top-k,
/// top-p and min-p truncation are not applied, so every token keeps a finite value. Plus the
/// `top_n` (at most [`MAX_TOP_LOGPROBS`]) most likely tokens. The verifier's rows are the
/// target's decode rows bit for bit, so these values do not depend on what was drafted.
pub fn token_logprob(logits: &[f32], params: &SamplingParams, token: u32, top_n: usize) -> TokenLogprob {
    let inv_t = if params.is_greedy() { 1.0 } else { 1.0 / params.temperature as f64 };
    let max_f32 = max_logit(logits);
    let max = max_f32 as f64;
    let scaled = |l: f32| if l as f64 == max { 0.0 } else { (l as f64 - max) * inv_t };
    let log_sum = if max_f32 > f32::NEG_INFINITY {
        // The normaliser from single-precision weights, eight at a time: its relative error
        // (about 1e-7) is below the rounding of the f32 results; a double `exp` per vocabulary
        // entry cost SmolLM2 a tenth of a decode step per token.
        let mut weights = vec![0.0f32; logits.len()];
        crate::vmath::exp_gaps(logits, max_f32, inv_t as f32, &mut weights);
        sum_f64(&weights, |w| w as f64).ln()
    } else {
        logits.iter().map(|&l| scaled(l).exp()).sum::<f64>().ln()
    };
    let lp = |l: f32| (scaled(l) - log_sum) as f32;
    let logprob = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| lp(l));
    let top_n = top_n.min(MAX_TOP_LOGPROBS).min(logits.len());
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(top_n);
    if top_n > 0 {
        let by_likelihood = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let mut ids: Vec<(u32, f32)> =
            logits.iter().enumerate().filter(|(_, l)| !l.is_nan()).map(|(i, &l)| (i as u32, l)).collect();
        if top_n < ids.len() {
            ids.select_nth_unstable_by(top_n - 1, by_likelihood);
            ids.truncate(top_n);
        }
        ids.sort_unstable_by(by_likelihood);
        top.extend(ids.into_iter().map(|(id, l)| (id, lp(l))));
    }
    TokenLogprob { token, logprob, top }
}

// ---------------------------------------------------------------------------------------------
// Penalties
// ---------------------------------------------------------------------------------------------

/// How often each token occurs in a sequence's generated text; kept incrementally by callers that
/// apply penalties every step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenCounts {
    counts: HashMap<u32, u32>,
}

impl TokenCounts {
    pub fn from_tokens(tokens: &[u32]) -> Self {
        let mut counts = Self::default();
        for &t in tokens {
            counts.add(t);
        }
        counts
    }

    pub fn add(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
    }

    pub fn count(&self, token: u32) -> u32 {
        self.counts.get(&token).copied().unwrap_or(0)
    }
}

/// OpenAI presence/frequency penalties on raw logits, before [`probabilities`]/[`sample`]:
/// `logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)`, where counts are
/// over the *generated* tokens (not the prompt), as in OpenAI and vLLM.
pub fn apply_penalties(logits: &mut [f32], generated: &[u32], params: &SamplingParams) {
    if params.has_penalties() {
        apply_penalties_with_counts(logits, &TokenCounts::from_tokens(generated), params);
    }
}

/// [`apply_penalties`] with counts the caller keeps up to date. Ids outside the vocabulary are ignored.
pub fn apply_penalties_with_counts(logits: &mut [f32], counts: &TokenCounts, params: &SamplingParams) {
    if !params.has_penalties() {
        return;
    }
    for (&token, &count) in &counts.counts {
        if let Some(logit) = logits.get_mut(token as usize) {
            if count > 0 {
                *logit -= params.frequency_penalty * count as f32 + params.presence_penalty;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Stop strings
// ---------------------------------------------------------------------------------------------

/// Outcome of [`scan_stop_strings`]; all positions are byte offsets on `char` boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopScan {
    /// `stop_strings[stop_index]` starts at `match_start`: the output is `text[..match_start]`
    /// (the stop string itself is not returned, as in OpenAI) and generation ends.
    Matched { match_start: usize, stop_index: usize },
    /// No stop string occurs. `text[..emit_up_to]` is safe to stream; the rest could be the start
    /// of a stop string and must be held back until more text arrives (or flushed at the end).
    Pending { emit_up_to: usize },
}

impl StopScan {
    /// Bytes at the end of `text` that must not be streamed yet (0 after a match).
    pub fn held_back(&self, text: &str) -> usize {
        match *self {
            StopScan::Matched { .. } => 0,
            StopScan::Pending { emit_up_to } => text.len() - emit_up_to,
        }
    }
}

fn floor_char_boundary(text: &str, mut index: usize) -> usize {
    index = index.min(text.len());
    while !text.is_char_boundary(index) {
        index -= 1;
    }
    index
}

/// Looks for stop strings in the text generated so far, for streaming.
///
/// `search_from` is the `emit_up_to` of the previous scan (0 the first time): a stop string cannot
/// start inside already-emitted text, since any text that could start one was held back, so the
/// search (and the cost) covers only the new tail. The earliest match wins; at the same start, the
/// first listed stop string. Empty stop strings are ignored.
pub fn scan_stop_strings(text: &str, search_from: usize, stop_strings: &[String]) -> StopScan {
    let search_from = floor_char_boundary(text, search_from);
    let tail = &text[search_from..];
    let earliest = stop_strings
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.is_empty())
        .filter_map(|(i, s)| tail.find(s.as_str()).map(|at| (search_from + at, i)))
        .min();
    if let Some((match_start, stop_index)) = earliest {
        return StopScan::Matched { match_start, stop_index };
    }
    // Longest suffix of `text` (within the unsent tail) that is a proper prefix of a stop string.
    let bytes = tail.as_bytes();
    let mut hold = 0;
    for stop in stop_strings {
        let stop = stop.as_bytes();
        let longest_possible = (stop.len().saturating_sub(1)).min(bytes.len());
        for len in (hold + 1..=longest_possible).rev() {
            if bytes.ends_with(&stop[..len]) {
                hold = len;
                break;
            }
        }
    }
    StopScan::Pending { emit_up_to: floor_char_boundary(text, text.len() - hold) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, ..SamplingParams::default() }
    }

    fn support(probs: &[f32]) -> Vec<u32> {
        (0..probs.len() as u32).filter(|&i| probs[i as usize] > 0.0).collect()
    }

    fn ln_all(ps: &[f64]) -> Vec<f32> {
        ps.iter().map(|p| p.ln() as f32).collect()
    }

    fn assert_close(a: f32, b: f64, tol: f64) {
        assert!((a as f64 - b).abs() <= tol, "{a} vs {b}");
    }

    #[test]
    fn greedy_is_argmax_with_ties_to_lowest_id_and_draws_nothing() {
        let mut rng = SamplerRng::from_seed(7);
        let before = rng.clone();
        let g = SamplingParams::greedy();
        assert!(g.is_greedy());
        assert_eq!(sample(&[0.1, 3.0, -1.0, 3.0, 2.9], &g, &mut rng), 1);
        assert_eq!(sample(&[f32::NAN, -5.0, f32::NAN, -4.0], &g, &mut rng), 3);
        assert_eq!(sample(&[f32::NEG_INFINITY; 3], &g, &mut rng), 0);
        assert_eq!(rng, before, "greedy sampling must not consume randomness");
        assert_eq!(probabilities(&[1.0, 4.0, 4.0], &g), vec![0.0, 1.0, 0.0]);
        let (token, probs) = sample_with_probabilities(&[1.0, 4.0, 4.0], &g, &mut rng);
        assert_eq!((token, probs), (1, vec![0.0, 1.0, 0.0]));
    }

    /// The vectorised argmax against a plain scan, on vocabulary-sized rows: ties across
    /// lanes and chunks go to the lowest id, NaN is skipped, all-NaN gives 0.
    #[test]
    fn argmax_equals_a_plain_scan() {
        let scan = |xs: &[f32]| {
            let mut best: Option<(usize, f32)> = None;
            for (i, &v) in xs.iter().enumerate() {
                if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
                    best = Some((i, v));
                }
            }
            best.map_or(0, |(i, _)| i as u32)
        };
        let mut s = 5u64;
        for len in [0usize, 1, 15, 16, 17, 49152, 151936 + 3] {
            let mut xs: Vec<f32> = (0..len)
                .map(|_| {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((s >> 40) % 1000) as f32 / 100.0
                })
                .collect();
            assert_eq!(argmax(&xs), scan(&xs), "len {len}");
            if len > 40 {
                xs[len / 3] = 50.0;
                xs[len / 3 + 17] = 50.0;
                xs[len - 1] = 50.0;
                xs[2] = f32::NAN;
                assert_eq!(argmax(&xs), (len / 3) as u32, "ties, len {len}");
                xs.iter_mut().for_each(|x| *x = f32::NAN);
                assert_eq!(argmax(&xs), 0, "all NaN, len {len}");
                xs[len - 2] = f32::NEG_INFINITY;
                assert_eq!(argmax(&xs), (len - 2) as u32, "one -inf among NaN, len {len}");
            }
        }
    }

    #[test]
    fn temperature_scales_the_softmax() {
        let logits = [0.0f32, 1.0, 2.0];
        for t in [0.5f32, 1.0, 2.0] {
            let probs = probabilities(&logits, &params(t));
            let e: Vec<f64> = logits.iter().map(|&l| (l as f64 / t as f64).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..3 {
                assert_close(probs[i], e[i] / z, 1e-6);
            }
        }
    }

    #[test]
    fn top_k_keeps_exactly_k_with_ties_to_lower_ids() {
        let logits = [1.0f32, 5.0, 3.0, 5.0, 2.0];
        let p = |k| probabilities(&logits, &SamplingParams { top_k: k, ..params(1.0) });
        assert_eq!(support(&p(2)), vec![1, 3]);
        assert_eq!(support(&p(1)), vec![1]);
        assert_eq!(support(&p(3)), vec![1, 2, 3]);
        assert_eq!(support(&p(0)), vec![0, 1, 2, 3, 4]);
        assert_eq!(support(&p(99)), vec![0, 1, 2, 3, 4]);
        let two = p(2);
        assert_close(two[1], 0.5, 1e-6);
        assert_close(two[3], 0.5, 1e-6);
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_the_mass() {
        let logits = ln_all(&[0.5, 0.3, 0.15, 0.05]);
        let p = |top_p| probabilities(&logits, &SamplingParams { top_p, ..params(1.0) });
        assert_eq!(support(&p(0.4)), vec![0]);
        assert_eq!(support(&p(0.75)), vec![0, 1]);
        assert_eq!(support(&p(0.85)), vec![0, 1, 2]);
        assert_eq!(support(&p(0.99)), vec![0, 1, 2, 3]);
        let kept = p(0.85);
        assert_close(kept[0], 0.5 / 0.95, 1e-6);
        assert_close(kept[2], 0.15 / 0.95, 1e-6);
    }

    #[test]
    fn min_p_is_relative_to_the_top_probability() {
        let logits = ln_all(&[0.5, 0.3, 0.15, 0.05]);
        let p = |min_p| probabilities(&logits, &SamplingParams { min_p, ..params(1.0) });
        assert_eq!(support(&p(0.25)), vec![0, 1, 2]); // threshold 0.125
        assert_eq!(support(&p(0.5)), vec![0, 1]); // threshold 0.25
        assert_eq!(support(&p(1.0)), vec![0]);
    }

    #[test]
    fn filters_apply_in_the_documented_order() {
        let logits = ln_all(&[0.5, 0.3, 0.15, 0.05]);
        // top-k first: after top-2 the survivors are (0.625, 0.375), so top-p 0.6 keeps one token.
        // (top-p first would keep two: 0.5 < 0.6.)
        let kp = SamplingParams { top_k: 2, top_p: 0.6, ..params(1.0) };
        assert_eq!(support(&probabilities(&logits, &kp)), vec![0]);
        // Temperature before min-p: at T=1 token 3 (0.05 < 0.2 × 0.5) is dropped; at T=4 the
        // distribution flattens (0.05^¼ / 0.5^¼ ≈ 0.56 > 0.2) and it survives.
        let mp = |t| SamplingParams { min_p: 0.2, ..params(t) };
        assert_eq!(support(&probabilities(&logits, &mp(1.0))), vec![0, 1, 2]);
        assert_eq!(support(&probabilities(&logits, &mp(4.0))), vec![0, 1, 2, 3]);
        // Top-p sees the temperature-scaled distribution: at T=0.2 token 0 alone has > 0.9.
        let tp = |t| SamplingParams { top_p: 0.9, ..params(t) };
        assert_eq!(support(&probabilities(&logits, &tp(1.0))), vec![0, 1, 2]);
        assert_eq!(support(&probabilities(&logits, &tp(0.2))), vec![0]);
    }

    #[test]
    fn degenerate_logits_never_panic() {
        let p = params(1.0);
        let inf = probabilities(&[0.0, f32::INFINITY, 1.0, f32::INFINITY], &p);
        assert_eq!(inf, vec![0.0, 0.5, 0.0, 0.5]);
        let with_nan = probabilities(&[f32::NAN, 0.0, f32::NEG_INFINITY], &p);
        assert_eq!(with_nan, vec![0.0, 1.0, 0.0]);
        assert_eq!(probabilities(&[f32::NEG_INFINITY; 2], &p), vec![1.0, 0.0]);
        assert!(probabilities(&[], &p).is_empty());
        let mut rng = SamplerRng::from_seed(1);
        assert_eq!(sample(&[], &p, &mut rng), 0);
        // A tiny temperature is greedy in effect, with no overflow to NaN.
        let cold = probabilities(&[0.0, 1.0, 0.999], &params(1e-30));
        assert_eq!(cold, vec![0.0, 1.0, 0.0]);
    }

    #[test]
    fn sample_frequencies_match_probabilities() {
        // Chi-square goodness of fit over the 4 tokens top-k keeps.
        let logits = [0.3f32, -1.0, 2.0, 0.0, 1.1];
        let p = SamplingParams { top_k: 4, ..params(0.8) };
        let probs = probabilities(&logits, &p);
        let mut rng = SamplerRng::from_seed(2024);
        let n = 20_000;
        let mut observed = [0usize; 5];
        for _ in 0..n {
            observed[sample(&logits, &p, &mut rng) as usize] += 1;
        }
        assert_eq!(observed[1], 0, "top-k removed token 1");
        let chi2: f64 = [0, 2, 3, 4]
            .iter()
            .map(|&i| {
                let expected = probs[i] as f64 * n as f64;
                (observed[i] as f64 - expected).powi(2) / expected
            })
            .sum();
        assert!(chi2 < 16.27, "chi2 = {chi2} (3 dof)"); // p = 0.001 for 3 degrees of freedom
    }

    #[test]
    fn a_draw_over_many_blocks_lands_where_a_sum_in_order_does() {
        // Weights over 12 blocks: mostly tiny, some zero, a few large, as a softmax gives.
        let mut rng = SamplerRng::from_seed(77);
        let weights: Vec<f32> = (0..3000)
            .map(|i| match i % 97 {
                0 => 0.0,
                5 => 3.0 + rng.next_f64() as f32,
                _ => (rng.next_f64() as f32).powi(8) * 1e-3,
            })
            .collect();
        let in_order = |target: f64| {
            let mut cumulative = 0.0;
            weights.iter().position(|&w| {
                cumulative += w as f64;
                w > 0.0 && target < cumulative
            })
        };
        let total: f64 = weights.iter().map(|&w| w as f64).sum();
        for _ in 0..20_000 {
            let target = rng.next_f64() * total;
            assert_eq!(draw_at(&weights, target), in_order(target).map(|i| i as u32), "target {target}");
        }
        // Past the end through rounding: the last positive weight.
        assert_eq!(draw_at(&weights, total * 2.0), Some(2999 - (2999 % 97 == 0) as u32));
        assert_eq!(draw_at(&[0.0, 1.0, 0.0], 5.0), Some(1));
    }

    #[test]
    fn seeded_streams_are_reproducible() {
        // SplitMix64 reference output for seed 0 (the generator's published test value).
        let mut sm = 0u64;
        assert_eq!(splitmix64(&mut sm), 0xE220_A839_7B1D_CDAF);

        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplingParams { top_p: 0.95, seed: Some(42), ..params(1.0) };
        let stream = |seed| {
            let mut rng = SamplerRng::from_seed(seed);
            (0..200).map(|_| sample(&logits, &p, &mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(stream(42), stream(42));
        assert_ne!(stream(42), stream(43));
        let mut a = SamplerRng::for_params(&p);
        let mut b = SamplerRng::from_seed(42);
        assert_eq!(a.next_u64(), b.next_u64());
        // xoshiro256++ reference outputs for the state [1, 2, 3, 4].
        let mut reference = SamplerRng { state: [1, 2, 3, 4] };
        assert_eq!(reference.next_u64(), 41_943_041);
        assert_eq!(reference.next_u64(), 58_720_359);
        assert_eq!(reference.next_u64(), 3_588_806_011_781_223);
        let mut rng = SamplerRng::from_seed(42);
        for _ in 0..1000 {
            let u = rng.next_f64();
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn each_stochastic_sample_draws_exactly_one_number() {
        let logits = [0.1f32, 0.2, 0.3];
        let p = params(1.0);
        let mut rng = SamplerRng::from_seed(9);
        let mut reference = rng.clone();
        sample(&logits, &p, &mut rng);
        reference.next_u64();
        assert_eq!(rng, reference);
        let (token, probs) = sample_with_probabilities(&logits, &p, &mut rng.clone());
        assert_eq!(token, sample(&logits, &p, &mut rng));
        assert_eq!(probs, probabilities(&logits, &p));
    }

    #[test]
    fn penalties_follow_openai_semantics() {
        let mut logits = vec![1.0f32; 5];
        let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..params(1.0) };
        apply_penalties(&mut logits, &[2, 2, 2, 4, 99], &p);
        assert_eq!(logits, vec![1.0, 1.0, 1.0 - 0.75 - 0.5, 1.0, 1.0 - 0.25 - 0.5]);
        // Negative penalties encourage repetition.
        let mut logits = vec![0.0f32; 3];
        let neg = SamplingParams { presence_penalty: -1.0, ..params(1.0) };
        apply_penalties(&mut logits, &[1, 1], &neg);
        assert_eq!(logits, vec![0.0, 1.0, 0.0]);
        // Off by default: nothing changes.
        let mut logits = vec![0.5f32; 3];
        apply_penalties(&mut logits, &[0, 1, 2], &params(1.0));
        assert_eq!(logits, vec![0.5; 3]);
        let mut counts = TokenCounts::from_tokens(&[2, 2]);
        counts.add(4);
        assert_eq!((counts.count(2), counts.count(4), counts.count(0)), (2, 1, 0));
    }

    #[test]
    fn validation_names_the_bad_field() {
        assert!(SamplingParams::default().validate().is_ok());
        assert!(SamplingParams::greedy().validate().is_ok());
        let bad = |p: SamplingParams| p.validate().unwrap_err().field;
        let d = SamplingParams::default;
        assert_eq!(bad(SamplingParams { temperature: f32::NAN, ..d() }), "temperature");
        assert_eq!(bad(SamplingParams { temperature: -0.5, ..d() }), "temperature");
        assert_eq!(bad(SamplingParams { temperature: f32::INFINITY, ..d() }), "temperature");
        assert_eq!(bad(SamplingParams { top_p: 0.0, ..d() }), "top_p");
        assert_eq!(bad(SamplingParams { top_p: 1.5, ..d() }), "top_p");
        assert_eq!(bad(SamplingParams { top_p: f32::NAN, ..d() }), "top_p");
        assert_eq!(bad(SamplingParams { min_p: -0.1, ..d() }), "min_p");
        assert_eq!(bad(SamplingParams { presence_penalty: 2.5, ..d() }), "presence_penalty");
        assert_eq!(bad(SamplingParams { frequency_penalty: f32::NAN, ..d() }), "frequency_penalty");
        assert_eq!(bad(SamplingParams { max_tokens: Some(0), ..d() }), "max_tokens");
        assert_eq!(bad(SamplingParams { stop_strings: vec!["x".into(), "".into()], ..d() }), "stop");
        let message = SamplingParams { temperature: -1.0, ..d() }.validate().unwrap_err().to_string();
        assert!(message.contains("temperature") && message.contains("-1"), "{message}");
        // Unvalidated NaN temperature still decodes deterministically rather than panicking.
        assert!(SamplingParams { temperature: f32::NAN, ..d() }.is_greedy());
    }

    #[test]
    fn params_deserialize_with_defaults() {
        let p: SamplingParams = serde_json::from_str(r#"{"temperature":0.7,"top_k":40}"#).unwrap();
        assert_eq!(p, SamplingParams { temperature: 0.7, top_k: 40, ..SamplingParams::default() });
    }

    #[test]
    fn log_softmax_is_stable() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for (l, lp) in logits.iter().zip(log_softmax(&logits)) {
            assert_close(lp, *l as f64 - z.ln(), 1e-6);
        }
        // Huge logits that would overflow a naive exp.
        let big = log_softmax(&[1e4, 1e4 - 1.0, -1e4]);
        assert_close(big[0], -(1.0 + (-1.0f64).exp()).ln(), 1e-5);
        assert_close(big[1], -1.0 - (1.0 + (-1.0f64).exp()).ln(), 1e-5);
        assert!(big[2] < -1e4 && big[2].is_finite());
        let masked = log_softmax(&[f32::NEG_INFINITY, 0.0]);
        assert_eq!(masked, vec![f32::NEG_INFINITY, 0.0]);
    }

    #[test]
    fn stop_strings_match_and_hold_back_partial_prefixes() {
        let stops = vec!["###".to_string(), "END".to_string()];
        assert_eq!(scan_stop_strings("hello", 0, &stops), StopScan::Pending { emit_up_to: 5 });
        let held = scan_stop_strings("hello ##", 0, &stops);
        assert_eq!(held, StopScan::Pending { emit_up_to: 6 });
        assert_eq!(held.held_back("hello ##"), 2);
        assert_eq!(scan_stop_strings("hello E", 0, &stops), StopScan::Pending { emit_up_to: 6 });
        assert_eq!(
            scan_stop_strings("hello ### and END", 6, &stops),
            StopScan::Matched { match_start: 6, stop_index: 0 }
        );
        // Earliest match wins regardless of list order.
        assert_eq!(scan_stop_strings("a END b ###", 0, &stops), StopScan::Matched { match_start: 2, stop_index: 1 });
        // A stop string that straddles two streamed chunks is found from the previous boundary.
        let first = scan_stop_strings("text #", 0, &stops);
        let StopScan::Pending { emit_up_to } = first else { panic!() };
        assert_eq!(emit_up_to, 5);
        assert_eq!(scan_stop_strings("text ##", emit_up_to, &stops), StopScan::Pending { emit_up_to: 5 });
        assert_eq!(
            scan_stop_strings("text ###", emit_up_to, &stops),
            StopScan::Matched { match_start: 5, stop_index: 0 }
        );
        // Multi-byte text: held-back ranges stay on char boundaries.
        let unicode = vec!["→ fin".to_string()];
        let text = "café →";
        let scan = scan_stop_strings(text, 0, &unicode);
        assert_eq!(scan, StopScan::Pending { emit_up_to: "café ".len() });
        assert_eq!(scan_stop_strings("día", 2, &unicode), StopScan::Pending { emit_up_to: 4 });
        assert_eq!(scan_stop_strings("abc", 0, &[]), StopScan::Pending { emit_up_to: 3 });
    }

    /// Reference top-p by a full sort, to check the incremental partial selection.
    fn top_p_support_by_full_sort(logits: &[f32], temperature: f32, top_p: f32) -> Vec<u32> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        let inv_temperature = 1.0 / temperature as f64;
        let weights: Vec<f64> = logits.iter().map(|&l| ((l as f64 - max) * inv_temperature).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut cumulative = 0.0;
        let mut kept = Vec::new();
        for id in order {
            kept.push(id);
            cumulative += weights[id as usize];
            if cumulative >= top_p as f64 * total {
                break;
            }
        }
        kept.sort();
        kept
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn probabilities_form_a_distribution(
            logits in prop::collection::vec(-20.0f32..20.0, 1..400),
            temperature in 0.05f32..3.0,
            top_k in 0usize..50,
            top_p in 0.05f32..=1.0,
            min_p in 0.0f32..0.5,
        ) {
            let p = SamplingParams { temperature, top_k, top_p, min_p, ..SamplingParams::default() };
            let probs = probabilities(&logits, &p);
            let sum: f64 = probs.iter().map(|&x| x as f64).sum();
            prop_assert!((sum - 1.0).abs() < 1e-4, "sum = {}", sum);
            prop_assert!(probs.iter().all(|&x| (0.0..=1.0).contains(&x)));
            let kept = support(&probs).len();
            prop_assert!(kept >= 1);
            if top_k > 0 { prop_assert!(kept <= top_k); }
            // The argmax always survives every filter.
            prop_assert!(probs[argmax(&logits) as usize] > 0.0);
            // Surviving tokens keep their relative order of likelihood.
            for i in 0..logits.len() {
                for j in 0..logits.len() {
                    if logits[i] > logits[j] && probs[j] > 0.0 {
                        prop_assert!(probs[i] >= probs[j]);
                    }
                }
            }
        }

        #[test]
        fn incremental_top_p_matches_a_full_sort(
            logits in prop::collection::vec(-8.0f32..8.0, 1..3000),
            temperature in 0.3f32..4.0,
            top_p in 0.05f32..0.999,
        ) {
            let p = SamplingParams { temperature, top_p, ..SamplingParams::default() };
            let probs = probabilities(&logits, &p);
            prop_assert_eq!(support(&probs), top_p_support_by_full_sort(&logits, temperature, top_p));
        }
    }

    #[test]
    fn token_logprobs_are_the_tempered_log_softmax_with_the_most_likely_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, f32::NEG_INFINITY];
        let greedy = SamplingParams::greedy();
        let lp = token_logprob(&logits, &greedy, 2, 3);
        let reference = log_softmax(&logits);
        assert!((lp.logprob - reference[2]).abs() < 1e-6);
        // Ties in order of id; -inf stays -inf.
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert_eq!(token_logprob(&logits, &greedy, 4, 0).logprob, f32::NEG_INFINITY);
        let hot = SamplingParams { temperature: 0.5, top_k: 1, ..Default::default() };
        let scaled: Vec<f32> = logits.iter().map(|l| l / 0.5).collect();
        let lp = token_logprob(&logits, &hot, 0, 1);
        assert!((lp.logprob - log_softmax(&scaled)[0]).abs() < 1e-6, "truncation is not applied");
        assert_eq!(token_logprob(&logits, &hot, 0, 99).top.len(), 5);
        assert_eq!(token_logprob(&logits, &hot, 99, 1).logprob, f32::NEG_INFINITY);
    }
}
