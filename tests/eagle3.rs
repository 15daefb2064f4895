//! EAGLE-3 drafters: against SpecForge's own model code, and lossless through the engine.
//!
//! - Parity: `tests/fixtures/eagle3/` holds a tiny random checkpoint saved by SpecForge 0.2.0's
//!   `LlamaForCausalLMEagle3` (reduced vocabulary, its own embedding, target states narrower
//!   than the drafter) with the logits SpecForge computed on random target states: every
//!   context row's first-pass logits, and a 5-token chain drafted from the last row. The
//!   loader, the layer and the proposer reproduce them within 1e-4 and draft the same tokens
//!   (generator: `tools/eagle3_reference/`).
//! - Lossless: greedy EAGLE-3 output equals plain greedy output on the real SmolLM2-135M, with
//!   random drafters of several shapes (the target's width without an embedding of its own; a
//!   narrow drafter with its own embedding; a one-token draft vocabulary that is often right),
//!   while the drafter's rows stay in step with the target's commits.
//! - Loading: broken checkpoints and drafters for another target are refused by name.
//!
//! The T > 0 distribution test with an EAGLE-3 drafter is in `spec_lossless.rs`.

mod common;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use serde_json::Value;
use specula::engine::{generate, GenerateOptions, Generation};
use specula::kv::KvDtype;
use specula::model::{Linear as TargetLinear, Transformer, WeightFormat};
use specula::sample::SamplingParams;
use specula::speculative::dflash::TargetHead;
use specula::speculative::eagle3::{self, Eagle3Drafter, Eagle3Proposer, Eagle3Settings};
use specula::speculative::{DrafterSpec, Proposer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const TOLERANCE: f32 = 1e-4;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/eagle3")
}

fn fixture() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("fixture.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn matrix(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn the_layer_reproduces_specforge_on_the_fixture() {
    let fx = fixture();
    let drafter = Eagle3Drafter::load(&fixture_dir().join("drafter"), &Device::Cpu).unwrap();
    assert!(drafter.has_embedding());
    let tokens = ids(&fx["tokens"]);
    let taps = matrix(&fx["taps"]);
    let rows = tokens.len();
    let taps = Tensor::from_vec(taps.concat(), (rows, taps[0].len()), &Device::Cpu).unwrap();
    let features = drafter.fuse(&taps).unwrap();
    let embeds = drafter.embed(&tokens, None).unwrap();
    let positions: Vec<usize> = (0..rows).collect();
    let (out, kv) = drafter.forward(&embeds, &features, &positions, &drafter.empty_kv().unwrap(), None).unwrap();
    let first = drafter.logits(&out).unwrap().to_vec2::<f32>().unwrap();
    for (row, (ours, theirs)) in first.iter().zip(matrix(&fx["first_pass_logits"])).enumerate() {
        let d = max_diff(ours, &theirs);
        assert!(d <= TOLERANCE, "row {row}: first-pass logits differ by {d}");
    }
    // The chain from the last row, one single-row pass per draft token.
    let (mut h, mut past) = (out.narrow(0, rows - 1, 1).unwrap(), kv);
    let chain = matrix(&fx["chain_logits"]);
    let drafted = ids(&fx["drafted"]);
    for (step, theirs) in chain.iter().enumerate() {
        let logits = drafter.logits(&h).unwrap().flatten_all().unwrap();
        let d = max_diff(&logits.to_vec1::<f32>().unwrap(), theirs);
        assert!(d <= TOLERANCE, "chain step {step}: logits differ by {d}");
        let token = drafter.target_token(logits.argmax(0).unwrap().to_scalar::<u32>().unwrap());
        assert_eq!(token, drafted[step], "chain step {step}");
        let embeds = drafter.embed(&[token], None).unwrap();
        let (next, kv) = drafter.forward(&embeds, &h, &[rows + step], &past, None).unwrap();
        past = specula::speculative::nn::LayerKv {
            k: Tensor::cat(&[&past.k, &kv.k], 1).unwrap(),
            v: Tensor::cat(&[&past.v, &kv.v], 1).unwrap(),
        };
        h = next;
    }
}

