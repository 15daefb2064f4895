//! `specula train dflash`: the objective against an independent implementation, gradients
//! against finite differences, training-mode against serving-mode forwards, a small run that
//! makes a real drafter (τ > 2, lossless), resume = uninterrupted, and export → load.
//!
//! The target is the tiny Hugging Face Qwen3 of `tests/fixtures/dflash/random/` (vocab 256,
//! hidden 64, 4 layers); `tests/fixtures/dflash-train/` holds the loss and gradients the
//! official `dflash==0.1.0` package computes on a fixed batch (generator:
//! `tools/dflash_reference/make_train_fixture.py`).

mod common;

use candle_core::{DType, Device, Tensor, Var};
use serde_json::Value;
use specula::engine::{generate, GenerateOptions, LoadedModel};
use specula::kv::KvDtype;
use specula::model::{Transformer, WeightFormat};
use specula::sample::SamplingParams;
use specula::speculative::dflash::{self, DflashConfig, DflashProposer, DflashSettings, TargetHead};
use specula::speculative::Proposer;
use specula::train::dflash::objective::{sequence_loss, FrozenTarget, ObjectiveSettings, SequenceInput};
use specula::train::dflash::{self as td, drafter_from_params, frozen_target, init_params, TrainRun, TrainSettings};
use specula::train::examples::TrainExample;
use specula::train::features::{fill_feature_cache, target_features, FeatureCache, FeatureKey, Features};
use specula::train::optim::AdamWSettings;
use specula::train::progress::TrainReport;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(path)
}

fn tiny_target() -> LoadedModel {
    LoadedModel::load(&fixture("dflash/random/target"), Some(WeightFormat::F32), &Device::Cpu).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The drafter of a checkpoint directory as trainable variables (sorted by name).
fn params_from_checkpoint(dir: &Path) -> (DflashConfig, Vec<(String, Var)>) {
    let config = DflashConfig::from_file(&dir.join("config.json")).unwrap();
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<String> = dflash::expected_tensors(&config).into_iter().map(|(n, _)| n).collect();
    names.sort();
    let params = names
        .into_iter()
        .map(|n| {
            let t = tensors[&n].to_dtype(DType::F32).unwrap();
            (n, Var::from_tensor(&t).unwrap())
        })
        .collect();
    (config, params)
}

struct FixtureBatch {
    sequences: Vec<(Vec<u32>, Vec<u8>, Vec<usize>)>,
    gamma: f64,
    block: usize,
}

fn fixture_batch() -> FixtureBatch {
    let b: Value = serde_json::from_str(&std::fs::read_to_string(fixture("dflash-train/batch.json")).unwrap()).unwrap();
    let sequences = b["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let tokens = ids(&s["tokens"]);
            let p = s["prompt_tokens"].as_u64().unwrap() as usize;
            let mask = (0..tokens.len()).map(|i| (i >= p) as u8).collect();
            let anchors = ids(&s["anchors"]).into_iter().map(|a| a as usize).collect();
            (tokens, mask, anchors)
        })
        .collect();
    FixtureBatch { sequences, gamma: b["gamma"].as_f64().unwrap(), block: b["block_size"].as_u64().unwrap() as usize }
}

/// The pooled loss `Σ w·CE / Σ w` of the fixture batch, with its per-offset hit counts.
fn pooled_loss(
    drafter: &dflash::DflashDrafter,
    frozen: &FrozenTarget,
    target: &Transformer,
    batch: &FixtureBatch,
) -> (Tensor, f64, Vec<usize>, Vec<usize>) {
    let settings = ObjectiveSettings::hard(batch.block, batch.gamma);
    let mut terms = Vec::new();
    let (mut weight, mut scored, mut hits) = (0.0, vec![0; batch.block - 1], vec![0; batch.block - 1]);
    for (tokens, mask, anchors) in &batch.sequences {
        let f = target_features(target, &drafter.config.target_layer_ids, tokens, KvDtype::F32).unwrap();
        let input = SequenceInput { tokens, loss_mask: mask, features: &f, anchors };
        let l = sequence_loss(drafter, frozen, &input, settings).unwrap();
        weight += l.weight_sum;
        for k in 0..scored.len() {
            scored[k] += l.scored[k];
            hits[k] += l.hits[k];
        }
        terms.push(l.weighted_ce);
    }
    let total = Tensor::stack(&terms, 0).unwrap().sum_all().unwrap();
    ((total / weight).unwrap(), weight, scored, hits)
}

#[test]
fn loss_and_gradients_match_the_reference_package() {
    let target = tiny_target();
    let (config, params) = params_from_checkpoint(&fixture("dflash/random/drafter"));
    let drafter = drafter_from_params(&config, &params, &Device::Cpu).unwrap();
    let frozen = frozen_target(&target.model, None).unwrap();
    let batch = fixture_batch();
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("dflash-train/expected.json")).unwrap()).unwrap();

    let (loss, weight, scored, hits) = pooled_loss(&drafter, &frozen, &target.model, &batch);
    let loss_value = loss.to_scalar::<f32>().unwrap() as f64;
    let want = expected["loss_f64"].as_f64().unwrap();
    assert!((loss_value - want).abs() < 2e-6 * want, "loss {loss_value} vs reference {want}");
    assert!((weight - expected["weight_sum"].as_f64().unwrap()).abs() < 1e-4);
    let valid: Vec<usize> = ids(&expected["valid_rows"]).into_iter().map(|v| v as usize).collect();
    assert_eq!(scored, valid, "scored rows per block offset");
    for (k, acc) in expected["accuracy"].as_array().unwrap().iter().enumerate() {
        if let Some(a) = acc.as_f64() {
            assert!((hits[k] as f64 / scored[k] as f64 - a).abs() < 1e-9, "accuracy at offset {}", k + 1);
        }
    }

    let grads = loss.backward().unwrap();
    let want_grads = candle_core::safetensors::load(fixture("dflash-train/grads.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(want_grads.len(), params.len());
    for (name, p) in &params {
        let got = grads.get(p.as_tensor()).unwrap_or_else(|| panic!("no gradient for {name}"));
        let want = &want_grads[name];
        let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1e-6);
        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff <= 1e-4 * scale, "{name}: max |Δgrad| {diff} against max |grad| {scale}");
    }
}

