//! Speculative decoding is lossless, through the real engine path (`engine::generate`):
//!
//! - greedy: for random, perfect, partly right and adversarial drafters, and every draft
//!   length 1..16, the output equals plain greedy decoding token for token, with rollbacks
//!   across blocks; the same for the n-gram and draft-model proposers. On the real
//!   SmolLM2-135M, and exhaustively on a tiny random model written as a GGUF fixture.
//! - T > 0: the joint distribution of the first three sampled tokens under speculation
//!   (draft length 2: accept/accept, accept/reject and reject paths) matches the target's exact
//!   distribution (chi-square at a fixed seed set, thousands of samples), on the tiny model,
//!   with draft models, a stochastic drafter and an EAGLE-3 drafter.
//! - a draft model with another vocabulary is refused with a clear error.

mod common;

use common::{chi_square, chi_square_critical_001, StochasticDrafter};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use specula::engine::{generate, GenerateOptions, Generation, LoadedModel};
use specula::model::{ForwardBatch, LogitsRows, Transformer, WeightFormat};
use specula::sample::{self, SamplerRng, SamplingParams};
use specula::speculative::draft_model::DraftModelProposer;
use specula::speculative::ngram::NgramProposer;
use specula::speculative::suffix::cache::{SuffixCache, SuffixCacheConfig, SuffixScope};
use specula::speculative::suffix::{SuffixProposer, SuffixSettings};
use specula::speculative::{build_proposer, Draft, DrafterSpec, Proposer};
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, OnceLock};

// ---------------------------------------------------------------------------------------------
// Test drafters
// ---------------------------------------------------------------------------------------------

/// How a [`TestDrafter`] builds its drafts.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// Uniform random token ids: almost always wrong.
    Random,
    /// The plain greedy continuation: always right.
    Perfect,
    /// A right prefix of random length, then random tokens.
    Partial,
    /// A right prefix of random length, then the target's second-best token there (likely
    /// but wrong), then the reference continuation.
    Adversarial,
}

/// A drafter that knows the plain greedy output (`reference`) and the target's second-best
/// token at each of its positions.
struct TestDrafter {
    kind: Kind,
    vocab: u32,
    prompt_len: usize,
    reference: Vec<u32>,
    second_best: Vec<u32>,
    rng: SamplerRng,
}

impl TestDrafter {
    fn new(kind: Kind, vocab: usize, prompt_len: usize, reference: &[u32], second_best: &[u32], seed: u64) -> Self {
        Self {
            kind,
            vocab: vocab as u32,
            prompt_len,
            reference: reference.to_vec(),
            second_best: second_best.to_vec(),
            rng: SamplerRng::from_seed(seed),
        }
    }

    fn random_token(&mut self) -> u32 {
        (self.rng.next_u64() % self.vocab as u64) as u32
    }
}

impl Proposer for TestDrafter {
    fn name(&self) -> &str {
        "test"
    }
    fn begin(&mut self, _prompt: &[u32]) -> anyhow::Result<()> {
        Ok(())
    }
    fn observe(&mut self, _tokens: &[u32], _cached: Range<usize>, _taps: &[Tensor]) -> anyhow::Result<()> {
        Ok(())
    }
    fn propose(&mut self, tokens: &[u32], max_len: usize) -> anyhow::Result<Draft> {
        let at = tokens.len() - self.prompt_len;
        let right: Vec<u32> = self.reference.iter().skip(at).take(max_len).copied().collect();
        let prefix = (self.rng.next_u64() % (max_len as u64 + 1)) as usize;
        let draft = match self.kind {
            Kind::Random => (0..max_len).map(|_| self.random_token()).collect(),
            Kind::Perfect => right,
            Kind::Partial => {
                let mut d: Vec<u32> = right.iter().take(prefix).copied().collect();
                while d.len() < max_len {
                    let t = self.random_token();
                    d.push(t);
                }
                d
            }
            Kind::Adversarial => {
                let mut d: Vec<u32> = right.iter().take(prefix).copied().collect();
                if let Some(&wrong) = self.second_best.get(at + d.len()) {
                    d.push(wrong);
                }
                d.extend(self.reference.iter().skip(at + d.len()).take(max_len.saturating_sub(d.len())));
                d.truncate(max_len);
                d
            }
        };
        Ok(Draft::deterministic(draft))
    }
}

/// How a [`TreeTestDrafter`] shapes its trees.
#[derive(Clone, Copy, Debug)]
enum TreeKind {
    /// At each depth the right token as the last of three siblings (after the target's
    /// second-best and a random token), each wrong sibling with a random subtree of its own.
    HiddenRight,
    /// The right token twice among siblings; the path continues under the second copy.
    Duplicates,
    /// Random shapes and tokens.
    Random,
}

/// A tree drafter that knows the plain greedy output, as [`TestDrafter`] does.
struct TreeTestDrafter {
    kind: TreeKind,
    inner: TestDrafter,
}