/// The proposer, fed the fixture's states as target taps of a deep target (so none is the
/// last layer's), drafts SpecForge's chain.
#[test]
fn the_proposer_drafts_specforges_chain() {
    let fx = fixture();
    let drafter = Arc::new(Eagle3Drafter::load(&fixture_dir().join("drafter"), &Device::Cpu).unwrap());
    let c = drafter.config.clone();
    let zeros = Tensor::zeros((c.vocab, c.target_hidden), candle_core::DType::F32, &Device::Cpu).unwrap();
    let embedding = Arc::new(QTensor::quantize(&zeros, GgmlDType::F32).unwrap());
    let lm = TargetLinear::from_qtensor(embedding.clone(), None, WeightFormat::F32, &Default::default(), &Device::Cpu)
        .unwrap();
    let norm = Tensor::ones(c.target_hidden, candle_core::DType::F32, &Device::Cpu).unwrap();
    let head = TargetHead::from_parts(embedding, norm, 1e-6, 100, lm, &Device::Cpu);
    let mut p = Eagle3Proposer::new(drafter, head, vec![0, 1, 2], Eagle3Settings::default()).unwrap();

    // Row t of the fixture pairs token t + 1 with the states at t, so the committed sequence is
    // one (arbitrary) first token followed by the fixture's tokens.
    let mut tokens = vec![7u32];
    tokens.extend(ids(&fx["tokens"]));
    let rows = tokens.len() - 1;
    let taps = matrix(&fx["taps"]);
    let th = c.target_hidden;
    let split: Vec<Tensor> = (0..3)
        .map(|i| {
            let part: Vec<f32> = taps.iter().flat_map(|r| r[i * th..(i + 1) * th].to_vec()).collect();
            Tensor::from_vec(part, (rows, th), &Device::Cpu).unwrap()
        })
        .collect();
    p.begin(&tokens[..1]).unwrap();
    // Handed over in two steps, as the engine does after a prefill and a decode step.
    let first: Vec<Tensor> = split.iter().map(|t| t.narrow(0, 0, rows - 3).unwrap()).collect();
    let rest: Vec<Tensor> = split.iter().map(|t| t.narrow(0, rows - 3, 3).unwrap()).collect();
    p.observe(&tokens[..rows - 2], 0..rows - 3, &first).unwrap();
    assert_eq!(p.propose(&tokens[..rows - 2], 2).unwrap().tokens.len(), 2, "drafts mid-way");
    p.observe(&tokens, rows - 3..rows, &rest).unwrap();
    let draft = p.propose(&tokens, 5).unwrap();
    assert_eq!(draft.tokens, ids(&fx["drafted"]));
    // Drafting leaves nothing behind: the same call drafts the same again.
    assert_eq!(p.propose(&tokens, 5).unwrap().tokens, draft.tokens);
    assert_eq!(p.propose(&tokens, 2).unwrap().tokens, draft.tokens[..2]);
}

fn smollm2() -> &'static Transformer {
    static MODEL: std::sync::OnceLock<Transformer> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| Transformer::from_path(&common::smollm2_path(), None, &Device::Cpu).unwrap())
}

fn engine_generate(
    target: &Transformer,
    prompt: &[u32],
    max_new: usize,
    p: Option<&mut dyn Proposer>,
    k: usize,
) -> Generation {
    let pool = target.new_kv_pool_typed(prompt.len() + max_new + 64, KvDtype::F32);
    let opts = GenerateOptions { trace: true, ..GenerateOptions::fixed_draft(k) };
    let params = SamplingParams { max_tokens: Some(max_new), ..SamplingParams::greedy() };
    generate(target.into(), &pool, prompt, params, p, &opts, &mut |_| {}).unwrap()
}