/// What the serving proposer drafts at `anchor`: the target's taps of `tokens[..anchor]` handed
/// over as the engine does, then the draft logits of the block at `anchor` (B − 1 rows).
fn serving_draft_logits(
    target: &Transformer,
    drafter: &Arc<dflash::DflashDrafter>,
    tokens: &[u32],
    anchor: usize,
) -> Tensor {
    let mut p = DflashProposer::new(drafter.clone(), TargetHead::of(target), DflashSettings::default()).unwrap();
    p.begin(&tokens[..anchor]).unwrap();
    let pool = target.new_kv_pool_typed(anchor.next_multiple_of(16).max(16), KvDtype::F32);
    let mut cache = pool.new_sequence();
    let mut fb = specula::model::ForwardBatch::new();
    fb.tap_layers = drafter.config.target_layer_ids.clone();
    fb.push(&tokens[..anchor], &mut cache, specula::model::LogitsRows::None);
    let out = target.forward(&mut fb).unwrap();
    p.observe(&tokens[..anchor], 0..anchor, &out.taps).unwrap();
    p.draft_logits(&tokens[..=anchor], drafter.config.block_size - 1).unwrap()
}

/// The training forward of one anchor equals what the serving proposer drafts at that point:
/// the same hidden states, so the same logits, through `DflashProposer::draft_logits`.
#[test]
fn training_and_serving_forwards_agree() {
    let target = tiny_target();
    let case = fixture("dflash/fitted");
    let drafter_dir = case.join("drafter");
    let (config, params) = params_from_checkpoint(&drafter_dir);
    let train_drafter = drafter_from_params(&config, &params, &Device::Cpu).unwrap();
    let frozen = frozen_target(&target.model, None).unwrap();
    let batch = fixture_batch();
    let (tokens, mask, _) = &batch.sequences[0];
    let block = config.block_size;
    let serving = Arc::new(dflash::load_for_target(&drafter_dir, &target.model, &Device::Cpu).unwrap());
    for &anchor in &[10usize, 17, 30] {
        // Training: one anchor, its loss over the block's rows.
        let f = target_features(&target.model, &config.target_layer_ids, tokens, KvDtype::F32).unwrap();
        let input = SequenceInput { tokens, loss_mask: mask, features: &f, anchors: &[anchor] };
        let settings = ObjectiveSettings::hard(block, 4.0);
        let l = sequence_loss(&train_drafter, &frozen, &input, settings).unwrap();
        let train_loss = l.weighted_ce.to_scalar::<f32>().unwrap() as f64;

        // Serving: the proposer fed the target's taps of rows ..anchor, drafting at `anchor`.
        let logits = serving_draft_logits(&target.model, &serving, tokens, anchor);
        let lp = candle_nn::ops::log_softmax(&logits, 1).unwrap().to_vec2::<f32>().unwrap();
        let mut serve_loss = 0.0;
        for k in 1..block {
            if anchor + k < tokens.len() && mask[anchor + k] == 1 {
                let w = (-((k - 1) as f64) / 4.0).exp();
                serve_loss -= w * lp[k - 1][tokens[anchor + k] as usize] as f64;
            }
        }
        assert!(
            (train_loss - serve_loss).abs() < 1e-4 * serve_loss.abs().max(1.0),
            "anchor {anchor}: training {train_loss} vs serving {serve_loss}"
        );
    }
}

