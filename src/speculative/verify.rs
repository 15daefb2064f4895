//! The speculative verifier: one pure function, shared by every drafter, that decides how many
//! draft tokens the target accepts and which token it emits after them. No engine state.
//!
//! Row convention: the target runs on `[last_committed, d1, …, dk]` and returns `k + 1` logits rows;
//! row `i` is the target's next-token logits after consuming the `i`-th of those tokens, so row
//! `i` scores `d(i+1)` and row `k` gives the bonus token when every draft is accepted. A draft
//! tree ([`Draft`]) has the same rows, one per node, each scored after its own path; a chain is
//! the tree with one child per node, and everything below holds for both.
//!
//! * Greedy (`params.is_greedy()`): accept the longest prefix with `d(i+1) == argmax(row i)`; the
//!   next token is the argmax of the row after the last accepted draft. The committed stream is
//!   exactly plain greedy decoding.
//! * `T > 0`: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). With `p` the
//!   target distribution of a row ([`sample::probabilities`], so filters match plain sampling) and
//!   `q` the distribution the drafter drew the token from (one-hot for a deterministic drafter),
//!   accept `d` with probability `min(1, p(d)/q(d))`; on the first rejection emit a draw from
//!   `normalise(max(p − q, 0))`; when all are accepted, emit the bonus from the last row via
//!   [`sample::sample`]. Each emitted token is then an exact draw from the target.
//!
//! An empty draft reduces to one [`sample::sample`] call on row 0 with the same `rng`, so plain
//! decoding with seed s and speculation whose drafter proposes nothing give identical streams.
//!
//! Penalties are not applied here: they depend on the history, which differs per row. Apply them
//! to the rows first with [`penalize_verification_rows`].

pub use super::draft::Draft;
use crate::sample::{self, SamplerRng, SamplingParams, TokenCounts};

/// The verifier's decision for one sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Number of draft tokens accepted (`0..=depth`).
    pub accepted: usize,
    /// The token emitted after them: the correction on a rejection, the bonus when a leaf is
    /// accepted. Always a target token, so every step commits at least one.
    pub next_token: u32,
    /// The accepted nodes, first drafted position first (a chain: `0..accepted`).
    pub path: Vec<usize>,
}

impl Verdict {
    /// The tokens this step commits: the accepted path's tokens followed by `next_token`.
    pub fn committed(&self, draft: &[u32]) -> Vec<u32> {
        let mut tokens: Vec<u32> = self.path.iter().map(|&n| draft[n]).collect();
        tokens.push(self.next_token);
        tokens
    }

    /// The forward rows of the committed path: row 0, then each accepted node's row.
    pub fn rows(&self) -> Vec<usize> {
        std::iter::once(0).chain(self.path.iter().map(|&n| n + 1)).collect()
    }
}

/// Decides which of the draft's nodes the target accepts and the token that follows them.
///
/// `target_logits` holds one row per forward row (row 0, then one per node), already
/// penalised if the request uses penalties. A draft token outside a row's vocabulary is
/// simply rejected.
///
/// From row 0 the walk goes down the tree. Greedy: it takes the child whose token is the
/// row's argmax, and stops with the argmax when no child has it. `T > 0`: the children are
/// tried in sibling order, each a speculative-sampling step against what is left of the
/// target distribution `p` (accept with probability `min(1, p(d)/q(d))`; on a rejection `p`
/// becomes `normalise(max(p − q, 0))`); when every child is rejected the next token is drawn
/// from what is left. Each step of this recursive rejection sampling outputs a draw from the
/// distribution it was given, so the committed tokens are exact draws from the target
/// (SpecInfer; EAGLE). With one child per node it is the chain algorithm, draw for draw.
///
/// # Panics
/// If `target_logits.len() != draft.len() + 1`, or `draft.probs` has a different number of
/// rows than `draft.tokens`: both are bugs in the caller, not properties of the input text.
pub fn verify<R: AsRef<[f32]>>(
    draft: &Draft,
    target_logits: &[R],
    params: &SamplingParams,
    rng: &mut SamplerRng,
) -> Verdict {
    let k = draft.len();
    assert_eq!(target_logits.len(), k + 1, "verify needs k + 1 = {} target rows for a draft of {k} tokens", k + 1);
    if let Some(probs) = &draft.probs {
        assert_eq!(probs.len(), k, "draft has {k} tokens but {} probability rows", probs.len());
    }
    let row = |i: usize| target_logits[i].as_ref();
    let children = draft.children();
    let mut path = Vec::new();
    let mut at = 0;
    let done = |path: Vec<usize>, next_token| Verdict { accepted: path.len(), next_token, path };

    if params.is_greedy() {
        loop {
            let best = sample::argmax(row(at));
            match children[at].iter().find(|&&n| draft.tokens[n] == best) {
                Some(&n) => {
                    path.push(n);
                    at = n + 1;
                }
                None => return done(path, sample::sample(row(at), params, rng)),
            }
        }
    }

    'rows: loop {
        let kids = &children[at];
        if kids.is_empty() {
            return done(path, sample::sample(row(at), params, rng));
        }
        let mut p = sample::probabilities(row(at), params);
        for (rank, &n) in kids.iter().enumerate() {
            let d = draft.tokens[n];
            let p_d = p.get(d as usize).copied().unwrap_or(0.0);
            let q_row = draft
                .probs
                .as_ref()
                .map(|probs| probs[n].as_slice())
                .filter(|q| q.get(d as usize).is_some_and(|&q_d| q_d > 0.0 && q_d.is_finite()));
            let q_d = q_row.map_or(1.0, |q| q[d as usize]);
            // Accept with probability min(1, p/q); draw only when the outcome is uncertain.
            let accept = p_d >= q_d || (p_d > 0.0 && rng.next_f64() * (q_d as f64) < p_d as f64);
            if accept {
                path.push(n);
                at = n + 1;
                continue 'rows;
            }
            if rank + 1 == kids.len() {
                return done(path, sample_residual(&p, q_row, d, rng));
            }
            if let Some(left) = normalised(residual(&p, q_row, d)) {
                p = left;
            }
        }
    }
}