#[test]
fn greedy_eagle3_equals_plain_greedy_on_smollm2() {
    let target = smollm2();
    let c = &target.config;
    // Fixed token ids; the output of SmolLM2 on them repeats itself.
    let prompt: Vec<u32> = vec![504, 3575, 282, 4649, 314, 28, 216, 33, 30, 216, 34, 30, 216, 35, 30];
    let max_new = 40;
    let plain = engine_generate(target, &prompt, max_new, None, 0);
    let common_token = {
        let mut counts = std::collections::HashMap::new();
        for &t in &plain.tokens {
            *counts.entry(t).or_insert(0usize) += 1;
        }
        counts.into_iter().max_by_key(|&(t, n)| (n, t)).unwrap().0
    };
    let tmp = tempfile::tempdir().unwrap();
    let taps = eagle3::default_aux_layer_ids(c.n_layers);
    // (width, own embedding, draft vocabulary, tapped layers incl. the last, draft length)
    let variants: Vec<(usize, bool, Option<Vec<u32>>, [usize; 3], usize)> = vec![
        (c.hidden, false, None, [taps[0], taps[1], taps[2]], 4),
        (64, true, Some((0..500).map(|i| i * 7).collect()), [0, 15, c.n_layers - 1], 3),
        (c.hidden, false, Some(vec![common_token]), [taps[0], taps[1], taps[2]], 6),
    ];
    for (i, (width, own, vocab, taps, k)) in variants.into_iter().enumerate() {
        let dir = tmp.path().join(format!("drafter{i}"));
        common::write_eagle3_drafter(&dir, width, c.hidden, c.vocab, taps, own, vocab.as_deref(), 40 + i as u64);
        let spec = DrafterSpec::parse(&format!("eagle3:{}", dir.display())).unwrap();
        let DrafterSpec::Eagle3 { path, settings } = spec else { panic!("parsed as {spec:?}") };
        let mut p = Checked { inner: eagle3::build_proposer(&path, &settings, target).unwrap(), proposals: 0 };
        let out = engine_generate(target, &prompt, max_new, Some(&mut p as &mut dyn Proposer), k);
        assert_eq!(out.tokens, plain.tokens, "variant {i}");
        assert!(p.proposals + 1 >= out.trace.len(), "variant {i}: the engine skipped drafting");
        let drafted: usize = out.trace.iter().map(|s| s.draft.len()).sum();
        let accepted: usize = out.trace.iter().map(|s| s.accepted).sum();
        eprintln!("variant {i}: drafted {drafted}, accepted {accepted}");
        assert!(drafted > 0, "variant {i} drafted nothing");
        if i == 2 {
            assert!(accepted > 0, "the one-token drafter should sometimes be right");
        }
    }
}

/// Checks the engine's invariant at every draft: the target's states were handed over for
/// every committed row but the last.
struct Checked {
    inner: Eagle3Proposer,
    proposals: usize,
}

impl Proposer for Checked {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn tap_layers(&self) -> &[usize] {
        self.inner.tap_layers()
    }
    fn begin(&mut self, prompt: &[u32]) -> anyhow::Result<()> {
        self.inner.begin(prompt)
    }
    fn observe(&mut self, tokens: &[u32], cached: std::ops::Range<usize>, taps: &[Tensor]) -> anyhow::Result<()> {
        assert_eq!(cached.end + 1, tokens.len(), "observe: the last committed token is not cached yet");
        self.inner.observe(tokens, cached, taps)
    }
    fn propose(&mut self, tokens: &[u32], max_len: usize) -> anyhow::Result<specula::speculative::Draft> {
        assert_eq!(self.inner.pending_catch_up(tokens) + self.held(), tokens.len() - 1, "rows out of step");
        self.proposals += 1;
        self.inner.propose(tokens, max_len)
    }
}

impl Checked {
    fn held(&self) -> usize {
        self.inner.rows().len()
    }
}

#[test]
fn broken_eagle3_drafters_are_refused_by_name() {
    let target = smollm2();
    let c = &target.config;
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    common::write_eagle3_drafter(&good, c.hidden, c.hidden, c.vocab, [1, 14, 26], false, Some(&[1, 2, 3]), 1);
    assert!(eagle3::load_for_target(&good, target).is_ok());
    let refused = |name: &str, edit: &dyn Fn(&Path), why: &str| {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(good.join(f), dir.join(f)).unwrap();
        }
        edit(&dir);
        let err = match eagle3::load_for_target(&dir, target) {
            Ok(_) => panic!("{name}: loaded"),
            Err(e) => format!("{e:#}"),
        };
        assert!(err.contains(why), "{name}: {err}");
    };
    let set = |key: &'static str, value: Value| {
        move |dir: &Path| {
            let mut cfg: Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
            cfg[key] = value.clone();
            std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        }
    };
    refused(
        "deep-tap",
        &set("eagle_config", serde_json::json!({"eagle_aux_hidden_state_layer_ids": [1, 2, 30]})),
        "beyond",
    );
    refused("vocab", &set("vocab_size", serde_json::json!(1000)), "vocabulary mismatch");
    refused("width", &set("target_hidden_size", serde_json::json!(512)), "hidden size mismatch");
    refused("draft-vocab", &set("draft_vocab_size", serde_json::json!(4)), "`lm_head.weight` has shape [3, 576]");
    refused("layers", &set("num_hidden_layers", serde_json::json!(2)), "one decoder layer");
    let without = |name: &'static str| {
        move |dir: &Path| {
            let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
            let tensors: std::collections::HashMap<_, _> = tensors.into_iter().filter(|(k, _)| k != name).collect();
            candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
        }
    };
    refused("no-norm", &without("midlayer.hidden_norm.weight"), "missing tensor `midlayer.hidden_norm.weight`");
    refused("no-d2t", &without("d2t"), "no `d2t` tensor");
    let err = format!("{:#}", DrafterSpec::parse("eagle3:").unwrap_err());
    assert!(err.contains("drafter directory"), "{err}");
}