impl Proposer for TreeTestDrafter {
    fn name(&self) -> &str {
        "tree-test"
    }
    fn begin(&mut self, _prompt: &[u32]) -> anyhow::Result<()> {
        Ok(())
    }
    fn observe(&mut self, _tokens: &[u32], _cached: Range<usize>, _taps: &[Tensor]) -> anyhow::Result<()> {
        Ok(())
    }
    fn propose(&mut self, tokens: &[u32], max_nodes: usize) -> anyhow::Result<Draft> {
        let d = &mut self.inner;
        let at = tokens.len() - d.prompt_len;
        let (mut toks, mut parents): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
        // Adds a node under `parent` while the budget lasts; returns its row.
        let push = |t: u32, parent: u32, toks: &mut Vec<u32>, parents: &mut Vec<u32>| -> Option<u32> {
            (toks.len() < max_nodes).then(|| {
                toks.push(t);
                parents.push(parent);
                toks.len() as u32
            })
        };
        match self.kind {
            TreeKind::HiddenRight | TreeKind::Duplicates => {
                let mut row = 0;
                for depth in 0.. {
                    let Some(&right) = d.reference.get(at + depth) else { break };
                    let wrong = d.second_best.get(at + depth).copied().unwrap_or(0);
                    let noise = d.random_token();
                    let next = match self.kind {
                        TreeKind::HiddenRight => {
                            for t in [wrong, noise] {
                                let Some(r) = push(t, row, &mut toks, &mut parents) else { break };
                                // A subtree under the wrong sibling, rejected with it.
                                let child = d.random_token();
                                push(child, r, &mut toks, &mut parents);
                            }
                            push(right, row, &mut toks, &mut parents)
                        }
                        _ => {
                            push(right, row, &mut toks, &mut parents);
                            push(noise, row, &mut toks, &mut parents);
                            push(right, row, &mut toks, &mut parents)
                        }
                    };
                    match next {
                        Some(r) => row = r,
                        None => break,
                    }
                }
            }
            TreeKind::Random => {
                while toks.len() < max_nodes {
                    let parent = (d.rng.next_u64() % (toks.len() as u64 + 1)) as u32;
                    let t = if d.rng.next_u64().is_multiple_of(2) {
                        d.reference.get(at + depth_of(&parents, parent)).copied().unwrap_or(0)
                    } else {
                        d.random_token()
                    };
                    push(t, parent, &mut toks, &mut parents);
                }
            }
        }
        Ok(Draft::tree(toks, parents))
    }
}

/// The depth below row `row` of a tree with these parent rows (row 0 is the root).
fn depth_of(parents: &[u32], mut row: u32) -> usize {
    let mut depth = 0;
    while row > 0 {
        row = parents[row as usize - 1];
        depth += 1;
    }
    depth
}

/// Wraps a draft-model proposer and checks after every step that its cache holds only
/// committed tokens (rollback of the drafter's own KV).
struct CheckedDraftModel(DraftModelProposer);

impl Proposer for CheckedDraftModel {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn set_trees(&mut self, on: bool) -> bool {
        self.0.set_trees(on)
    }
    fn begin(&mut self, prompt: &[u32]) -> anyhow::Result<()> {
        self.0.begin(prompt)
    }
    fn observe(&mut self, tokens: &[u32], cached: Range<usize>, taps: &[Tensor]) -> anyhow::Result<()> {
        self.0.observe(tokens, cached, taps)?;
        let fed = self.0.cached_tokens();
        assert!(fed.len() <= tokens.len() && fed == &tokens[..fed.len()], "drafter cache holds uncommitted tokens");
        Ok(())
    }
    fn propose(&mut self, tokens: &[u32], max_len: usize) -> anyhow::Result<Draft> {
        self.0.propose(tokens, max_len)
    }
    fn pending_catch_up(&self, tokens: &[u32]) -> usize {
        self.0.pending_catch_up(tokens)
    }
    fn catch_up(&mut self, tokens: &[u32]) -> anyhow::Result<usize> {
        self.0.catch_up(tokens)
    }
}

// ---------------------------------------------------------------------------------------------
// Running the engine
// ---------------------------------------------------------------------------------------------

fn run(
    model: &Transformer,
    prompt: &[u32],
    params: SamplingParams,
    stop_ids: &[u32],
    proposer: Option<&mut dyn Proposer>,
    mut opts: GenerateOptions,
) -> Generation {
    let pool = model.new_kv_pool(prompt.len() + params.max_tokens.unwrap_or(64) + 64);
    opts.stop_ids = stop_ids.to_vec();
    let gen = generate(model.into(), &pool, prompt, params, proposer, &opts, &mut |_| {}).expect("generate");
    // Every block went back to the pool when the request ended.
    let stats = pool.stats();
    assert_eq!(stats.free_blocks, stats.total_blocks, "blocks still held after the request ended");
    gen
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens: Some(max_tokens), ..SamplingParams::greedy() }
}

/// The target's second-best token at each position of `reference` after `prompt`
/// (teacher-forced, one forward).
fn second_best(model: &Transformer, prompt: &[u32], reference: &[u32]) -> Vec<u32> {
    let pool = model.new_kv_pool(prompt.len() + reference.len() + 16);
    let mut cache = pool.new_sequence();
    let mut input = prompt.to_vec();
    input.extend_from_slice(reference);
    let mut batch = ForwardBatch::new();
    batch.push(&input, &mut cache, LogitsRows::All);
    let rows = model.forward(&mut batch).unwrap().seq_logits(0).unwrap();
    rows[prompt.len() - 1..]
        .iter()
        .map(|row| {
            let best = sample::argmax(row) as usize;
            let mut masked = row.clone();
            masked[best] = f32::NEG_INFINITY;
            sample::argmax(&masked)
        })
        .collect()
}

/// Plain greedy output, computed once per (model, prompt, stop ids, length) in this process.
fn plain_greedy(model: &Transformer, prompt: &[u32], stop_ids: &[u32], max_tokens: usize) -> Vec<u32> {
    type Key = (usize, Vec<u32>, Vec<u32>, usize);
    static CACHE: OnceLock<std::sync::Mutex<HashMap<Key, Vec<u32>>>> = OnceLock::new();
    let key = (model as *const Transformer as usize, prompt.to_vec(), stop_ids.to_vec(), max_tokens);
    let cache = CACHE.get_or_init(Default::default);
    if let Some(hit) = cache.lock().unwrap().get(&key) {
        return hit.clone();
    }
    let tokens = run(model, prompt, greedy(max_tokens), stop_ids, None, GenerateOptions::default()).tokens;
    cache.lock().unwrap().insert(key, tokens.clone());
    tokens
}