/// `max(p − q, 0)`; with a one-hot `q` (None), `p` without the rejected token.
fn residual(p: &[f32], q: Option<&[f32]>, draft_token: u32) -> Vec<f32> {
    match q {
        Some(q) => p.iter().enumerate().map(|(t, &p_t)| (p_t - q.get(t).copied().unwrap_or(0.0)).max(0.0)).collect(),
        None => {
            let mut without = p.to_vec();
            if let Some(p_d) = without.get_mut(draft_token as usize) {
                *p_d = 0.0;
            }
            without
        }
    }
}

/// `weights` scaled to sum to one; None when they have no mass (possible only for a `q`
/// that is not a proper distribution: then the caller keeps `p`).
fn normalised(mut weights: Vec<f32>) -> Option<Vec<f32>> {
    let total: f64 = weights.iter().map(|&w| w as f64).sum();
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    weights.iter_mut().for_each(|w| *w = (*w as f64 / total) as f32);
    Some(weights)
}

/// After rejecting `draft_token`: a draw from `normalise(max(p − q, 0))`, or from `p` when that
/// residual has no mass (possible only for a `q` that is not a proper distribution).
fn sample_residual(p: &[f32], q: Option<&[f32]>, draft_token: u32, rng: &mut SamplerRng) -> u32 {
    let residual = residual(p, q, draft_token);
    sample::sample_from_weights(&residual, rng)
        .or_else(|| sample::sample_from_weights(p, rng))
        .unwrap_or_else(|| sample::argmax(p))
}