/// `distill`: each row is scored by soft cross-entropy against the target's own next-token
/// distribution, taken from a plain forward with logits on every row; the reported loss stays
/// the hard one.
#[test]
fn distilling_scores_against_the_targets_own_distribution() {
    let target = tiny_target();
    let drafter_dir = fixture("dflash/fitted").join("drafter");
    let (config, params) = params_from_checkpoint(&drafter_dir);
    let drafter = drafter_from_params(&config, &params, &Device::Cpu).unwrap();
    let frozen = frozen_target(&target.model, None).unwrap();
    let batch = fixture_batch();
    let (tokens, mask, _) = &batch.sequences[0];
    let (block, gamma) = (config.block_size, 4.0);
    let settings = TrainSettings { distill: true, ..Default::default() };
    let layers = settings.feature_layers(&config.target_layer_ids, target.model.config.n_layers);
    assert_eq!(layers.len(), config.target_layer_ids.len() + 1);
    let with_last = target_features(&target.model, &layers, tokens, KvDtype::F32).unwrap();
    let taps_only = target_features(&target.model, &config.target_layer_ids, tokens, KvDtype::F32).unwrap();

    // The target's logits on every row, from an ordinary forward.
    let target_logits = common::logits_of_every_row(&target.model, tokens);
    let target_probs = candle_nn::ops::softmax(&target_logits, 1).unwrap().to_vec2::<f32>().unwrap();

    let serving = Arc::new(dflash::load_for_target(&drafter_dir, &target.model, &Device::Cpu).unwrap());
    let anchors = [10usize, 17, 30];
    let soft = ObjectiveSettings { distill: true, ..ObjectiveSettings::hard(block, gamma) };
    let input = SequenceInput { tokens, loss_mask: mask, features: &with_last, anchors: &anchors };
    let l = sequence_loss(&drafter, &frozen, &input, soft).unwrap();
    let hard_input = SequenceInput { tokens, loss_mask: mask, features: &taps_only, anchors: &anchors };
    let hard = sequence_loss(&drafter, &frozen, &hard_input, ObjectiveSettings::hard(block, gamma)).unwrap();
    // The taps-only features are refused when distilling, and the other way round.
    assert!(sequence_loss(&drafter, &frozen, &hard_input, soft).is_err());
    assert!(sequence_loss(&drafter, &frozen, &input, ObjectiveSettings::hard(block, gamma)).is_err());

    let mut expected = 0.0f64;
    let mut expected_hard = 0.0f64;
    for &anchor in &anchors {
        let logits = serving_draft_logits(&target.model, &serving, tokens, anchor);
        let logits = candle_nn::ops::log_softmax(&logits, 1).unwrap().to_vec2::<f32>().unwrap();
        for k in 1..block {
            if anchor + k < tokens.len() && mask[anchor + k] == 1 {
                let w = (-((k - 1) as f64) / gamma).exp();
                let q = &target_probs[anchor + k - 1];
                let ce: f64 = q.iter().zip(&logits[k - 1]).map(|(&q, &lp)| -(q as f64) * lp as f64).sum();
                expected += w * ce;
                expected_hard -= w * logits[k - 1][tokens[anchor + k] as usize] as f64;
            }
        }
    }
    let got = l.weighted_ce.to_scalar::<f32>().unwrap() as f64;
    assert!((got - expected).abs() < 1e-4 * expected.abs().max(1.0), "distilled {got} vs independent {expected}");
    assert!(
        (l.weighted_hard_ce - expected_hard).abs() < 1e-4 * expected_hard.abs().max(1.0),
        "reported {} vs hard {expected_hard}",
        l.weighted_hard_ce
    );
    assert!((l.weighted_hard_ce - hard.weighted_hard_ce).abs() < 1e-6 * expected_hard.abs().max(1.0));
    assert_eq!((l.hits, l.accepted), (hard.hits, hard.accepted));
    // Soft targets carry the target's uncertainty: the soft loss differs from the hard one.
    assert!((got - expected_hard).abs() > 1e-3, "soft {got} equals hard {expected_hard}");
}

/// Central differences of the loss along random directions agree with the gradient.
#[test]
fn gradients_agree_with_finite_differences() {
    let target = tiny_target();
    let settings = TrainSettings {
        layers: 1,
        heads: Some(2),
        kv_heads: Some(1),
        head_dim: Some(8),
        ffn: Some(32),
        block: 4,
        taps: Some(vec![1, 2]),
        ..Default::default()
    };
    let config = td::drafter_config(&target.model, &settings, 255).unwrap();
    let params = init_params(&config, 7, &Device::Cpu).unwrap();
    // Larger weights than the initialisation so every term moves the loss measurably.
    for (_, p) in &params {
        let bigger = (p.as_tensor() * 3.0).unwrap();
        p.set(&bigger).unwrap();
    }
    let drafter = drafter_from_params(&config, &params, &Device::Cpu).unwrap();
    let frozen = frozen_target(&target.model, None).unwrap();
    let mut batch = fixture_batch();
    batch.block = 4;
    batch.gamma = 2.0;
    let loss_at = || pooled_loss(&drafter, &frozen, &target.model, &batch).0;
    let loss = loss_at();
    let grads = loss.backward().unwrap();
    let mut rng_state = 12345u64;
    for trial in 0..3 {
        // A random direction over all parameters.
        let dirs: Vec<Tensor> = params
            .iter()
            .map(|(_, p)| {
                let n = p.elem_count();
                let v: Vec<f32> = (0..n)
                    .map(|_| {
                        rng_state = rng_state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        ((rng_state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
                    })
                    .collect();
                Tensor::from_vec(v, p.dims(), &Device::Cpu).unwrap()
            })
            .collect();
        // A unit direction: a step of `eps` moves the parameters by `eps` in L2 norm.
        let norm: f32 =
            dirs.iter().map(|d| d.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()).sum::<f32>().sqrt();
        let dirs: Vec<Tensor> = dirs.iter().map(|d| (d / norm as f64).unwrap()).collect();
        let analytic: f64 = params
            .iter()
            .zip(&dirs)
            .map(|((_, p), d)| {
                (grads.get(p.as_tensor()).unwrap() * d).unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64
            })
            .sum();
        let eps = 1e-2;
        let shift = |sign: f64| {
            for ((_, p), d) in params.iter().zip(&dirs) {
                let moved = (p.as_tensor() + (d * (sign * eps)).unwrap()).unwrap();
                p.set(&moved).unwrap();
            }
        };
        shift(1.0);
        let up = loss_at().to_scalar::<f32>().unwrap() as f64;
        shift(-2.0);
        let down = loss_at().to_scalar::<f32>().unwrap() as f64;
        shift(1.0);
        let numeric = (up - down) / (2.0 * eps);
        assert!(
            (numeric - analytic).abs() <= 1e-2 * analytic.abs().max(0.01),
            "direction {trial}: finite differences {numeric} vs gradient {analytic}"
        );
    }
}

/// Greedy continuations of random prompts by the tiny target: its own outputs, the data a
/// drafter learns from.
fn tiny_examples(target: &LoadedModel, n: usize, prompt_len: usize, new_tokens: usize, seed: u64) -> Vec<TrainExample> {
    let mut state = seed;
    (0..n)
        .map(|i| {
            let prompt: Vec<u32> = (0..prompt_len)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((state >> 33) % 255) as u32
                })
                .collect();
            let out = greedy(&target.model, &prompt, new_tokens, None);
            let mut tokens = prompt.clone();
            tokens.extend(&out);
            let loss_mask = (0..tokens.len()).map(|j| (j >= prompt_len) as u8).collect();
            TrainExample {
                key: format!("tiny/{i}"),
                prompt_hash: seed.wrapping_mul(1000) + i as u64,
                tokens,
                loss_mask,
                source: 0,
            }
        })
        .collect()
}