/// For every draft length k in 1..=16, runs the test drafters `kinds_for(k)` (fixed length k,
/// prompt `(k / 2) % prompts.len()`) and checks each output against plain greedy decoding.
fn check_test_drafters(
    model: &Transformer,
    prompts: &[Vec<u32>],
    stop_ids: &[u32],
    max_tokens: usize,
    kinds_for: &dyn Fn(usize) -> Vec<Kind>,
) {
    let references: Vec<(Vec<u32>, Vec<u32>)> = prompts
        .iter()
        .map(|p| {
            let plain = plain_greedy(model, p, stop_ids, max_tokens);
            let second = second_best(model, p, &plain);
            (plain, second)
        })
        .collect();
    let mut totals: HashMap<String, specula::speculative::SpecMetrics> = HashMap::new();
    for k in 1..=16usize {
        let which = (k / 2) % prompts.len();
        let (prompt, (reference, second)) = (&prompts[which], &references[which]);
        for kind in kinds_for(k) {
            let mut drafter = TestDrafter::new(kind, model.config.vocab, prompt.len(), reference, second, k as u64);
            let gen =
                run(model, prompt, greedy(max_tokens), stop_ids, Some(&mut drafter), GenerateOptions::fixed_draft(k));
            assert_eq!(&gen.tokens, reference, "{kind:?} drafter, draft length {k}, prompt {which}");
            totals.entry(format!("{kind:?}")).or_default().merge(&gen.metrics);
        }
    }
    for (kind, total) in totals {
        assert!(total.drafted > 0);
        match kind.as_str() {
            // Never a rejection: the drafts are the output.
            "Perfect" => assert_eq!(total.accepted, total.drafted, "{kind}"),
            // Rejections (rollbacks across blocks) happened, and for the partly right ones
            // acceptances too.
            "Random" => assert!(total.accepted < total.drafted / 4, "{kind}: {total:?}"),
            _ => assert!(total.accepted > 0 && total.accepted < total.drafted, "{kind}: {total:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A tiny random model as a GGUF fixture
// ---------------------------------------------------------------------------------------------

const TINY_VOCAB: usize = 32;

/// Writes a 2-layer Llama with random weights (hidden 64, 4 heads of 16, 2 KV heads, vocab
/// 32, tied head; embedding entries within ±`scale`) and loads it with f32 weights. Different
/// seeds give different models; `noise` = (seed, relative size) perturbs every weight, for a
/// drafter that agrees with the target only part of the time.
fn tiny_model(dir: &Path, seed: u64, scale: f32, noise: Option<(u64, f32)>) -> Transformer {
    let (hidden, ffn, n_layers, n_heads, n_kv, head_dim) = (64usize, 128usize, 2usize, 4usize, 2usize, 16usize);
    let mut rng = SamplerRng::from_seed(seed);
    let mut noise_rng = SamplerRng::from_seed(noise.map_or(0, |(s, _)| s));
    let noise_size = noise.map_or(0.0, |(_, size)| size);
    let mut tensor = |shape: &[usize], scale: f32, offset: f32| -> QTensor {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n)
            .map(|_| {
                let x = scale * (rng.next_f64() as f32 * 2.0 - 1.0);
                let e = noise_size * scale * (noise_rng.next_f64() as f32 * 2.0 - 1.0);
                offset + x + e
            })
            .collect();
        let t = Tensor::from_vec(data, shape, &Device::Cpu).unwrap();
        QTensor::quantize(&t, GgmlDType::F32).unwrap()
    };
    let mut tensors: Vec<(String, QTensor)> = vec![
        ("token_embd.weight".into(), tensor(&[TINY_VOCAB, hidden], scale, 0.0)),
        ("output_norm.weight".into(), tensor(&[hidden], 0.1, 1.0)),
    ];
    let w = 1.0 / (hidden as f32).sqrt();
    for i in 0..n_layers {
        let b = |name: &str| format!("blk.{i}.{name}.weight");
        tensors.push((b("attn_norm"), tensor(&[hidden], 0.1, 1.0)));
        tensors.push((b("ffn_norm"), tensor(&[hidden], 0.1, 1.0)));
        tensors.push((b("attn_q"), tensor(&[n_heads * head_dim, hidden], 2.0 * w, 0.0)));
        tensors.push((b("attn_k"), tensor(&[n_kv * head_dim, hidden], 2.0 * w, 0.0)));
        tensors.push((b("attn_v"), tensor(&[n_kv * head_dim, hidden], 2.0 * w, 0.0)));
        tensors.push((b("attn_output"), tensor(&[hidden, n_heads * head_dim], 2.0 * w, 0.0)));
        tensors.push((b("ffn_gate"), tensor(&[ffn, hidden], 2.0 * w, 0.0)));
        tensors.push((b("ffn_up"), tensor(&[ffn, hidden], 2.0 * w, 0.0)));
        tensors.push((b("ffn_down"), tensor(&[hidden, ffn], 2.0 / (ffn as f32).sqrt(), 0.0)));
    }
    use gguf_file::Value;
    let metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.embedding_length", Value::U32(hidden as u32)),
        ("llama.feed_forward_length", Value::U32(ffn as u32)),
        ("llama.block_count", Value::U32(n_layers as u32)),
        ("llama.attention.head_count", Value::U32(n_heads as u32)),
        ("llama.attention.head_count_kv", Value::U32(n_kv as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.context_length", Value::U32(512)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
    ];
    let path = dir.join(format!("tiny-{seed}-{}.gguf", noise.map_or(0, |(s, _)| s)));
    let mut file = std::fs::File::create(&path).unwrap();
    let meta_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    gguf_file::write(&mut file, &meta_refs, &tensor_refs).unwrap();
    drop(file);
    Transformer::from_path(&path, Some(WeightFormat::F32), &Device::Cpu).unwrap()
}

/// The target and a perturbed copy that drafts for it, built once per test binary.
fn tiny_models() -> &'static (Arc<Transformer>, Arc<Transformer>) {
    static MODELS: OnceLock<(Arc<Transformer>, Arc<Transformer>)> = OnceLock::new();
    MODELS.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let target = Arc::new(tiny_model(dir.path(), 1, 0.25, None));
        let other = Arc::new(tiny_model(dir.path(), 1, 0.25, Some((2, 0.25))));
        (target, other)
    })
}

fn tiny_prompt(seed: u64, len: usize) -> Vec<u32> {
    let mut rng = SamplerRng::from_seed(1000 + seed);
    (0..len).map(|_| (rng.next_u64() % TINY_VOCAB as u64) as u32).collect()
}

// ---------------------------------------------------------------------------------------------
// Greedy: tiny model (exhaustive) and real SmolLM2
// ---------------------------------------------------------------------------------------------

#[test]
fn tiny_model_greedy_speculation_equals_plain_greedy() {
    let (target, other) = tiny_models();
    let prompts: Vec<Vec<u32>> = (0..4).map(|s| tiny_prompt(s, 3 + s as usize * 5)).collect();
    let all = |_k: usize| vec![Kind::Random, Kind::Perfect, Kind::Partial, Kind::Adversarial];
    check_test_drafters(target, &prompts, &[], 48, &all);

    // Real proposers over every prompt and length: n-gram (the tiny model loops, so it
    // matches), the target drafting for itself, and an unrelated model.
    // Suffix decoding remembers every earlier run's text: other prompts' outputs are
    // confident wrong drafts here.
    let cache = Arc::new(SuffixCache::new(SuffixCacheConfig { scope: SuffixScope::Global, ..Default::default() }));
    let mut suffix_accepted = 0;
    for prompt in &prompts {
        let plain = run(target, prompt, greedy(48), &[], None, GenerateOptions::default()).tokens;
        for k in 1..=16 {
            // Chains of k tokens, and trees of k nodes.
            for (shape, opts) in [
                ("chain", GenerateOptions::fixed_draft as fn(usize) -> GenerateOptions),
                ("tree", GenerateOptions::fixed_tree),
            ] {
                let mut ngram = NgramProposer::new(1, 3).unwrap();
                let gen = run(target, prompt, greedy(48), &[], Some(&mut ngram), opts(k));
                assert_eq!(gen.tokens, plain, "ngram {shape}, k = {k}");
                let settings = SuffixSettings { min_prob: 0.0, min_match: 1, factor: 4.0, ..Default::default() };
                let mut suffix = SuffixProposer::new(settings, Some((cache.clone(), 0)));
                let gen = run(target, prompt, greedy(48), &[], Some(&mut suffix), opts(k));
                assert_eq!(gen.tokens, plain, "suffix {shape}, k = {k}");
                suffix_accepted += gen.metrics.accepted;
                for (name, drafter) in [("self", target), ("perturbed", other)] {
                    let mut p = CheckedDraftModel(DraftModelProposer::new(drafter.clone(), 256, vec![]));
                    let gen = run(target, prompt, greedy(48), &[], Some(&mut p), opts(k));
                    assert_eq!(gen.tokens, plain, "draft model {name} {shape}, k = {k}");
                    if name == "self" {
                        let first_choices = gen.metrics.per_rank_acceptance()[0];
                        assert!(first_choices > 0.95, "self-drafting accepts: {:?}", gen.metrics);
                    }
                }
            }
        }
    }
    assert!(suffix_accepted > 0, "suffix decoding drafted nothing the target took");
}

/// Draft trees through the engine: the right token hidden among wrong siblings (with subtrees
/// of their own), duplicated, or scattered through random trees, at every node budget, with
/// and without a stop token: the output is plain greedy decoding's, the accepted paths are
/// compacted into the cache, and every block goes back to the pool.
#[test]
fn tiny_model_greedy_draft_trees_equal_plain_greedy() {
    let (target, _) = tiny_models();
    for (p, prompt) in (0..3).map(|s| tiny_prompt(20 + s, 4 + s as usize * 6)).enumerate() {
        // The third prompt ends at a stop token that its free-running output reaches.
        let free = plain_greedy(target, &prompt, &[], 40);
        let first_new = (8..free.len()).find(|&j| !free[..j].contains(&free[j]));
        let stop_token: Vec<u32> = first_new.map(|j| free[j]).into_iter().collect();
        let stop: &[u32] = if p == 2 { &stop_token } else { &[] };
        assert!(p != 2 || !stop.is_empty(), "fixture: no stop token in {free:?}");
        let plain = plain_greedy(target, &prompt, stop, 40);
        assert!(plain.len() >= 8, "fixture: {plain:?}");
        let second = second_best(target, &prompt, &plain);
        let mut deepest = 0;
        for budget in 1..=16usize {
            for kind in [TreeKind::HiddenRight, TreeKind::Duplicates, TreeKind::Random] {
                let inner = TestDrafter::new(Kind::Perfect, TINY_VOCAB, prompt.len(), &plain, &second, budget as u64);
                let mut drafter = TreeTestDrafter { kind, inner };
                let gen =
                    run(target, &prompt, greedy(40), stop, Some(&mut drafter), GenerateOptions::fixed_tree(budget));
                assert_eq!(gen.tokens, plain, "{kind:?}, {budget} nodes, prompt {p}");
                if matches!(kind, TreeKind::HiddenRight) && budget >= 6 {
                    // The right token sat behind rank 0 at every depth and was found anyway.
                    assert!(gen.metrics.accepted_at_rank.get(2).is_some_and(|&a| a > 0), "{:?}", gen.metrics);
                    deepest = deepest.max(gen.metrics.accepted_at.iter().filter(|&&a| a > 0).count());
                }
            }
        }
        assert!(deepest >= 2, "paths of several accepted nodes were kept");
    }
}

#[test]
fn a_draft_model_feeds_a_few_pending_tokens_with_its_next_draft() {
    let (_, other) = tiny_models();
    let prompt = tiny_prompt(5, 12);
    let mut p = DraftModelProposer::new(other.clone(), 256, vec![]);
    p.begin(&prompt).unwrap();
    // Nothing fed yet: the whole prompt but its last token is a catch-up of its own.
    assert_eq!(p.pending_catch_up(&prompt), prompt.len() - 1);
    assert_eq!(p.catch_up(&prompt).unwrap(), prompt.len() - 1);
    let first = p.propose(&prompt, 3).unwrap().tokens;
    assert_eq!(first.len(), 3);
    // The target accepts the whole draft and adds a token: the last draft token was never fed.
    // It goes into the next draft's first forward, with the target's token.
    let mut tokens = prompt.clone();
    tokens.extend_from_slice(&first);
    tokens.push(first[0]);
    p.observe(&tokens, prompt.len() - 1..tokens.len() - 1, &[]).unwrap();
    assert_eq!(p.pending_catch_up(&tokens), 0);
    assert_eq!(p.catch_up(&tokens).unwrap(), 0);
    let second = p.propose(&tokens, 3).unwrap().tokens;
    // The same draft as a drafter that fed the whole sequence at once (the forward is
    // batch-invariant, so how the rows were grouped changes nothing).
    let mut fresh = DraftModelProposer::new(other.clone(), 256, vec![]);
    fresh.begin(&tokens).unwrap();
    assert_eq!(fresh.propose(&tokens, 3).unwrap().tokens, second);
    // After a stretch of plain steps longer than what a draft folds in, the catch-up is its own
    // (the drafter holds all of `tokens`; the last of `later` is the draft's first input).
    let mut later = tokens.clone();
    later.extend(tiny_prompt(6, 8));
    p.observe(&later, tokens.len() - 1..later.len() - 1, &[]).unwrap();
    assert_eq!(p.pending_catch_up(&later), 7);
    assert_eq!(p.catch_up(&later).unwrap(), 7);
    assert_eq!(p.pending_catch_up(&later), 0);
    let mut fresh = DraftModelProposer::new(other.clone(), 256, vec![]);
    fresh.begin(&later).unwrap();
    assert_eq!(fresh.propose(&later, 3).unwrap().tokens, p.propose(&later, 3).unwrap().tokens);
}

#[test]
fn tiny_model_accepted_stop_token_leaves_no_kv_behind() {
    let (target, _) = tiny_models();
    let prompt = tiny_prompt(3, 6);
    let free_run = run(target, &prompt, greedy(40), &[], None, GenerateOptions::default()).tokens;
    // Make a token that first appears at position 11 a stop token: the perfect drafter,
    // which knows the free-running output, proposes it inside a draft, the target accepts it,
    // and generation ends there.
    let first_new = (3..free_run.len()).find(|&j| !free_run[..j].contains(&free_run[j])).expect("a new token");
    assert_eq!(first_new, 11, "fixture changed: {free_run:?}");
    let stop = [free_run[first_new]];
    let until_stop: Vec<u32> = free_run.iter().copied().take_while(|t| *t != stop[0]).collect();
    assert_eq!(run(target, &prompt, greedy(40), &stop, None, GenerateOptions::default()).tokens, until_stop);
    for k in [4, 8, 16] {
        let mut drafter = TestDrafter::new(Kind::Perfect, TINY_VOCAB, prompt.len(), &free_run, &free_run, 0);
        // `run` checks that the cache holds no K/V past the committed tokens.
        let gen = run(target, &prompt, greedy(40), &stop, Some(&mut drafter), GenerateOptions::fixed_draft(k));
        assert_eq!(gen.tokens, until_stop, "k = {k}");
        assert!(gen.metrics.accepted as usize >= (until_stop.len() - 1).min(k), "drafts were accepted up to the stop");
    }
}

/// SmolLM2 with its tokenizer, loaded once.
fn smollm2() -> &'static LoadedModel {
    static MODEL: OnceLock<LoadedModel> = OnceLock::new();
    MODEL.get_or_init(|| LoadedModel::load(&common::smollm2_path(), None, &Device::Cpu).expect("loading smollm2"))
}