/// Applies the request's presence/frequency penalties to verification rows: row 0 is
/// penalised for `generated`, and a node's row for `generated` followed by the tokens on its
/// path, the history it would have in plain decoding. `rows` may be shorter than
/// `draft.len() + 1` (the nodes past it are then unused).
pub fn penalize_verification_rows<R: AsMut<[f32]>>(
    rows: &mut [R],
    generated: &[u32],
    draft: &Draft,
    params: &SamplingParams,
) {
    if !params.has_penalties() {
        return;
    }
    let base = TokenCounts::from_tokens(generated);
    let mut counts = base.clone();
    for (r, row) in rows.iter_mut().enumerate() {
        if r > 0 && r <= draft.len() {
            if draft.is_tree() {
                counts = base.clone();
                draft.path_tokens(r - 1).into_iter().for_each(|t| counts.add(t));
            } else {
                counts.add(draft.tokens[r - 1]);
            }
        }
        sample::apply_penalties_with_counts(row.as_mut(), &counts, params);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A deterministic toy language model: the next-token logits are a fixed random function of the
    /// last two tokens (ids outside the vocabulary are folded in, so rows after a bad draft exist).
    struct ToyLm {
        vocab: usize,
        table: Vec<f32>,
    }

    impl ToyLm {
        fn random(vocab: usize, seed: u64, spread: f32, quantized: bool) -> Self {
            let mut rng = SamplerRng::from_seed(seed);
            let table = (0..vocab * vocab * vocab)
                .map(|_| {
                    let x = (rng.next_f64() as f32 * 2.0 - 1.0) * spread;
                    // Quantised logits make ties common, to exercise the tie rules.
                    if quantized {
                        x.round()
                    } else {
                        x
                    }
                })
                .collect();
            Self { vocab, table }
        }

        fn next_logits(&self, context: &[u32]) -> Vec<f32> {
            let v = self.vocab;
            let at = |back: usize| context.len().checked_sub(back).map_or(0, |i| context[i] as usize % v);
            let start = (at(2) * v + at(1)) * v;
            self.table[start..start + v].to_vec()
        }

        /// Target rows for verifying `draft` after `context`, penalised as plain decoding would be.
        fn verification_rows(
            &self,
            context: &[u32],
            prompt_len: usize,
            draft: &[u32],
            params: &SamplingParams,
        ) -> Vec<Vec<f32>> {
            let mut rows: Vec<Vec<f32>> = (0..=draft.len())
                .map(|i| {
                    let mut ctx = context.to_vec();
                    ctx.extend_from_slice(&draft[..i]);
                    self.next_logits(&ctx)
                })
                .collect();
            penalize_verification_rows(
                &mut rows,
                &context[prompt_len..],
                &Draft::deterministic(draft.to_vec()),
                params,
            );
            rows
        }

        /// Plain decoding: one `sample::sample` per token.
        fn plain_decode(&self, prompt: &[u32], n: usize, params: &SamplingParams, rng: &mut SamplerRng) -> Vec<u32> {
            let mut context = prompt.to_vec();
            while context.len() < prompt.len() + n {
                let mut logits = self.next_logits(&context);
                sample::apply_penalties(&mut logits, &context[prompt.len()..], params);
                context.push(sample::sample(&logits, params, rng));
            }
            context[prompt.len()..].to_vec()
        }
    }

    /// How a test drafter proposes tokens.
    enum Drafter<'a> {
        /// Proposes nothing (k = 0).
        Empty,
        /// Rolls the target itself forward greedily (with penalties): always right under greedy.
        PerfectGreedy(&'a ToyLm),
        /// Uniform random tokens, sometimes outside the vocabulary; deterministic q (one-hot).
        Random { vocab: usize },
        /// The perfect greedy proposal, but each token replaced at random with probability 1/3.
        PartlyRight(&'a ToyLm),
        /// Argmax of its own, different toy LM: deterministic and often wrong.
        OneHotOther(&'a ToyLm),
        /// Samples from its own toy LM under its own params and reports q.
        OwnQ(&'a ToyLm, SamplingParams),
        /// Samples from the target's own distribution p and reports q = p: always accepted.
        ExactTarget(&'a ToyLm),
    }

    impl Drafter<'_> {
        fn propose(
            &self,
            context: &[u32],
            prompt_len: usize,
            k: usize,
            params: &SamplingParams,
            rng: &mut SamplerRng,
        ) -> Draft {
            let greedy_rollout = |lm: &ToyLm| {
                let mut ctx = context.to_vec();
                for _ in 0..k {
                    let mut logits = lm.next_logits(&ctx);
                    sample::apply_penalties(&mut logits, &ctx[prompt_len..], params);
                    ctx.push(sample::argmax(&logits));
                }
                ctx[context.len()..].to_vec()
            };
            let sampled_rollout = |lm: &ToyLm, draft_params: &SamplingParams, rng: &mut SamplerRng| {
                let mut ctx = context.to_vec();
                let mut probs = Vec::new();
                for _ in 0..k {
                    let logits = lm.next_logits(&ctx);
                    let (token, q) = sample::sample_with_probabilities(&logits, draft_params, rng);
                    ctx.push(token);
                    probs.push(q);
                }
                Draft { tokens: ctx[context.len()..].to_vec(), probs: Some(probs), parents: Vec::new() }
            };
            match self {
                Drafter::Empty => Draft::default(),
                Drafter::PerfectGreedy(lm) => Draft::deterministic(greedy_rollout(lm)),
                Drafter::Random { vocab } => {
                    Draft::deterministic((0..k).map(|_| (rng.next_u64() % (*vocab as u64 + 2)) as u32).collect())
                }
                Drafter::PartlyRight(lm) => {
                    let mut tokens = greedy_rollout(lm);
                    for t in &mut tokens {
                        if rng.next_u64().is_multiple_of(3) {
                            *t = (rng.next_u64() % lm.vocab as u64) as u32;
                        }
                    }
                    Draft::deterministic(tokens)
                }
                Drafter::OneHotOther(lm) => Draft::deterministic(greedy_rollout(lm)),
                Drafter::OwnQ(lm, draft_params) => sampled_rollout(lm, draft_params, rng),
                Drafter::ExactTarget(lm) => sampled_rollout(lm, params, rng),
            }
        }
    }

    /// Statistics of one speculative run.
    #[derive(Default)]
    struct SpecStats {
        drafted: usize,
        accepted: usize,
    }

    /// Speculative decoding of `n` tokens: draft → verify → commit accepted + next.
    #[allow(clippy::too_many_arguments)]
    fn speculative_decode(
        target: &ToyLm,
        drafter: &Drafter,
        prompt: &[u32],
        n: usize,
        max_draft: usize,
        params: &SamplingParams,
        rng: &mut SamplerRng,
        drafter_rng: &mut SamplerRng,
        stats: &mut SpecStats,
    ) -> Vec<u32> {
        let mut context = prompt.to_vec();
        while context.len() < prompt.len() + n {
            let k = 1 + (drafter_rng.next_u64() % max_draft as u64) as usize;
            let draft = drafter.propose(&context, prompt.len(), k, params, drafter_rng);
            let rows = target.verification_rows(&context, prompt.len(), &draft.tokens, params);
            let verdict = verify(&draft, &rows, params, rng);
            assert!(verdict.accepted <= draft.tokens.len());
            assert!((verdict.next_token as usize) < target.vocab, "emitted a token outside the vocabulary");
            stats.drafted += draft.tokens.len();
            stats.accepted += verdict.accepted;
            context.extend(verdict.committed(&draft.tokens));
        }
        context[prompt.len()..prompt.len() + n].to_vec()
    }

    #[test]
    fn greedy_accepts_the_matching_prefix() {
        // Rows' argmaxes are 2, 0, 1, 3.
        let rows =
            [vec![0.0f32, 1.0, 5.0, 0.0], vec![9.0, 1.0, 5.0, 0.0], vec![0.0, 7.0, 5.0, 7.0], vec![0.0, 1.0, 2.0, 3.0]];
        let g = SamplingParams::greedy();
        let mut rng = SamplerRng::from_seed(0);
        let v = |tokens: Vec<u32>, rng: &mut SamplerRng| {
            let n = tokens.len();
            verify(&Draft::deterministic(tokens), &rows[..n + 1], &g, rng)
        };
        assert_eq!(v(vec![2, 0, 1], &mut rng), Verdict { accepted: 3, next_token: 3, path: (0..3).collect() });
        assert_eq!(v(vec![2, 0, 3], &mut rng), Verdict { accepted: 2, next_token: 1, path: (0..2).collect() }); // tie → 1
        assert_eq!(v(vec![1, 0, 1], &mut rng), Verdict { accepted: 0, next_token: 2, path: (0..0).collect() });
        assert_eq!(v(vec![2, 99, 1], &mut rng), Verdict { accepted: 1, next_token: 0, path: (0..1).collect() });
        assert_eq!(v(vec![], &mut rng), Verdict { accepted: 0, next_token: 2, path: (0..0).collect() });
        assert_eq!(rng, SamplerRng::from_seed(0), "greedy verification draws nothing");
        let verdict = Verdict { accepted: 2, next_token: 1, path: (0..2).collect() };
        assert_eq!(verdict.committed(&[2, 0, 3]), vec![2, 0, 1]);
    }

    #[test]
    fn stochastic_edge_cases() {
        let p = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
        // A draft token outside the vocabulary is rejected and the target samples normally.
        let rows = [vec![0.0f32, 1.0, 2.0], vec![0.0, 0.0, 0.0]];
        for seed in 0..50 {
            let verdict = verify(&Draft::deterministic(vec![7]), &rows, &p, &mut SamplerRng::from_seed(seed));
            assert_eq!(verdict.accepted, 0);
            assert!(verdict.next_token < 3);
        }
        // A token the target cannot produce (filtered by top-k) is always rejected, and the
        // replacement is never a filtered token.
        let top1 = SamplingParams { top_k: 1, ..p.clone() };
        for seed in 0..50 {
            let verdict = verify(&Draft::deterministic(vec![0]), &rows, &top1, &mut SamplerRng::from_seed(seed));
            assert_eq!(verdict, Verdict { accepted: 0, next_token: 2, path: (0..0).collect() });
        }
        // A q row that gives its own token no mass is treated as one-hot, not as "infinitely
        // likely to accept"; a certain target token is always accepted.
        let certain = [vec![0.0f32, 100.0, 0.0], vec![0.0, 0.0, 100.0]];
        let draft = Draft { tokens: vec![1], probs: Some(vec![vec![1.0, 0.0, 0.0]]), parents: Vec::new() };
        let verdict = verify(&draft, &certain, &p, &mut SamplerRng::from_seed(3));
        assert_eq!(verdict, Verdict { accepted: 1, next_token: 2, path: (0..1).collect() });
        // q with a different length than the vocabulary.
        let short_q = Draft { tokens: vec![0], probs: Some(vec![vec![0.9]]), parents: Vec::new() };
        for seed in 0..50 {
            let verdict = verify(&short_q, &rows, &p, &mut SamplerRng::from_seed(seed));
            assert!(verdict.next_token < 3);
        }
    }

    #[test]
    fn empty_draft_is_exactly_plain_sampling() {
        let lm = ToyLm::random(7, 11, 2.0, false);
        let params = SamplingParams { temperature: 0.9, top_p: 0.9, ..SamplingParams::default() };
        let prompt = [1, 2];
        let plain = lm.plain_decode(&prompt, 300, &params, &mut SamplerRng::from_seed(5));
        let mut rng = SamplerRng::from_seed(5);
        let mut context = prompt.to_vec();
        while context.len() < prompt.len() + 300 {
            let draft = Drafter::Empty.propose(&context, 2, 0, &params, &mut SamplerRng::from_seed(0));
            let rows = lm.verification_rows(&context, 2, &draft.tokens, &params);
            let verdict = verify(&draft, &rows, &params, &mut rng);
            context.extend(verdict.committed(&draft.tokens));
        }
        assert_eq!(&context[2..], plain.as_slice());
        // And verify draws exactly what sample draws.
        let row = lm.next_logits(&[3, 4]);
        let mut a = SamplerRng::from_seed(77);
        let mut b = a.clone();
        assert_eq!(
            verify(&Draft::default(), &[&row[..]], &params, &mut a).next_token,
            sample::sample(&row, &params, &mut b)
        );
        assert_eq!(a, b);
    }

    #[test]
    fn penalized_rows_see_the_draft_as_history() {
        let params = SamplingParams { frequency_penalty: 1.0, presence_penalty: 0.5, ..SamplingParams::default() };
        let mut rows = vec![vec![0.0f32; 4]; 3];
        penalize_verification_rows(&mut rows, &[1, 1], &Draft::deterministic(vec![1, 3]), &params);
        assert_eq!(rows[0], vec![0.0, -2.5, 0.0, 0.0]);
        assert_eq!(rows[1], vec![0.0, -3.5, 0.0, 0.0]);
        assert_eq!(rows[2], vec![0.0, -3.5, 0.0, -1.5]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// Under greedy decoding every drafter, right or wrong, yields exactly the target's own
        /// greedy stream, and the perfect drafter has every token accepted.
        #[test]
        fn greedy_speculation_equals_plain_greedy(
            seed in any::<u64>(),
            vocab in 2usize..10,
            drafter_kind in 0usize..4,
            max_draft in 1usize..=16,
            quantized in any::<bool>(),
            penalties in any::<bool>(),
        ) {
            let target = ToyLm::random(vocab, seed, 3.0, quantized);
            let params = SamplingParams {
                frequency_penalty: if penalties { 0.7 } else { 0.0 },
                presence_penalty: if penalties { 0.3 } else { 0.0 },
                ..SamplingParams::greedy()
            };
            let prompt = [seed as u32 % vocab as u32, 1];
            let n = 60;
            let plain = target.plain_decode(&prompt, n, &params, &mut SamplerRng::from_seed(0));
            let drafter = match drafter_kind {
                0 => Drafter::PerfectGreedy(&target),
                1 => Drafter::Random { vocab },
                2 => Drafter::PartlyRight(&target),
                _ => Drafter::Empty,
            };
            let mut stats = SpecStats::default();
            let spec = speculative_decode(
                &target, &drafter, &prompt, n, max_draft, &params,
                &mut SamplerRng::from_seed(1), &mut SamplerRng::from_seed(seed ^ 0x5eed), &mut stats,
            );
            prop_assert_eq!(spec, plain);
            if drafter_kind == 0 {
                prop_assert_eq!(stats.accepted, stats.drafted);
            }
        }
    }

    // ---- T > 0: the distribution of the first tokens must be the target's, exactly ----

    /// Upper critical value of chi-square with `dof` degrees of freedom at p = 0.001
    /// (Wilson–Hilferty; within ~1% for dof >= 3, which is all we need).
    fn chi_square_critical_0_001(dof: usize) -> f64 {
        let z = 3.090_232_306; // standard normal quantile at 0.999
        let d = dof as f64;
        let h = 2.0 / (9.0 * d);
        d * (1.0 - h + z * h.sqrt()).powi(3)
    }

    /// Exact probability of every `len`-token continuation of `prompt` under plain sampling.
    fn exact_sequence_distribution(target: &ToyLm, prompt: &[u32], len: usize, params: &SamplingParams) -> Vec<f64> {
        let v = target.vocab;
        (0..v.pow(len as u32))
            .map(|index| {
                let mut context = prompt.to_vec();
                let mut probability = 1.0f64;
                for position in 0..len {
                    let token = (index / v.pow((len - 1 - position) as u32)) % v;
                    probability *= sample::probabilities(&target.next_logits(&context), params)[token] as f64;
                    context.push(token as u32);
                }
                probability
            })
            .collect()
    }

    /// Chi-square statistic and degrees of freedom of `observed` against `expected` probabilities.
    /// Cells with expected count < 5 are pooled; outcomes of probability 0 must never occur.
    fn chi_square(observed: &[usize], expected: &[f64], n: usize) -> (f64, usize) {
        let mut cells: Vec<(f64, f64)> = Vec::new();
        let mut pooled = (0.0, 0.0);
        for (&o, &p) in observed.iter().zip(expected) {
            let e = p * n as f64;
            if p == 0.0 {
                assert_eq!(o, 0, "an impossible sequence was sampled");
            } else if e < 5.0 {
                pooled.0 += o as f64;
                pooled.1 += e;
            } else {
                cells.push((o as f64, e));
            }
        }
        if pooled.1 >= 5.0 {
            cells.push(pooled);
        } else if pooled.1 > 0.0 {
            let smallest =
                cells.iter_mut().min_by(|a, b| a.1.total_cmp(&b.1)).expect("at least one well-populated cell");
            smallest.0 += pooled.0;
            smallest.1 += pooled.1;
        }
        let statistic = cells.iter().map(|(o, e)| (o - e).powi(2) / e).sum();
        (statistic, cells.len() - 1)
    }

    const SEQUENCE_LEN: usize = 3;
    const SAMPLES: usize = 20_000;

    fn sequence_index(tokens: &[u32], vocab: usize) -> usize {
        tokens.iter().fold(0, |acc, &t| acc * vocab + t as usize)
    }

    /// Draws `SAMPLES` continuations with `decode(rng, drafter_rng, stats)` and checks their
    /// distribution against `expected` (chi-square at p = 0.001); returns the run's stats.
    fn assert_distribution(
        what: &str,
        expected: &[f64],
        vocab: usize,
        seed: u64,
        mut decode: impl FnMut(&mut SamplerRng, &mut SamplerRng, &mut SpecStats) -> Vec<u32>,
    ) -> SpecStats {
        let mut rng = SamplerRng::from_seed(seed);
        let mut drafter_rng = SamplerRng::from_seed(seed + 1000);
        let mut stats = SpecStats::default();
        let mut observed = vec![0usize; expected.len()];
        for _ in 0..SAMPLES {
            observed[sequence_index(&decode(&mut rng, &mut drafter_rng, &mut stats), vocab)] += 1;
        }
        let (statistic, dof) = chi_square(&observed, expected, SAMPLES);
        let critical = chi_square_critical_0_001(dof);
        assert!(statistic < critical, "{what}: chi2 = {statistic:.1} >= {critical:.1} ({dof} dof)");
        stats
    }

    fn target_params() -> Vec<(&'static str, SamplingParams)> {
        let d = SamplingParams::default;
        vec![
            ("T=0.9", SamplingParams { temperature: 0.9, ..d() }),
            ("T=1.3 top_k=3", SamplingParams { temperature: 1.3, top_k: 3, ..d() }),
            ("T=1 top_p=0.7", SamplingParams { temperature: 1.0, top_p: 0.7, ..d() }),
            ("T=0.7 top_k=4 min_p=0.15", SamplingParams { temperature: 0.7, top_k: 4, min_p: 0.15, ..d() }),
        ]
    }

    #[test]
    fn rejection_sampling_preserves_the_target_distribution() {
        let vocab = 5;
        let target = ToyLm::random(vocab, 1234, 2.5, false);
        let other = ToyLm::random(vocab, 999, 2.5, false);
        let prompt = [1u32, 3];
        let own_q_params = SamplingParams { temperature: 1.5, top_k: 4, ..SamplingParams::default() };
        for (config_index, (name, params)) in target_params().into_iter().enumerate() {
            let expected = exact_sequence_distribution(&target, &prompt, SEQUENCE_LEN, &params);
            let total: f64 = expected.iter().sum();
            assert!((total - 1.0).abs() < 1e-5);
            let drafters = [
                ("one-hot, often wrong", Drafter::OneHotOther(&other)),
                ("random tokens incl. out of vocab", Drafter::Random { vocab }),
                ("own q", Drafter::OwnQ(&other, own_q_params.clone())),
                ("q = p", Drafter::ExactTarget(&target)),
            ];
            for (drafter_index, (drafter_name, drafter)) in drafters.iter().enumerate() {
                let seed = (config_index * 16 + drafter_index) as u64;
                let what = format!("{name}, drafter {drafter_name}");
                let stats = assert_distribution(&what, &expected, vocab, seed, |rng, drafter_rng, stats| {
                    speculative_decode(&target, drafter, &prompt, SEQUENCE_LEN, 4, &params, rng, drafter_rng, stats)
                });
                if matches!(drafter, Drafter::ExactTarget(_)) {
                    assert_eq!(stats.accepted, stats.drafted, "q = p must accept every draft");
                } else {
                    assert!(stats.accepted < stats.drafted, "{drafter_name} should see rejections");
                }
            }
        }
    }

    /// The same test has the power to catch a subtly wrong verifier: resampling from p (instead of
    /// the residual) after a rejection over-produces the rejected token.
    #[test]
    fn chi_square_test_detects_a_biased_verifier() {
        let vocab = 5;
        let target = ToyLm::random(vocab, 1234, 2.5, false);
        let other = ToyLm::random(vocab, 999, 2.5, false);
        let prompt = [1u32, 3];
        let params = SamplingParams { temperature: 0.9, ..SamplingParams::default() };
        let expected = exact_sequence_distribution(&target, &prompt, SEQUENCE_LEN, &params);
        let mut rng = SamplerRng::from_seed(42);
        let mut observed = vec![0usize; expected.len()];
        for _ in 0..SAMPLES {
            let mut context = prompt.to_vec();
            while context.len() < prompt.len() + SEQUENCE_LEN {
                let d = sample::argmax(&other.next_logits(&context));
                let p = sample::probabilities(&target.next_logits(&context), &params);
                let next = if rng.next_f64() < p[d as usize] as f64 {
                    d
                } else {
                    sample::sample(&target.next_logits(&context), &params, &mut rng)
                    // the bug
                };
                context.push(next);
            }
            observed[sequence_index(&context[prompt.len()..], vocab)] += 1;
        }
        let (statistic, dof) = chi_square(&observed, &expected, SAMPLES);
        assert!(statistic > 3.0 * chi_square_critical_0_001(dof), "chi2 = {statistic} ({dof} dof)");
    }

    // ---- Draft trees ----

    /// How a test drafter builds a tree (node budget `max_nodes`, depth `max_depth`).
    enum TreeDrafter<'a> {
        /// At each node, the `widths[depth]` most likely tokens of `lm` (distinct siblings).
        TopK(&'a ToyLm, Vec<usize>),
        /// The same token several times among siblings, then another.
        Duplicates(&'a ToyLm),
        /// The target's least likely tokens: every sibling wrong as often as possible.
        Worst(&'a ToyLm),
        /// Random shapes and tokens, some outside the vocabulary.
        Random { vocab: usize },
        /// Siblings drawn from `lm`'s distribution under its params without replacement;
        /// each carries the renormalised `q` it was drawn from.
        OwnQ(&'a ToyLm, SamplingParams),
    }

    impl TreeDrafter<'_> {
        fn propose(&self, context: &[u32], params: &SamplingParams, rng: &mut SamplerRng) -> Draft {
            const MAX_NODES: usize = 12;
            let mut tokens: Vec<u32> = Vec::new();
            let mut parents: Vec<u32> = Vec::new();
            let mut probs: Vec<Vec<f32>> = Vec::new();
            // Breadth-first: (row, depth, path tokens).
            let mut frontier = std::collections::VecDeque::from([(0u32, 0usize, Vec::<u32>::new())]);
            while let Some((row, depth, path)) = frontier.pop_front() {
                let mut ctx = context.to_vec();
                ctx.extend_from_slice(&path);
                let mut kids: Vec<(u32, Option<Vec<f32>>)> = Vec::new();
                let ranked = |lm: &ToyLm| {
                    let p = sample::probabilities(&lm.next_logits(&ctx), params);
                    let mut order: Vec<u32> = (0..lm.vocab as u32).collect();
                    order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]));
                    order
                };
                match self {
                    TreeDrafter::TopK(lm, widths) => {
                        let w = widths.get(depth).copied().unwrap_or(0);
                        kids.extend(ranked(lm).into_iter().take(w).map(|t| (t, None)));
                    }
                    TreeDrafter::Duplicates(lm) => {
                        if depth < 2 {
                            let order = ranked(lm);
                            kids.extend([order[1], order[1], order[0], order[1]].map(|t| (t, None)));
                        }
                    }
                    TreeDrafter::Worst(lm) => {
                        if depth < 2 {
                            kids.extend(ranked(lm).into_iter().rev().take(3).map(|t| (t, None)));
                        }
                    }
                    TreeDrafter::Random { vocab } => {
                        if depth < 3 {
                            let n = (rng.next_u64() % 4) as usize;
                            kids.extend((0..n).map(|_| ((rng.next_u64() % (*vocab as u64 + 2)) as u32, None)));
                        }
                    }
                    TreeDrafter::OwnQ(lm, q_params) => {
                        if depth < 2 {
                            let mut q = sample::probabilities(&lm.next_logits(&ctx), q_params);
                            for _ in 0..2 {
                                let Some(t) = sample::sample_from_weights(&q, rng) else { break };
                                kids.push((t, Some(q.clone())));
                                q[t as usize] = 0.0;
                                let total: f32 = q.iter().sum();
                                if total <= 0.0 {
                                    break;
                                }
                                q.iter_mut().for_each(|x| *x /= total);
                            }
                        }
                    }
                }
                for (t, q) in kids {
                    if tokens.len() == MAX_NODES {
                        break;
                    }
                    tokens.push(t);
                    parents.push(row);
                    if let Some(q) = q {
                        probs.push(q);
                    }
                    let mut child_path = path.clone();
                    child_path.push(t);
                    frontier.push_back((tokens.len() as u32, depth + 1, child_path));
                }
            }
            let mut draft = Draft::tree(tokens, parents);
            if !probs.is_empty() {
                draft.probs = Some(probs);
            }
            draft
        }
    }

    /// Target rows for verifying a tree: node rows see their own path.
    fn tree_rows(
        target: &ToyLm,
        context: &[u32],
        prompt_len: usize,
        draft: &Draft,
        params: &SamplingParams,
    ) -> Vec<Vec<f32>> {
        let mut rows: Vec<Vec<f32>> = (0..=draft.len())
            .map(|r| {
                let mut ctx = context.to_vec();
                if r > 0 {
                    ctx.extend(draft.path_tokens(r - 1));
                }
                target.next_logits(&ctx)
            })
            .collect();
        penalize_verification_rows(&mut rows, &context[prompt_len..], draft, params);
        rows
    }

    #[allow(clippy::too_many_arguments)]
    fn tree_decode(
        target: &ToyLm,
        drafter: &TreeDrafter,
        prompt: &[u32],
        n: usize,
        params: &SamplingParams,
        rng: &mut SamplerRng,
        drafter_rng: &mut SamplerRng,
        stats: &mut SpecStats,
    ) -> Vec<u32> {
        let mut context = prompt.to_vec();
        while context.len() < prompt.len() + n {
            let draft = drafter.propose(&context, params, drafter_rng);
            let rows = tree_rows(target, &context, prompt.len(), &draft, params);
            let verdict = verify(&draft, &rows, params, rng);
            assert_eq!(verdict.accepted, verdict.path.len());
            for pair in verdict.path.windows(2) {
                assert_eq!(draft.parent_row(pair[1]), pair[0] + 1, "the accepted nodes form a path");
            }
            assert!((verdict.next_token as usize) < target.vocab, "emitted a token outside the vocabulary");
            stats.drafted += usize::from(!draft.is_empty());
            stats.accepted += verdict.accepted;
            context.extend(verdict.committed(&draft.tokens));
        }
        context[prompt.len()..prompt.len() + n].to_vec()
    }

    #[test]
    fn greedy_walks_down_the_child_that_matches() {
        // Row 0's argmax is 2; node 1 (token 2) is its second child; row 2 (node 1's row)
        // has argmax 0, matched by node 3; row 4's argmax 3 has no child.
        let rows = [
            vec![0.0f32, 1.0, 5.0, 0.0],
            vec![0.0, 0.0, 0.0, 9.0],
            vec![9.0, 1.0, 5.0, 0.0],
            vec![0.0, 9.0, 0.0, 0.0],
            vec![0.0, 1.0, 2.0, 3.0],
        ];
        let draft = Draft::tree(vec![1, 2, 3, 0], vec![0, 0, 1, 2]);
        let verdict = verify(&draft, &rows, &SamplingParams::greedy(), &mut SamplerRng::from_seed(0));
        assert_eq!(verdict, Verdict { accepted: 2, next_token: 3, path: vec![1, 3] });
        assert_eq!(verdict.committed(&draft.tokens), vec![2, 0, 3]);
        assert_eq!(verdict.rows(), vec![0, 2, 4]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Under greedy decoding every tree, right or wrong, yields exactly the target's own
        /// greedy stream; a tree holding the target's choice among its siblings accepts it.
        #[test]
        fn greedy_tree_speculation_equals_plain_greedy(
            seed in any::<u64>(),
            vocab in 2usize..10,
            kind in 0usize..4,
            penalties in any::<bool>(),
        ) {
            let target = ToyLm::random(vocab, seed, 3.0, seed % 2 == 0);
            let other = ToyLm::random(vocab, seed ^ 77, 3.0, false);
            let params = SamplingParams {
                frequency_penalty: if penalties { 0.7 } else { 0.0 },
                presence_penalty: if penalties { 0.3 } else { 0.0 },
                ..SamplingParams::greedy()
            };
            let prompt = [seed as u32 % vocab as u32, 1];
            let plain = target.plain_decode(&prompt, 50, &params, &mut SamplerRng::from_seed(0));
            let drafter = match kind {
                0 => TreeDrafter::TopK(&other, vec![3, 2, 1]),
                1 => TreeDrafter::Duplicates(&other),
                2 => TreeDrafter::Random { vocab },
                _ => TreeDrafter::Worst(&target),
            };
            let mut stats = SpecStats::default();
            let spec = tree_decode(&target, &drafter, &prompt, 50, &params,
                &mut SamplerRng::from_seed(1), &mut SamplerRng::from_seed(seed ^ 0x5eed), &mut stats);
            prop_assert_eq!(spec, plain);
        }
    }

    /// T > 0: over adversarial trees, the first tokens' distribution is exactly the target's.
    #[test]
    fn tree_rejection_sampling_preserves_the_target_distribution() {
        let vocab = 5;
        let target = ToyLm::random(vocab, 4321, 2.5, false);
        let other = ToyLm::random(vocab, 555, 2.5, false);
        let prompt = [2u32, 4];
        let d = SamplingParams::default;
        let mut configs = target_params();
        configs.push(("very peaked T=0.2", SamplingParams { temperature: 0.2, ..d() }));
        configs.push(("very flat T=5", SamplingParams { temperature: 5.0, ..d() }));
        configs.push((
            "T=1 top_p=0.8 penalties",
            SamplingParams { temperature: 1.0, top_p: 0.8, frequency_penalty: 0.8, presence_penalty: 0.4, ..d() },
        ));
        let own_q = SamplingParams { temperature: 1.5, ..d() };
        for (config_index, (name, params)) in configs.into_iter().enumerate() {
            let expected = if params.has_penalties() {
                // Penalties depend on the history: tabulate plain sampling's own distribution.
                let mut counts = vec![0f64; vocab.pow(SEQUENCE_LEN as u32)];
                let mut rng = SamplerRng::from_seed(99);
                for _ in 0..200_000 {
                    counts[sequence_index(&target.plain_decode(&prompt, SEQUENCE_LEN, &params, &mut rng), vocab)] +=
                        1.0;
                }
                counts.iter().map(|c| c / 200_000.0).collect()
            } else {
                exact_sequence_distribution(&target, &prompt, SEQUENCE_LEN, &params)
            };
            let drafters = [
                ("top-k siblings of another model", TreeDrafter::TopK(&other, vec![3, 2])),
                ("the target's own top-k", TreeDrafter::TopK(&target, vec![2, 2, 1])),
                ("duplicate siblings", TreeDrafter::Duplicates(&other)),
                ("all mass on the least likely tokens", TreeDrafter::Worst(&target)),
                ("random trees incl. out of vocab", TreeDrafter::Random { vocab }),
                ("siblings drawn without replacement from q", TreeDrafter::OwnQ(&other, own_q.clone())),
            ];
            for (drafter_index, (drafter_name, drafter)) in drafters.iter().enumerate() {
                let seed = (config_index * 16 + drafter_index) as u64;
                let what = format!("{name}, tree drafter {drafter_name}");
                assert_distribution(&what, &expected, vocab, seed, |rng, drafter_rng, stats| {
                    tree_decode(&target, drafter, &prompt, SEQUENCE_LEN, &params, rng, drafter_rng, stats)
                });
            }
        }
    }

    #[test]
    fn wilson_hilferty_matches_tabulated_critical_values() {
        // Tabulated chi-square critical values at p = 0.001.
        for (dof, table) in [(10, 29.588), (30, 59.703), (60, 99.607), (120, 173.617)] {
            let approx = chi_square_critical_0_001(dof);
            assert!((approx - table).abs() / table < 0.01, "dof {dof}: {approx} vs {table}");
        }
    }
}