fn greedy(target: &Transformer, prompt: &[u32], max_new: usize, p: Option<&mut dyn Proposer>) -> Vec<u32> {
    greedy_run(target, prompt, max_new, p).tokens
}

fn greedy_run(
    target: &Transformer,
    prompt: &[u32],
    max_new: usize,
    p: Option<&mut dyn Proposer>,
) -> specula::engine::Generation {
    let pool = target.new_kv_pool_typed(prompt.len() + max_new + 64, KvDtype::F32);
    let params = SamplingParams { temperature: 0.0, max_tokens: Some(max_new), ..Default::default() };
    let opts = GenerateOptions::fixed_draft(7);
    generate(target.into(), &pool, prompt, params, p, &opts, &mut |_| {}).unwrap()
}

fn tiny_settings(steps: usize) -> TrainSettings {
    TrainSettings {
        layers: 1,
        block: 8,
        taps: Some(vec![1, 2]),
        anchors: 16,
        steps: Some(steps),
        batch: 4,
        seed: 3,
        adam: AdamWSettings { lr: 3e-3, ..Default::default() },
        val_examples: 4,
        checkpoint_every: 1000,
        mask_token: Some(255),
        gamma: Some(4.0),
        draft_vocab: None,
        attention_bias: false,
        ..Default::default()
    }
}

/// The last `n` examples held out (the trainer's own split holds out one in 20 by key: too
/// few for these small sets).
fn holdout(mut examples: Vec<TrainExample>, n: usize) -> (Vec<TrainExample>, Vec<TrainExample>) {
    let val = examples.split_off(examples.len() - n.min(examples.len() / 2));
    (examples, val)
}

fn run_training(
    target: &LoadedModel,
    examples: &[TrainExample],
    settings: TrainSettings,
    out: &Path,
    resume: bool,
    stop_after: Option<usize>,
) -> TrainReport {
    try_training(target, examples, settings, out, resume, stop_after).unwrap()
}

fn try_training(
    target: &LoadedModel,
    examples: &[TrainExample],
    settings: TrainSettings,
    out: &Path,
    resume: bool,
    stop_after: Option<usize>,
) -> anyhow::Result<TrainReport> {
    let (train, val) = holdout(examples.to_vec(), settings.val_examples);
    let layer_ids = settings.taps.clone().unwrap();
    let run = TrainRun {
        target: &target.model,
        tokenizer: &target.tokenizer,
        train,
        val,
        settings,
        out: out.to_path_buf(),
        resume,
        stop_after,
        export_dtype: DType::F32,
        log_every: 50,
        data: vec!["tiny".into()],
        feature_secs: 0.0,
    };
    let mut features = Features::Online { target: &target.model, layer_ids };
    run.run(&mut features, &mut ())
}