fn smollm2_prompts(m: &LoadedModel) -> Vec<Vec<u32>> {
    ["def fibonacci(n):", "The capital of France is"].iter().map(|p| m.encode_prompt(p).unwrap()).collect()
}

const REAL_TOKENS: usize = 40;

/// Every draft length 1..16 with two drafters each (one that forces rollbacks in nearly every
/// step, one mostly right), every drafter at 8 lengths; the full cross product runs on the
/// tiny model.
#[test]
fn smollm2_greedy_test_drafters_every_length() {
    let m = smollm2();
    let kinds =
        |k: usize| if k % 2 == 1 { vec![Kind::Random, Kind::Adversarial] } else { vec![Kind::Partial, Kind::Perfect] };
    check_test_drafters(&m.model, &smollm2_prompts(m), &m.stop_ids(), REAL_TOKENS, &kinds);
}

/// `--draft-len auto` with up to 8 drafted tokens on a verify curve where each row adds a
/// tenth of a step.
fn adaptive_draft_len() -> GenerateOptions {
    GenerateOptions {
        draft_len: specula::speculative::DraftLen::Auto,
        max_draft: 8,
        step_cost: Some(std::sync::Arc::new(specula::speculative::StepCost::from_points(
            (1..=9).map(|m| (m, 1.0 + 0.1 * (m - 1) as f64)).collect(),
        ))),
        ..GenerateOptions::default()
    }
}