/// EAGLE-2's dynamic trees with the shipped SmolLM2 drafter: decoding with them equals plain
/// greedy decoding; a tree follows a runner-up's own continuation somewhere; and along the
/// drafter's first choices a tree drafts what its chain drafts, so the depth-by-depth passes
/// (several nodes, each masked to its own ancestors) compute what running one node at a time does.
#[test]
fn eagle3_trees_are_lossless_and_follow_the_chain_along_first_choices() {
    let target = smollm2();
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("drafters/smollm2-135m-eagle3");
    let spec = DrafterSpec::parse(&format!("eagle3:{}", dir.display())).unwrap();
    let DrafterSpec::Eagle3 { path, settings } = spec else { panic!("parsed as {spec:?}") };
    let prompts: [Vec<u32>; 3] = [
        vec![504, 3575, 282, 4649, 314, 28, 216, 33, 30, 216, 34, 30, 216, 35, 30],
        vec![504, 1345, 314, 253, 2365, 30, 378, 7262, 314, 216, 34, 30],
        vec![1780, 1022, 4649, 314, 253, 2023, 30, 15, 216, 33, 30, 15, 216],
    ];
    let generate_with = |prompt: &[u32], opts: GenerateOptions| {
        let mut p = eagle3::build_proposer(&path, &settings, target).unwrap();
        let pool = target.new_kv_pool_typed(prompt.len() + 104, KvDtype::F32);
        let params = SamplingParams { max_tokens: Some(40), ..SamplingParams::greedy() };
        let opts = GenerateOptions { trace: true, ..opts };
        generate(target.into(), &pool, prompt, params, Some(&mut p as &mut dyn Proposer), &opts, &mut |_| {}).unwrap()
    };
    let as_draft = |tokens: &[u32], parents: &[u32]| match parents.is_empty() {
        true => specula::speculative::Draft::deterministic(tokens.to_vec()),
        false => specula::speculative::Draft::tree(tokens.to_vec(), parents.to_vec()),
    };
    let mut runner_up_continued = false;
    for (i, prompt) in prompts.iter().enumerate() {
        let plain = engine_generate(target, prompt, 40, None, 0);
        let chain = generate_with(prompt, GenerateOptions::fixed_draft(8));
        let trees = generate_with(prompt, GenerateOptions::fixed_tree(8));
        assert_eq!(trees.tokens, plain.tokens, "prompt {i}: trees changed the output");
        assert_eq!(chain.tokens, plain.tokens, "prompt {i}");
        for step in &trees.trace {
            let draft = as_draft(&step.draft, &step.parents);
            let children = draft.children();
            // A node that is not its parent's first child, with children of its own.
            runner_up_continued |= (0..draft.len())
                .any(|n| children[draft.parent_row(n)].first() != Some(&n) && !children[n + 1].is_empty());
        }
        // The first step: same state for both. Follow the first child from the root as far as
        // the tree goes: those are the chain's tokens.
        let tree = as_draft(&trees.trace[0].draft, &trees.trace[0].parents);
        let children = tree.children();
        let (mut row, mut first_choices) = (0, Vec::new());
        while let Some(&n) = children[row].first() {
            first_choices.push(tree.tokens[n]);
            row = n + 1;
        }
        let chain_draft = &chain.trace[0].draft;
        eprintln!("prompt {i}: tree {:?} / {:?}, chain {chain_draft:?}", tree.tokens, tree.parents);
        assert!(!first_choices.is_empty());
        assert_eq!(first_choices[..], chain_draft[..first_choices.len()], "prompt {i}: the tree's first choices");
    }
    assert!(runner_up_continued, "no tree followed a runner-up's continuation");
}