/// A CI-sized run: a tiny target's own greedy outputs, a two-layer drafter, a few hundred
/// steps on cached (offline) features. The exported drafter loads through the same path as
/// `--drafter dflash:DIR` and, in real speculative decoding of its training prompts, reaches
/// τ > 2; speculative output equals plain greedy output. (A tiny random target's continuations
/// are chaotic, so a drafter this small does not generalise to unseen prompts within a CI
/// budget; held-out acceptance is measured on real models by `specula bench`.)
#[test]
fn a_small_run_trains_a_drafter_that_reaches_tau_2() {
    let target = LoadedModel::load(&fixture("dflash/fitted/target"), Some(WeightFormat::F32), &Device::Cpu).unwrap();
    let examples = tiny_examples(&target, 96, 12, 40, 1);
    let out = tempfile::tempdir().unwrap();
    let settings = TrainSettings {
        layers: 2,
        batch: 16,
        val_examples: 0,
        adam: AdamWSettings { lr: 3e-3, weight_decay: 0.0, ..Default::default() },
        ..tiny_settings(400)
    };
    let key = FeatureKey {
        target: "fitted".into(),
        target_sha256: String::new(),
        layer_ids: vec![1, 2],
        hidden: 64,
        max_tokens: settings.max_tokens,
    };
    let mut cache = FeatureCache::open(&out.path().join("features"), key.clone()).unwrap();
    let all: Vec<&TrainExample> = examples.iter().collect();
    fill_feature_cache(&mut cache, &key, &target.model, &all, |_, _| {}).unwrap();
    assert_eq!(cache.len(), examples.len());
    let run = TrainRun {
        target: &target.model,
        tokenizer: &target.tokenizer,
        train: examples.clone(),
        val: Vec::new(),
        settings,
        out: out.path().to_path_buf(),
        resume: false,
        stop_after: None,
        export_dtype: DType::F16,
        log_every: 100,
        data: vec!["tiny".into()],
        feature_secs: 0.0,
    };
    let report = run.run(&mut Features::Offline(vec![cache]), &mut ()).unwrap();
    assert_eq!(report.steps, 400);

    let drafter_dir = out.path().join("drafter");
    let drafter = Arc::new(dflash::load_for_target(&drafter_dir, &target.model, &Device::Cpu).unwrap());
    let (mut accepted, mut steps) = (0usize, 0usize);
    for e in examples.iter().take(8) {
        let prompt = &e.tokens[..12];
        let plain = greedy(&target.model, prompt, 40, None);
        assert_eq!(plain, e.tokens[12..], "the target's greedy output is the training response");
        let mut p =
            DflashProposer::new(drafter.clone(), TargetHead::of(&target.model), DflashSettings::default()).unwrap();
        let spec = greedy_run(&target.model, prompt, 40, Some(&mut p));
        assert_eq!(spec.tokens, plain, "speculative output differs from plain greedy for {prompt:?}");
        accepted += spec.metrics.accepted as usize;
        steps += spec.metrics.steps as usize;
    }
    let tau = 1.0 + accepted as f64 / steps as f64;
    eprintln!("measured τ {tau:.2} over {steps} verify steps");
    assert!(tau > 2.0, "measured τ {tau}");

    // The validation estimate simulates those verify steps on the answers: it counts the
    // same steps as serving did.
    let (config, params) = params_from_checkpoint(&drafter_dir);
    let trained = drafter_from_params(&config, &params, &Device::Cpu).unwrap();
    let frozen = frozen_target(&target.model, None).unwrap();
    let (mut committed, mut sim_steps) = (0, 0);
    for e in examples.iter().take(8) {
        let f = target_features(&target.model, &config.target_layer_ids, &e.tokens, KvDtype::F16).unwrap();
        let (c, n) = td::serving_walk(&trained, &frozen, e, &f, ObjectiveSettings::hard(8, 4.0)).unwrap();
        committed += c;
        sim_steps += n;
    }
    let estimate = committed as f64 / sim_steps as f64;
    eprintln!("simulated τ {estimate:.3} over {sim_steps} steps, measured {tau:.3} over {steps}");
    assert!((estimate - tau).abs() <= 0.05, "simulated τ {estimate} against measured {tau}");
}