#[test]
fn smollm2_greedy_factory_and_shipped_proposers() {
    let m = smollm2();
    let stop = m.stop_ids();
    let target_path = common::smollm2_path();
    let draft_spec = DrafterSpec::DraftModel { model: target_path.display().to_string(), settings: Default::default() };
    // Through the factory, as the CLI builds them: n-gram, SmolLM2 drafting for itself (same
    // tokenizer), prompt lookup in front of the shipped DFlash drafter, and the shipped EAGLE-3
    // drafter, each at a fixed length on one prompt and adaptive on the other.
    let shipped = |kind: &str, dir: &str| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("drafters").join(dir);
        DrafterSpec::parse(&format!("{kind}:{}", dir.display())).unwrap()
    };
    let ngram = DrafterSpec::Ngram { max_ngram: 3 };
    let combined = shipped("ngram+dflash", "smollm2-135m-dflash");
    let suffix_dflash = shipped("suffix+dflash", "smollm2-135m-dflash");
    let cache = Arc::new(SuffixCache::new(SuffixCacheConfig::default()));
    let caller = specula::speculative::Caller { suffix_cache: Some(&cache), api_key: None };
    let eagle3 = shipped("eagle3", "smollm2-135m-eagle3");
    for (i, prompt) in smollm2_prompts(m).iter().enumerate() {
        let plain = plain_greedy(&m.model, prompt, &stop, REAL_TOKENS);
        let cases: [(&DrafterSpec, GenerateOptions); 5] = if i == 0 {
            [
                (&ngram, GenerateOptions::fixed_draft(5)),
                (&draft_spec, GenerateOptions::fixed_draft(4)),
                (&combined, GenerateOptions::fixed_draft(6)),
                (&eagle3, GenerateOptions::fixed_draft(7)),
                (&suffix_dflash, GenerateOptions::fixed_tree(6)),
            ]
        } else {
            [
                (&ngram, adaptive_draft_len()),
                (&draft_spec, adaptive_draft_len()),
                (&combined, adaptive_draft_len()),
                (&eagle3, adaptive_draft_len()),
                (&suffix_dflash, adaptive_draft_len()),
            ]
        };
        for (spec, opts) in cases {
            let mut p = build_proposer(spec, m.target(), caller).unwrap();
            let gen = run(&m.model, prompt, greedy(REAL_TOKENS), &stop, Some(p.as_mut()), opts);
            assert_eq!(gen.tokens, plain, "{spec:?}, prompt {i}");
            if matches!(spec, DrafterSpec::DraftModel { .. }) {
                // Its first choices (a tree's runner-up leaves can only be rejected).
                assert!(gen.metrics.per_rank_acceptance()[0] > 0.9, "self-drafting accepts: {:?}", gen.metrics);
            }
            if matches!(spec, DrafterSpec::Combined { .. }) && i == 0 {
                // Where lookup finds nothing DFlash drafts, so every step with room drafted (only
                // the last may have none), and some of it was accepted.
                let m = &gen.metrics;
                assert!(m.accepted > 0 && m.spec_steps + 1 >= m.steps, "{m:?}");
            }
        }
    }
}

/// Prompt lookup in front of a draft model (SmolLM2 drafting for itself): lossless at a fixed
/// length and adaptive, and the draft model's catching up on what it missed (the prompt first)
/// runs in the engine's catch-up, timed apart from drafting, as it does for a draft model alone.
#[test]
fn a_draft_model_behind_prompt_lookup_catches_up_apart_from_drafting() {
    let m = smollm2();
    let stop = m.stop_ids();
    let spec = DrafterSpec::parse(&format!("ngram+draft-model:{}", common::smollm2_path().display())).unwrap();
    let caller = specula::speculative::Caller::default();
    let mut caught_up = 0;
    for (i, prompt) in smollm2_prompts(m).iter().enumerate() {
        let plain = plain_greedy(&m.model, prompt, &stop, REAL_TOKENS);
        for opts in [GenerateOptions::fixed_draft(4), adaptive_draft_len()] {
            let mut p = build_proposer(&spec, m.target(), caller).unwrap();
            let gen = run(&m.model, prompt, greedy(REAL_TOKENS), &stop, Some(p.as_mut()), opts);
            assert_eq!(gen.tokens, plain, "prompt {i}");
            assert!(gen.metrics.accepted > 0, "self-drafting accepts: {:?}", gen.metrics);
            caught_up += gen.metrics.catch_up_tokens;
        }
    }
    assert!(caught_up > 0, "the draft model caught up inside its drafting only");
}