/// Stopping after k steps and resuming gives exactly the weights of the uninterrupted run.
#[test]
fn resume_continues_exactly() {
    let target = tiny_target();
    let examples = tiny_examples(&target, 16, 8, 24, 5);
    let settings = TrainSettings { checkpoint_every: 3, ..tiny_settings(8) };
    let whole = tempfile::tempdir().unwrap();
    run_training(&target, &examples, settings.clone(), whole.path(), false, None);
    let parts = tempfile::tempdir().unwrap();
    let first = run_training(&target, &examples, settings.clone(), parts.path(), false, Some(3));
    assert_eq!(first.steps, 3);
    let second = run_training(&target, &examples, settings, parts.path(), true, None);
    assert_eq!(second.steps, 8);
    let a = candle_core::safetensors::load(whole.path().join("drafter/model.safetensors"), &Device::Cpu).unwrap();
    let b = candle_core::safetensors::load(parts.path().join("drafter/model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(a.len(), b.len());
    for (name, t) in &a {
        let diff = (t - &b[name]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0, "{name} differs after resuming");
    }
}

/// A reduced drafter vocabulary: exported with `d2t`, loaded with the target's own head rows,
/// drafting only its tokens, and still lossless.
#[test]
fn a_reduced_vocabulary_drafter_exports_loads_and_stays_lossless() {
    let target = tiny_target();
    let examples = tiny_examples(&target, 16, 8, 24, 9);
    let out = tempfile::tempdir().unwrap();
    let settings = TrainSettings { draft_vocab: Some(40), ..tiny_settings(30) };
    run_training(&target, &examples, settings, out.path(), false, None);
    let dir = out.path().join("drafter");
    let config: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["dflash_config"]["draft_vocab_size"], 40);
    let drafter = Arc::new(dflash::load_for_target(&dir, &target.model, &Device::Cpu).unwrap());
    let vocab: Vec<u32> = drafter.draft_vocab().unwrap().to_vec();
    assert_eq!(vocab.len(), 40);
    let e = &tiny_examples(&target, 1, 8, 0, 77)[0];
    let mut p = DflashProposer::new(drafter.clone(), TargetHead::of(&target.model), DflashSettings::default()).unwrap();
    let spec = greedy_run(&target.model, &e.tokens, 32, Some(&mut p));
    assert_eq!(spec.tokens, greedy(&target.model, &e.tokens, 32, None));
    for t in &spec.trace {
        assert!(t.draft.iter().all(|d| vocab.contains(d)), "drafted a token outside the drafter's vocabulary");
    }
}

/// The held-out split is the fixed rule whatever the order; a validation pool replaces the
/// held-out examples and keeps the same prompts out of training; the reduced vocabulary is the
/// N most frequent response tokens, sorted.
#[test]
fn frequent_tokens_and_validation_split_are_deterministic() {
    use specula::train::validation::{is_held_out, split};
    let target = tiny_target();
    let examples = tiny_examples(&target, 60, 4, 8, 2);
    let held: Vec<String> = examples.iter().filter(|e| is_held_out(&e.key)).map(|e| e.key.clone()).collect();
    assert!(!held.is_empty(), "60 keys hold none out");
    let mut shuffled = examples.clone();
    shuffled.reverse();
    let a = split(examples.clone(), None, 100).unwrap();
    let b = split(shuffled, None, 100).unwrap();
    let keys = |v: &[TrainExample]| v.iter().map(|e| e.key.clone()).collect::<Vec<_>>();
    assert_eq!(keys(&a.train), keys(&b.train));
    assert_eq!(keys(&a.val), keys(&b.val));
    assert_eq!(keys(&a.val), held);
    // Held out from another directory: the same prompts' training examples are left out.
    let mut pool = examples.clone();
    for e in &mut pool {
        e.tokens.push(7);
        e.loss_mask.push(1);
    }
    let c = split(examples.clone(), Some(pool.clone()), 100).unwrap();
    assert_eq!(keys(&c.val), held);
    assert!(c.val.iter().all(|v| pool.iter().any(|p| p.tokens == v.tokens)), "validation rows come from the pool");
    assert_eq!(keys(&c.train), keys(&a.train));
    let top = specula::train::vocab::frequent_tokens(&examples, 256, 5);
    assert_eq!(top.len(), 5);
    assert!(top.windows(2).all(|w| w[0] < w[1]));
}

/// The fixture of `export_loads_in_the_reference_package`: a drafter for the tiny target,
/// briefly trained and exported in f16 to `tests/fixtures/dflash-export/drafter`. Run by hand
/// (`cargo test --release --test dflash_train -- --ignored write_export_fixture`), then
/// `tools/dflash_reference/check_export.py` writes the reference's logits next to it.
#[test]
#[ignore]
fn write_export_fixture() {
    let target = tiny_target();
    let examples = tiny_examples(&target, 16, 8, 24, 11);
    let dir = fixture("dflash-export");
    let out = tempfile::tempdir().unwrap();
    let settings = TrainSettings { layers: 2, ..tiny_settings(40) };
    let (train, val) = holdout(examples, 4);
    let run = TrainRun {
        target: &target.model,
        tokenizer: &target.tokenizer,
        train,
        val,
        settings,
        out: out.path().to_path_buf(),
        resume: false,
        stop_after: None,
        export_dtype: DType::F16,
        log_every: 50,
        data: vec!["tiny".into()],
        feature_secs: 0.0,
    };
    run.run(&mut Features::Online { target: &target.model, layer_ids: vec![1, 2] }, &mut ()).unwrap();
    std::fs::create_dir_all(dir.join("drafter")).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(out.path().join("drafter").join(f), dir.join("drafter").join(f)).unwrap();
    }
}

/// A drafter exported by the trainer (f16, z-lab layout) loaded by the official `dflash`
/// package gives the draft logits we compute for the same block, within 1e-4
/// (`tests/fixtures/dflash-export/expected.json`, written by `check_export.py`).
#[test]
fn export_loads_in_the_reference_package() {
    let target = tiny_target();
    let dir = fixture("dflash-export");
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let tokens = ids(&expected["tokens"]);
    let anchor = expected["anchor"].as_u64().unwrap() as usize;
    let drafter = Arc::new(dflash::load_for_target(&dir.join("drafter"), &target.model, &Device::Cpu).unwrap());
    let ours = serving_draft_logits(&target.model, &drafter, &tokens, anchor).to_vec2::<f32>().unwrap();
    let theirs: Vec<Vec<f32>> = expected["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect();
    assert_eq!(ours.len(), theirs.len());
    let mut worst = 0f32;
    for (a, b) in ours.iter().zip(&theirs) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            worst = worst.max((x - y).abs());
        }
    }
    assert!(worst <= 1e-4, "max |Δ logit| {worst} against the reference package");
}