/// A draft model cut to its first 8,192 token ids and requantised to Q4_0: it drafts only those
/// ids, what it drafts is still verified, and the output is the target's, chain and tree.
#[test]
fn a_draft_model_with_fewer_tokens_and_other_weights_stays_lossless() {
    let m = smollm2();
    let stop = m.stop_ids();
    let path = common::smollm2_path();
    let spec = DrafterSpec::parse(&format!("draft-model:{},weights=q4_0,vocab=8192", path.display())).unwrap();
    assert_eq!(spec.label(), format!("draft-model:{},weights=q4_0,vocab=8192", path.display()));
    for (i, prompt) in smollm2_prompts(m).iter().enumerate() {
        let plain = plain_greedy(&m.model, prompt, &stop, REAL_TOKENS);
        let mut p = build_proposer(&spec, m.target(), Default::default()).unwrap();
        let mut context = prompt.clone();
        context.extend_from_slice(&plain[..plain.len().min(8)]);
        let draft = p.propose(&context, 6).unwrap();
        assert!(!draft.tokens.is_empty() && draft.tokens.iter().all(|&t| t < 8192), "{:?}", draft.tokens);
        for opts in [GenerateOptions::fixed_draft(4), GenerateOptions::fixed_tree(6)] {
            let mut p = build_proposer(&spec, m.target(), Default::default()).unwrap();
            let gen = run(&m.model, prompt, greedy(REAL_TOKENS), &stop, Some(p.as_mut()), opts);
            assert_eq!(gen.tokens, plain, "prompt {i}");
            assert!(gen.metrics.accepted > 0, "{:?}", gen.metrics);
        }
    }
}

/// `keep_head_rows`: the logits of the first n tokens, bit for bit those of the whole head;
/// no rows or more rows than the vocabulary are refused.
#[test]
fn a_head_cut_to_its_first_rows_gives_those_rows_logits() {
    let path = common::smollm2_path();
    let full = Transformer::from_path(&path, None, &Device::Cpu).unwrap();
    let mut cut = Transformer::from_path(&path, None, &Device::Cpu).unwrap();
    let kernels = specula::model::KernelSettings::from_env();
    cut.keep_head_rows(4096, &kernels).unwrap();
    let tokens = [1u32, 504, 3458, 282, 4649, 30, 216, 40000];
    let (a, b) = (common::logits_of_every_row(&full, &tokens), common::logits_of_every_row(&cut, &tokens));
    assert_eq!(b.dims(), &[tokens.len(), 4096]);
    let a = a.narrow(1, 0, 4096).unwrap().to_vec2::<f32>().unwrap();
    let b = b.to_vec2::<f32>().unwrap();
    let bits = |x: &Vec<Vec<f32>>| x.iter().flatten().map(|v| v.to_bits()).collect::<Vec<u32>>();
    assert_eq!(bits(&a), bits(&b));
    let vocab = full.config.vocab;
    for bad in [0, vocab + 1] {
        let err = cut.keep_head_rows(bad, &kernels).unwrap_err().to_string();
        assert!(err.contains("rows for a vocabulary"), "{err}");
    }
}

#[test]
fn draft_model_with_another_vocabulary_is_refused() {
    let Some(qwen) = common::optional_model("qwen2.5-coder-0.5b") else {
        return;
    };
    let spec = DrafterSpec::parse(&format!("draft-model:{}", qwen.display())).unwrap();
    let err = build_proposer(&spec, smollm2().target(), specula::speculative::Caller::default())
        .err()
        .expect("an incompatible drafter must be refused");
    let msg = format!("{err:#}");
    assert!(msg.contains("cannot draft for") && msg.contains("vocabulary sizes differ"), "{msg}");
    assert!(msg.contains("49152") && msg.contains("151"), "names both sizes: {msg}");
}

// ---------------------------------------------------------------------------------------------
// T > 0: the distribution of the first tokens
// ---------------------------------------------------------------------------------------------

/// The exact distribution of the first `n` sampled tokens: chains of `sample::probabilities`
/// over the target's logits, one forward per prefix.
fn exact_joint(model: &Transformer, prompt: &[u32], params: &SamplingParams, n: usize) -> HashMap<Vec<u32>, f64> {
    let mut out = HashMap::new();
    let mut stack = vec![(Vec::<u32>::new(), 1.0f64)];
    while let Some((prefix, p)) = stack.pop() {
        if prefix.len() == n {
            out.insert(prefix, p);
            continue;
        }
        let pool = model.new_kv_pool(prompt.len() + n + 16);
        let mut cache = pool.new_sequence();
        let mut input = prompt.to_vec();
        input.extend_from_slice(&prefix);
        let mut batch = ForwardBatch::new();
        batch.push(&input, &mut cache, LogitsRows::Last);
        let row = model.forward(&mut batch).unwrap().seq_logits(0).unwrap().remove(0);
        for (t, &q) in sample::probabilities(&row, params).iter().enumerate() {
            if q > 0.0 {
                let mut next = prefix.clone();
                next.push(t as u32);
                stack.push((next, p * q as f64));
            }
        }
    }
    out
}

#[test]
fn tiny_model_sampling_distribution_is_the_targets() {
    const SAMPLES: usize = 6000;
    const FIRST: usize = 3;
    let (target, other) = tiny_models();
    let prompt = tiny_prompt(7, 5);
    let params = |seed: u64| SamplingParams {
        temperature: 0.8,
        top_k: 3,
        top_p: 0.95,
        seed: Some(seed),
        // Room for the first token plus one step with a 2-token draft (or a deeper tree).
        max_tokens: Some(FIRST + 1),
        ..SamplingParams::default()
    };
    let exact = exact_joint(target, &prompt, &params(0), FIRST);
    assert!(exact.len() >= 8, "the fixture should have a spread-out distribution: {exact:?}");
    let total: f64 = exact.values().sum();
    assert!((total - 1.0).abs() < 1e-4);

    // The learned drafters and the draft models draft trees of two nodes; the last arms are
    // DFlash as a chain and random trees of six nodes.
    let arms: [&str; 10] = [
        "plain",
        "self draft model",
        "perturbed draft model",
        "stochastic drafter",
        "eagle3 drafter",
        "dflash drafter",
        "ngram:1 then dflash drafter",
        "dflash chain",
        "random trees of six nodes",
        "suffix trees from earlier samples",
    ];
    // A random EAGLE-3 drafter that reads the target's hidden states; its vocabulary is the
    // target's two likeliest first tokens, so it is right part of the time.
    let eagle_dir = tempfile::tempdir().unwrap();
    let hidden = target.config.hidden;
    let mut first: HashMap<u32, f64> = HashMap::new();
    for (seq, p) in &exact {
        *first.entry(seq[0]).or_default() += p;
    }
    let mut likeliest: Vec<(u32, f64)> = first.into_iter().collect();
    likeliest.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut vocab: Vec<u32> = likeliest.iter().take(2).map(|&(t, _)| t).collect();
    vocab.sort();
    common::write_eagle3_drafter(eagle_dir.path(), hidden, hidden, TINY_VOCAB, [0, 1, 1], false, Some(&vocab), 5);
    let eagle_settings = specula::speculative::eagle3::Eagle3Settings::default();
    // A random DFlash drafter (blocks of 4, both target layers tapped) over the same two tokens,
    // served as it is when drafting (8-bit projections).
    let dflash_dir = tempfile::tempdir().unwrap();
    common::write_dflash_drafter(dflash_dir.path(), hidden, target.config.n_layers, &[0, 1], 1, 4, Some(&vocab), 9);
    let dflash_settings = specula::speculative::dflash::DflashSettings::default();
    let suffix_cache =
        Arc::new(SuffixCache::new(SuffixCacheConfig { scope: SuffixScope::Global, ..Default::default() }));
    for (arm_index, arm) in arms.iter().enumerate() {
        let mut counts: HashMap<Vec<u32>, usize> = HashMap::new();
        let mut metrics = specula::speculative::SpecMetrics::default();
        for i in 0..SAMPLES {
            let seed = 1_000_000 * (arm_index as u64 + 1) + i as u64;
            let mut proposer: Option<Box<dyn Proposer>> = match arm_index {
                0 => None,
                1 => Some(Box::new(DraftModelProposer::new(target.clone(), 64, vec![]))),
                2 => Some(Box::new(DraftModelProposer::new(other.clone(), 64, vec![]))),
                4 => Some(Box::new(
                    specula::speculative::eagle3::build_proposer(eagle_dir.path(), &eagle_settings, target).unwrap(),
                )),
                5 => Some(Box::new(
                    specula::speculative::dflash::build_proposer(dflash_dir.path(), &dflash_settings, target).unwrap(),
                )),
                // Single-token lookup drafts whenever the last token occurred before, DFlash
                // otherwise: both kinds of draft within one sequence.
                7 => Some(Box::new(
                    specula::speculative::dflash::build_proposer(dflash_dir.path(), &dflash_settings, target).unwrap(),
                )),
                // A shared cache of the prompt followed by random text: confident drafts,
                // right or wrong by chance.
                9 => {
                    if i == 0 {
                        for j in 0..40u64 {
                            let mut text = prompt.clone();
                            text.extend(tiny_prompt(seed ^ j, 6).iter().map(|t| t % 6));
                            suffix_cache.insert(0, &text);
                        }
                    }
                    let settings = SuffixSettings { min_prob: 0.0, factor: 4.0, ..Default::default() };
                    Some(Box::new(SuffixProposer::new(settings, Some((suffix_cache.clone(), 0)))))
                }
                8 => {
                    let reference = tiny_prompt(seed, 8);
                    let inner = TestDrafter::new(Kind::Random, TINY_VOCAB, prompt.len(), &reference, &reference, seed);
                    Some(Box::new(TreeTestDrafter { kind: TreeKind::Random, inner }))
                }
                6 => Some(Box::new(specula::speculative::combined::CombinedProposer::new(
                    Box::new(specula::speculative::ngram::NgramProposer::new(1, 1).unwrap()),
                    Box::new(
                        specula::speculative::dflash::build_proposer(dflash_dir.path(), &dflash_settings, target)
                            .unwrap(),
                    ),
                ))),
                _ => {
                    // q(t) ∝ t + 1 on ids 0..8 (a distribution: it sums to 1).
                    let q = (0..TINY_VOCAB).map(|t| if t < 8 { (1 + t) as f32 / 36.0 } else { 0.0 }).collect();
                    Some(Box::new(StochasticDrafter { rng: SamplerRng::from_seed(seed ^ 0x5eed), q }))
                }
            };
            let proposer = proposer.as_mut().map(|p| &mut **p as &mut dyn Proposer);
            let opts = match arm_index {
                7 => GenerateOptions::fixed_draft(2),
                8 | 9 => GenerateOptions::fixed_tree(6),
                _ => GenerateOptions::fixed_tree(2),
            };
            let gen = run(target, &prompt, params(seed), &[], proposer, opts);
            metrics.merge(&gen.metrics);
            *counts.entry(gen.tokens[..FIRST].to_vec()).or_default() += 1;
        }
        let (stat, df) = chi_square(&counts, &exact, SAMPLES);
        let critical = chi_square_critical_001(df);
        eprintln!("{arm}: chi-square {stat:.1} on {df} df (critical {critical:.1}); {metrics:?}");
        assert!(stat < critical, "{arm}: chi-square {stat:.1} >= {critical:.1} on {df} df");
        if arm_index > 0 {
            // Both outcomes of the acceptance test happened, so every path was exercised.
            assert!(metrics.accepted > 0 && metrics.accepted < metrics.drafted, "{arm}: {metrics:?}");
        }
    }
}