/// `--init-from`: a run can start from an exported drafter (its shape, MASK and reduced
/// vocabulary come with it), at its own block size or another.
#[test]
fn a_run_starts_from_an_exported_drafter() {
    let target = tiny_target();
    let examples = tiny_examples(&target, 12, 8, 16, 21);
    let first = tempfile::tempdir().unwrap();
    run_training(
        &target,
        &examples,
        TrainSettings { draft_vocab: Some(30), ..tiny_settings(5) },
        first.path(),
        false,
        None,
    );
    let second = tempfile::tempdir().unwrap();
    let settings = TrainSettings {
        init_from: Some(first.path().join("drafter")),
        keep_draft_vocab: true,
        adam: AdamWSettings { lr: 1e-12, weight_decay: 0.0, ..Default::default() },
        ..tiny_settings(1)
    };
    run_training(&target, &examples, settings.clone(), second.path(), false, None);
    let a = candle_core::safetensors::load(first.path().join("drafter/model.safetensors"), &Device::Cpu).unwrap();
    let b = candle_core::safetensors::load(second.path().join("drafter/model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(a.len(), b.len());
    for (name, t) in &a {
        let diff = (t.to_dtype(DType::F32).unwrap() - b[name].to_dtype(DType::F32).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff <= 1e-6, "{name} moved by {diff}");
    }
    // The same weights train on another block size; the export records the new one.
    let third = tempfile::tempdir().unwrap();
    let settings = TrainSettings { block: 4, ..settings };
    run_training(&target, &examples, settings.clone(), third.path(), false, None);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(third.path().join("drafter/config.json")).unwrap()).unwrap();
    assert_eq!(config["block_size"], 4);
    let c = candle_core::safetensors::load(third.path().join("drafter/model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(c.len(), a.len());

    // A new vocabulary, re-picked from the run's data: every weight carries over (the output
    // rows are the target's), only `d2t` changes.
    let fourth = tempfile::tempdir().unwrap();
    let settings = TrainSettings { keep_draft_vocab: false, draft_vocab: Some(50), block: 8, ..settings };
    run_training(&target, &examples, settings, fourth.path(), false, None);
    let d = candle_core::safetensors::load(fourth.path().join("drafter/model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(d["d2t"].dims(), [50]);
    assert_eq!(
        d["d2t"].to_vec1::<i64>().unwrap(),
        specula::train::vocab::frequent_tokens(&holdout(examples.clone(), 4).0, 256, 50)
            .iter()
            .map(|&t| t as i64)
            .collect::<Vec<_>>()
    );
    for (name, t) in a.iter().filter(|(n, _)| *n != "d2t") {
        let diff = (t.to_dtype(DType::F32).unwrap() - d[name].to_dtype(DType::F32).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff <= 1e-6, "{name} moved by {diff}");
    }
    // Its record counts the steps of both runs and the held-out rule.
    let record = specula::train::validation::TrainingRecord::read(&fourth.path().join("drafter")).unwrap().unwrap();
    assert_eq!(record.steps, 5 + 1);
    assert_eq!(record.runs.len(), 2);
    // A drafter trained under another held-out rule is refused: its training may have read
    // today's validation examples.
    let mut other = record.clone();
    other.validation_rule = "first 32 by hash".into();
    other.write(&fourth.path().join("drafter")).unwrap();
    let err = try_training(
        &target,
        &examples,
        TrainSettings { init_from: Some(fourth.path().join("drafter")), ..tiny_settings(1) },
        tempfile::tempdir().unwrap().path(),
        false,
        None,
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("held-out rule"), "{err:#}");
}

/// `--resume` with more steps extends a run: the same moments and no second warm-up, the
/// learning rate decaying on from where it was; a shape change is refused by name.
#[test]
fn an_extended_run_keeps_its_moments_and_its_place_in_the_schedule() {
    use specula::train::optim::LrSchedule;
    let target = tiny_target();
    let examples = tiny_examples(&target, 16, 8, 24, 5);
    let out = tempfile::tempdir().unwrap();
    let settings = TrainSettings { checkpoint_every: 3, warmup: 0.25, ..tiny_settings(8) };
    run_training(&target, &examples, settings.clone(), out.path(), false, Some(6));
    let longer = TrainSettings { steps: Some(20), ..settings.clone() };
    let report = run_training(&target, &examples, longer.clone(), out.path(), true, None);
    assert_eq!((report.steps, report.total_steps), (20, 20));
    let ckpt: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("checkpoint/state.json")).unwrap()).unwrap();
    let schedule: LrSchedule = serde_json::from_value(ckpt["schedule"].clone()).unwrap();
    let first = LrSchedule::new(3e-3, 8, 2);
    assert_eq!(schedule, first.extend(6, 20));
    let lrs: Vec<(usize, f64)> = std::fs::read_to_string(out.path().join("train-log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap() as usize, v["lr"].as_f64().unwrap())
        })
        .collect();
    // Steps 1–6 on the first schedule, then a decay that starts at step 6's rate.
    for (step, lr) in &lrs {
        let want = if *step <= 6 { first.lr(step - 1) } else { schedule.lr(step - 1) };
        assert!((lr - want).abs() < 1e-15, "step {step}: lr {lr}, want {want}");
    }
    assert!(lrs.iter().any(|(s, _)| *s > 6));
    // The moments came back: the optimiser's update count continues.
    let tensors =
        candle_core::safetensors::load(out.path().join("checkpoint/state.safetensors"), &Device::Cpu).unwrap();
    assert!(tensors.keys().any(|k| k.starts_with("adam.m.")));
    let err = try_training(
        &target,
        &examples,
        TrainSettings { layers: 2, steps: Some(30), ..longer },
        out.path(),
        true,
        None,
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("(layers)"), "{err:#}");
}

/// `--init-from-target`: drafter layer i starts with target layer i's weights.
#[test]
fn init_from_target_copies_the_target_layers() {
    let target = tiny_target();
    let settings = TrainSettings { layers: 2, taps: Some(vec![1, 2]), ..Default::default() };
    let config = td::drafter_config(&target.model, &settings, 255).unwrap();
    let params = init_params(&config, 1, &Device::Cpu).unwrap();
    td::init_from_target_layers(&config, &params, &target.model).unwrap();
    let get = |n: &str| params.iter().find(|(name, _)| name == n).unwrap().1.as_tensor().clone();
    for (drafter, gguf) in [
        ("layers.1.self_attn.q_proj.weight", "blk.1.attn_q.weight"),
        ("layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
        ("layers.1.input_layernorm.weight", "blk.1.attn_norm.weight"),
    ] {
        let want = target.model.read_dense(gguf).unwrap();
        let diff = (get(drafter) - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0, "{drafter}");
    }
    let fc: Vec<Vec<f32>> = get("fc.weight").to_vec2().unwrap();
    assert!(fc[3][3] == 1.0 && fc[3][4] == 0.0 && fc[3][64 + 3] == 0.0, "fc passes the first tap through");
}

/// `--attention-bias`: before training, query head h attends mostly to the row 1 + h/2
/// positions back; the drafter trains, exports with its biases, loads through the serving path
/// with the same draft logits as the training forward, and stays lossless.
#[test]
fn an_attention_bias_drafter_starts_with_position_heads_trains_and_serves() {
    let target = tiny_target();
    let settings = TrainSettings { attention_bias: true, layers: 2, ..tiny_settings(20) };
    let config = td::drafter_config(&target.model, &settings, 255).unwrap();
    assert!(config.attention_bias);
    let params = init_params(&config, 1, &Device::Cpu).unwrap();
    td::init_relative_position_heads(&config, &params).unwrap();
    let get = |n: &str| params.iter().find(|(name, _)| name == n).unwrap().1.as_tensor().clone();
    // The pattern alone (the biases through the q/k norms and RoPE): head h's scores peak at
    // offset 1 + h/2 among the 24 positions before the query.
    let d = config.head_dim;
    let q: Vec<f32> = get("layers.0.self_attn.q_proj.bias").to_vec1().unwrap();
    let k: Vec<f32> = get("layers.0.self_attn.k_proj.bias").to_vec1().unwrap();
    let rotate = |v: &[f32], pos: usize| -> Vec<f32> {
        let mut out = v.to_vec();
        for i in 0..d / 2 {
            let a = pos as f64 * config.rope_theta.powf(-2.0 * i as f64 / d as f64);
            let (c, s) = (a.cos() as f32, a.sin() as f32);
            out[i] = v[i] * c - v[i + d / 2] * s;
            out[i + d / 2] = v[i + d / 2] * c + v[i] * s;
        }
        out
    };
    for h in 0..config.n_heads {
        let qh = rotate(&q[h * d..(h + 1) * d], 40);
        let kv = h / (config.n_heads / config.n_kv_heads);
        let best = (1..=24)
            .max_by(|&a, &b| {
                let score = |back: usize| -> f32 {
                    rotate(&k[kv * d..(kv + 1) * d], 40 - back).iter().zip(&qh).map(|(x, y)| x * y).sum()
                };
                score(a).total_cmp(&score(b))
            })
            .unwrap();
        assert_eq!(best, td::relative_position_head_offset(h), "head {h}");
    }

    let examples = tiny_examples(&target, 16, 8, 24, 9);
    let out = tempfile::tempdir().unwrap();
    run_training(&target, &examples, settings, out.path(), false, None);
    let dir = out.path().join("drafter");
    let exported: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(exported["attention_bias"], true);
    let (config, params) = params_from_checkpoint(&dir);
    let train_drafter = drafter_from_params(&config, &params, &Device::Cpu).unwrap();
    let serving = Arc::new(dflash::load_for_target(&dir, &target.model, &Device::Cpu).unwrap());
    let frozen = frozen_target(&target.model, None).unwrap();
    let e = &examples[0];
    let anchor = e.tokens.len() - 10;
    let f = target_features(&target.model, &config.target_layer_ids, &e.tokens, KvDtype::F32).unwrap();
    let input = SequenceInput { tokens: &e.tokens, loss_mask: &e.loss_mask, features: &f, anchors: &[anchor] };
    let l = sequence_loss(&train_drafter, &frozen, &input, ObjectiveSettings::hard(config.block_size, 4.0)).unwrap();
    let train_loss = l.weighted_ce.to_scalar::<f32>().unwrap() as f64;
    let logits = serving_draft_logits(&target.model, &serving, &e.tokens, anchor);
    let lp = candle_nn::ops::log_softmax(&logits, 1).unwrap().to_vec2::<f32>().unwrap();
    let mut serve_loss = 0.0;
    for k in 1..config.block_size {
        if anchor + k < e.tokens.len() && e.loss_mask[anchor + k] == 1 {
            serve_loss -= (-((k - 1) as f64) / 4.0).exp() * lp[k - 1][e.tokens[anchor + k] as usize] as f64;
        }
    }
    assert!((train_loss - serve_loss).abs() < 1e-4 * serve_loss.abs().max(1.0), "{train_loss} vs {serve_loss}");

    let prompt = &tiny_examples(&target, 1, 8, 0, 77)[0].tokens;
    let mut p = DflashProposer::new(serving, TargetHead::of(&target.model), DflashSettings::default()).unwrap();
    let spec = greedy_run(&target.model, prompt, 32, Some(&mut p));
    assert_eq!(spec.tokens, greedy(&target.model, prompt, 32, None));
}

/// A drafter in speculators' layout (served as it is) is not a starting point for this
/// trainer: refused by name, not half-read.
#[test]
fn init_from_a_speculators_drafter_is_refused_clearly() {
    let target = tiny_target();
    let examples = tiny_examples(&target, 8, 8, 16, 4);
    let dir = fixture("interop/speculators-dflash/drafter");
    let err = try_training(
        &target,
        &examples,
        TrainSettings { init_from: Some(dir), keep_draft_vocab: true, ..tiny_settings(1) },
        tempfile::tempdir().unwrap().path(),
        false,
        None,
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("speculators' layout"), "{err:#}");
}
