//! `specula train eagle3`: gradients of the training-time-test loss against finite differences,
//! the objective's chain counts = the proposer's drafts, a small run that makes a drafter whose
//! chains are accepted (measured by real speculative decoding, lossless), resume =
//! uninterrupted, and export → load (same logits as training, and as SpecForge's own class
//! computes on the export: `tests/fixtures/eagle3-export/`).
//!
//! Targets: the tiny Hugging Face Qwen3s of `tests/fixtures/dflash/` (vocab 256, hidden 64, 4
//! layers), and their own greedy outputs as data.

mod common;

use candle_core::{DType, Device, Tensor};
use specula::engine::{generate, GenerateOptions, LoadedModel};
use specula::kv::KvDtype;
use specula::model::{Transformer, WeightFormat};
use specula::sample::SamplingParams;
use specula::speculative::eagle3::{self, Eagle3Drafter, Eagle3Settings};
use specula::speculative::Proposer;
use specula::train::checkpoint::CheckpointMeta;
use specula::train::eagle3::objective::{scored, sequence_loss, SequenceInput};
use specula::train::eagle3::{self as te, Eagle3Run, Eagle3TrainSettings};
use specula::train::examples::TrainExample;
use specula::train::features::target_features;
use specula::train::features::Features;
use specula::train::optim::AdamWSettings;
use specula::train::progress::TrainReport;
use std::path::{Path, PathBuf};

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(path)
}

fn load(case: &str) -> LoadedModel {
    LoadedModel::load(&fixture(&format!("dflash/{case}/target")), Some(WeightFormat::F32), &Device::Cpu).unwrap()
}

fn greedy_run(
    target: &Transformer,
    prompt: &[u32],
    max_new: usize,
    p: Option<&mut dyn Proposer>,
    k: usize,
) -> specula::engine::Generation {
    let pool = target.new_kv_pool_typed(prompt.len() + max_new + 64, KvDtype::F32);
    let params = SamplingParams { temperature: 0.0, max_tokens: Some(max_new), ..Default::default() };
    generate(target.into(), &pool, prompt, params, p, &GenerateOptions::fixed_draft(k), &mut |_| {}).unwrap()
}

/// Greedy continuations of pseudo-random prompts by the target: the data a drafter learns from.
fn examples(target: &LoadedModel, n: usize, prompt_len: usize, new_tokens: usize, seed: u64) -> Vec<TrainExample> {
    let mut state = seed;
    (0..n)
        .map(|i| {
            let prompt: Vec<u32> = (0..prompt_len)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((state >> 33) % 255) as u32
                })
                .collect();
            let mut tokens = prompt.clone();
            tokens.extend(greedy_run(&target.model, &prompt, new_tokens, None, 0).tokens);
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

fn settings(steps: usize) -> Eagle3TrainSettings {
    Eagle3TrainSettings {
        ttt_steps: 4,
        taps: Some(vec![0, 1, 2]),
        steps: Some(steps),
        batch: 4,
        seed: 3,
        adam: AdamWSettings { lr: 3e-3, ..Default::default() },
        val_examples: 4,
        checkpoint_every: 1000,
        ..Default::default()
    }
}

fn run(
    target: &LoadedModel,
    data: &[TrainExample],
    s: Eagle3TrainSettings,
    out: &Path,
    resume: bool,
    stop: Option<usize>,
) -> anyhow::Result<TrainReport> {
    let layer_ids = s.feature_layers(&target.model);
    // The last examples held out (the trainer's own split holds out one in 20 by key: too few
    // for these small sets).
    let mut train = data.to_vec();
    let val = train.split_off(data.len() - s.val_examples.min(data.len() / 2));
    let run = Eagle3Run {
        target: &target.model,
        train,
        val,
        settings: s,
        out: out.to_path_buf(),
        resume,
        stop_after: stop,
        export_dtype: DType::F32,
        log_every: 50,
        data: vec!["tiny".into()],
        feature_secs: 0.0,
    };
    run.run(&mut Features::Online { target: &target.model, layer_ids }, &mut ())
}

#[test]
fn gradients_agree_with_finite_differences() {
    let target = load("random");
    let s = settings(1);
    let data = examples(&target, 2, 6, 10, 11);
    let vocab: Vec<u32> = (0..256).collect();
    let config = te::drafter_config(&target.model, &s, vocab.len());
    let params = te::init_params(&config, 5, &Device::Cpu).unwrap();
    // Larger weights than the initialisation so every term moves the loss measurably.
    for (_, p) in &params {
        let bigger = (p.as_tensor() * 8.0).unwrap();
        p.set(&bigger).unwrap();
    }
    let drafter = te::drafter_from_params(&config, &params, &vocab, &Device::Cpu).unwrap();
    let frozen = te::frozen_target(&target.model, &vocab).unwrap();
    let features: Vec<Tensor> = data
        .iter()
        .map(|e| target_features(&target.model, &s.feature_layers(&target.model), &e.tokens, KvDtype::F32).unwrap())
        .collect();
    let mut norms = vec![0.0f64; s.ttt_steps];
    for e in &data {
        for (j, v) in scored(&e.tokens, &e.loss_mask, &frozen, s.ttt_steps).iter().enumerate() {
            norms[j] += v.iter().filter(|&&x| x).count() as f64;
        }
    }
    assert!(norms.iter().all(|&n| n > 0.0), "every step must be scored: {norms:?}");
    let loss_at = || -> Tensor {
        let mut total = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
        for (e, f) in data.iter().zip(&features) {
            let input = SequenceInput { tokens: &e.tokens, loss_mask: &e.loss_mask, features: f };
            total = (total + sequence_loss(&drafter, &frozen, &input, &norms).unwrap().weighted_ce).unwrap();
        }
        total
    };
    let grads = loss_at().backward().unwrap();
    let mut state = 99u64;
    for trial in 0..3 {
        let dirs: Vec<Tensor> = params
            .iter()
            .map(|(_, p)| {
                let v: Vec<f32> = (0..p.elem_count())
                    .map(|_| {
                        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
                    })
                    .collect();
                Tensor::from_vec(v, p.dims(), &Device::Cpu).unwrap()
            })
            .collect();
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
                p.set(&(p.as_tensor() + (d * (sign * eps)).unwrap()).unwrap()).unwrap();
            }
        };
        shift(1.0);
        let up = loss_at().to_scalar::<f32>().unwrap() as f64;
        shift(-2.0);
        let down = loss_at().to_scalar::<f32>().unwrap() as f64;
        shift(1.0);
        let numeric = (up - down) / (2.0 * eps);
        assert!(
            (numeric - analytic).abs() <= 2e-2 * analytic.abs().max(0.01),
            "direction {trial}: finite differences {numeric} vs gradient {analytic}"
        );
    }
}

/// A CI-sized run on a tiny target's own greedy outputs. The exported drafter loads through the
/// same path as `--drafter eagle3:DIR` (8-bit serving weights included) and, in real
/// speculative decoding of its training prompts, has its chains accepted (τ > 1.4; measured
/// 1.58 here); the output equals plain greedy output. (The training log's τ, 2.1, averages a
/// chain from every position, and easy repetitive stretches hold many positions but few
/// verify steps.)
#[test]
fn a_small_run_trains_a_drafter_whose_chains_are_accepted() {
    let target = load("fitted");
    let data = examples(&target, 64, 12, 40, 1);
    let out = tempfile::tempdir().unwrap();
    let s = Eagle3TrainSettings { batch: 16, val_examples: 0, ..settings(150) };
    let report = run(&target, &data, s, out.path(), false, None).unwrap();
    assert_eq!(report.steps, 150);
    let last = report.last.unwrap();
    eprintln!("last training metrics: {:?}", last.train);
    let dir = out.path().join("drafter");
    let (mut accepted, mut steps) = (0usize, 0usize);
    for e in &data {
        let prompt = &e.tokens[..12];
        let plain = greedy_run(&target.model, prompt, 40, None, 0).tokens;
        assert_eq!(plain, e.tokens[12..]);
        let mut p = eagle3::build_proposer(&dir, &Eagle3Settings::default(), &target.model).unwrap();
        let spec = greedy_run(&target.model, prompt, 40, Some(&mut p), 4);
        accepted += spec.metrics.accepted as usize;
        steps += spec.metrics.steps as usize;
    }
    let tau = 1.0 + accepted as f64 / steps as f64;
    eprintln!("measured τ {tau:.2} over {steps} verify steps");
    assert!(tau > 1.4, "measured τ {tau}");
}

/// Stopping after k steps and resuming gives exactly the weights of the uninterrupted run.
#[test]
fn resume_continues_exactly() {
    let target = load("random");
    let data = examples(&target, 12, 8, 16, 5);
    let s = Eagle3TrainSettings { checkpoint_every: 3, ..settings(7) };
    let whole = tempfile::tempdir().unwrap();
    run(&target, &data, s.clone(), whole.path(), false, None).unwrap();
    let parts = tempfile::tempdir().unwrap();
    assert_eq!(run(&target, &data, s.clone(), parts.path(), false, Some(3)).unwrap().steps, 3);
    assert_eq!(run(&target, &data, s, parts.path(), true, None).unwrap().steps, 7);
    let state =
        |dir: &Path| candle_core::safetensors::load(dir.join("checkpoint/state.safetensors"), &Device::Cpu).unwrap();
    let (a, b) = (state(whole.path()), state(parts.path()));
    assert_eq!(a.len(), b.len());
    for (name, t) in &a {
        let diff = (t - &b[name]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0, "{name} differs after resuming");
    }
}

/// `--init-from`: a run starts from an exported drafter, keeping its shape (a narrower MLP, a
/// reduced vocabulary) and its weights; at a vanishing learning rate they come out unchanged.
#[test]
fn a_run_starts_from_an_exported_drafter() {
    let target = load("random");
    let data = examples(&target, 8, 8, 16, 9);
    let first = tempfile::tempdir().unwrap();
    let s = Eagle3TrainSettings { draft_vocab: Some(50), ffn: Some(24), val_examples: 0, ..settings(3) };
    run(&target, &data, s, first.path(), false, None).unwrap();
    let second = tempfile::tempdir().unwrap();
    let s = Eagle3TrainSettings {
        init_from: Some(first.path().join("drafter")),
        keep_draft_vocab: true,
        adam: AdamWSettings { lr: 1e-12, weight_decay: 0.0, ..Default::default() },
        val_examples: 0,
        ..settings(1)
    };
    run(&target, &data, s.clone(), second.path(), false, None).unwrap();
    let (a, b) = (
        Eagle3Drafter::load(&first.path().join("drafter"), &Device::Cpu).unwrap(),
        Eagle3Drafter::load(&second.path().join("drafter"), &Device::Cpu).unwrap(),
    );
    assert_eq!(b.config, a.config);
    assert_eq!(b.draft_vocab(), a.draft_vocab());
    let (_, _, pa) = te::load_params(&first.path().join("drafter"), &Device::Cpu).unwrap();
    let (_, _, pb) = te::load_params(&second.path().join("drafter"), &Device::Cpu).unwrap();
    assert_eq!(pa.len(), pb.len());
    for ((name, x), (other, y)) in pa.iter().zip(&pb) {
        assert_eq!(name, other);
        let diff =
            (x.as_tensor() - y.as_tensor()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff <= 1e-6, "{name} moved by {diff}");
    }
    // A new vocabulary re-picked from the data: the LM-head rows of tokens both hold carry
    // over, new tokens start as the target's LM-head rows; every other weight is unchanged.
    let fourth = tempfile::tempdir().unwrap();
    let s4 = Eagle3TrainSettings { keep_draft_vocab: false, draft_vocab: Some(70), ..s.clone() };
    run(&target, &data, s4, fourth.path(), false, None).unwrap();
    let (_, va, pa) = te::load_params(&first.path().join("drafter"), &Device::Cpu).unwrap();
    let (c4, vd, pd) = te::load_params(&fourth.path().join("drafter"), &Device::Cpu).unwrap();
    assert_eq!((vd.len(), c4.draft_vocab), (70, 70));
    let head_rows = |p: &[(String, candle_core::Var)]| {
        p.iter().find(|(n, _)| n == "lm_head.weight").unwrap().1.as_tensor().to_vec2::<f32>().unwrap()
    };
    let (old_rows, new_rows) = (head_rows(&pa), head_rows(&pd));
    let target_head = target.model.lm_head_weights().unwrap().dequantize(&Device::Cpu).unwrap();
    let mut carried = 0;
    for (i, t) in vd.iter().enumerate() {
        let want = match va.iter().position(|x| x == t) {
            Some(r) => {
                carried += 1;
                old_rows[r].clone()
            }
            None => target_head.get(*t as usize).unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
        };
        let worst = want.iter().zip(&new_rows[i]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-6, "row of token {t} off by {worst}");
    }
    assert!(carried > 0 && carried < 70, "{carried} rows carried over");
    for ((name, x), (_, y)) in pa.iter().zip(&pd).filter(|((n, _), _)| n != "lm_head.weight") {
        let diff =
            (x.as_tensor() - y.as_tensor()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff <= 1e-6, "{name} moved by {diff}");
    }
    // Other taps than the drafter fuses are refused, not silently retrained on.
    let third = tempfile::tempdir().unwrap();
    let bad = Eagle3TrainSettings { taps: Some(vec![1, 2, 3]), ..s };
    let err = run(&target, &data, bad, third.path(), false, None).unwrap_err();
    assert!(err.to_string().contains("fuses layers"), "{err:#}");
}

/// The exported directory (published layout, `d2t` and `t2d` included) loads with the exact
/// loader and scores like the trained weights.
#[test]
fn export_loads_and_scores_like_the_trained_weights() {
    let target = load("random");
    let data = examples(&target, 8, 8, 16, 7);
    let out = tempfile::tempdir().unwrap();
    // A narrower MLP than the target's (`--ffn`) exports and loads like any other shape.
    let s = Eagle3TrainSettings { draft_vocab: Some(50), ffn: Some(24), val_examples: 0, ..settings(3) };
    assert_ne!(target.model.config.ffn, 24);
    run(&target, &data, s.clone(), out.path(), false, None).unwrap();
    let loaded = Eagle3Drafter::load(&out.path().join("drafter"), &Device::Cpu).unwrap();
    assert_eq!(loaded.config.ffn, 24);
    assert_eq!(loaded.config.draft_vocab, loaded.draft_vocab().len());
    assert!(loaded.draft_vocab().len() <= 50);
    let meta: CheckpointMeta<Eagle3TrainSettings> =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("checkpoint/state.json")).unwrap()).unwrap();
    let draft_vocab = meta.draft_vocab.clone().unwrap();
    assert_eq!(loaded.draft_vocab(), draft_vocab.as_slice());
    let tensors =
        candle_core::safetensors::load(out.path().join("checkpoint/state.safetensors"), &Device::Cpu).unwrap();
    let trained = Eagle3Drafter::from_tensors(
        loaded.config.clone(),
        draft_vocab,
        |name, _| Ok(tensors[name].clone()),
        &Device::Cpu,
    )
    .unwrap();
    let head = specula::speculative::dflash::TargetHead::of(&target.model);
    let taps = target_features(&target.model, &[0, 1, 2], &data[0].tokens, KvDtype::F32).unwrap();
    let n = data[0].tokens.len() - 1;
    let score = |d: &Eagle3Drafter| {
        let f = d.fuse(&taps.narrow(0, 0, n).unwrap()).unwrap();
        let e = d.embed(&data[0].tokens[1..], Some(&head)).unwrap();
        let positions: Vec<usize> = (0..n).collect();
        let (h, _) = d.forward(&e, &f, &positions, &d.empty_kv().unwrap(), None).unwrap();
        d.logits(&h).unwrap()
    };
    let diff =
        (score(&loaded) - score(&trained)).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(diff < 1e-4, "exported and trained logits differ by {diff}");
}

/// Training and drafting are the same computation: from every anchor of a sequence, the
/// proposer's chain (target states handed over as the engine does) is right for exactly as
/// many leading tokens as the training objective counts for that row.
#[test]
fn the_objective_counts_what_the_proposer_drafts() {
    let target = load("fitted");
    let data = examples(&target, 16, 12, 24, 1);
    let out = tempfile::tempdir().unwrap();
    let s = Eagle3TrainSettings { val_examples: 0, ..settings(40) };
    run(&target, &data, s.clone(), out.path(), false, None).unwrap();
    let drafter = std::sync::Arc::new(Eagle3Drafter::load(&out.path().join("drafter"), &Device::Cpu).unwrap());
    let frozen = te::frozen_target(&target.model, drafter.draft_vocab()).unwrap();
    let mut total = 0;
    for e in data.iter().take(3) {
        let f = target_features(&target.model, &s.feature_layers(&target.model), &e.tokens, KvDtype::F32).unwrap();
        let input = SequenceInput { tokens: &e.tokens, loss_mask: &e.loss_mask, features: &f };
        let trained = sequence_loss(&drafter, &frozen, &input, &[1.0; 4]).unwrap().accepted;
        // Rows scored at step 0 start at t = 10 (their first label is token 12, the first
        // response token); a chain from row t is a draft after the target committed t + 1 tokens.
        let mut served = Vec::new();
        for end in 11..e.tokens.len() - 1 {
            let head = specula::speculative::dflash::TargetHead::of(&target.model);
            let mut p =
                eagle3::Eagle3Proposer::new(drafter.clone(), head, vec![0, 1, 2], Eagle3Settings::default()).unwrap();
            p.begin(&e.tokens[..12]).unwrap();
            let taps: Vec<Tensor> = (0..3)
                .map(|i| f.narrow(1, i * 64, 64).unwrap().narrow(0, 0, end).unwrap().contiguous().unwrap())
                .collect();
            p.observe(&e.tokens[..end + 1], 0..end, &taps).unwrap();
            let draft = p.propose(&e.tokens[..end + 1], 4).unwrap().tokens;
            served.push(draft.iter().zip(&e.tokens[end + 1..]).take_while(|(a, b)| a == b).count());
        }
        assert_eq!(trained, served, "training and drafting disagree on {}", e.key);
        total += served.iter().sum::<usize>();
    }
    assert!(total > 0, "the drafter never got a token right; the comparison would be empty");
}

/// The soft targets are the target's own next-token distribution: its last layer's feature
/// through the LM head equals an ordinary forward's logits on every row (the feature is already
/// through the final norm; normalising it again would train against another distribution).
#[test]
fn soft_targets_are_the_targets_own_distribution() {
    let target = load("random");
    let s = settings(1);
    let data = examples(&target, 1, 6, 10, 3);
    let tokens = &data[0].tokens;
    let vocab: Vec<u32> = (0..256).collect();
    let frozen = te::frozen_target(&target.model, &vocab).unwrap();
    let f = target_features(&target.model, &s.feature_layers(&target.model), tokens, KvDtype::F32).unwrap();
    let th = target.model.config.hidden;
    let ours = specula::train::eagle3::objective::target_distribution(&frozen, &f.narrow(1, 3 * th, th).unwrap())
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let logits = common::logits_of_every_row(&target.model, tokens);
    let theirs = candle_nn::ops::softmax(&logits, 1).unwrap().to_vec2::<f32>().unwrap();
    let diff = ours.iter().flatten().zip(theirs.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(diff < 1e-5, "soft targets differ from the target's distribution by {diff}");
}

/// Writes `tests/fixtures/eagle3-export/`: a drafter exported by the trainer (f16, published
/// layout) and the inputs `tools/eagle3_reference/check_export.py` runs it on with SpecForge.
#[test]
#[ignore]
fn write_export_fixture() {
    let target = load("random");
    let data = examples(&target, 12, 8, 16, 13);
    let out = tempfile::tempdir().unwrap();
    let s = Eagle3TrainSettings { draft_vocab: Some(60), val_examples: 0, ..settings(20) };
    let layer_ids = s.feature_layers(&target.model);
    let run = Eagle3Run {
        target: &target.model,
        train: data.clone(),
        val: Vec::new(),
        settings: s,
        out: out.path().to_path_buf(),
        resume: false,
        stop_after: None,
        export_dtype: DType::F16,
        log_every: 50,
        data: vec!["tiny".into()],
        feature_secs: 0.0,
    };
    run.run(&mut Features::Online { target: &target.model, layer_ids }, &mut ()).unwrap();
    let dir = fixture("eagle3-export");
    std::fs::create_dir_all(dir.join("drafter")).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(out.path().join("drafter").join(f), dir.join("drafter").join(f)).unwrap();
    }
    let tokens = &data[0].tokens;
    let taps = target_features(&target.model, &[0, 1, 2], tokens, KvDtype::F32).unwrap();
    let inputs = serde_json::json!({ "tokens": tokens, "taps": taps.to_vec2::<f32>().unwrap() });
    std::fs::write(dir.join("inputs.json"), inputs.to_string()).unwrap();
}

/// The trainer's export loads in SpecForge's own `LlamaForCausalLMEagle3` (strictly: every
/// name, shape and type, `d2t` and `t2d` included; the embedding is the target's), and
/// SpecForge computes the logits we compute: every row of a first pass and a 3-token chain
/// (`tests/fixtures/eagle3-export/expected.json`, written by `check_export.py`).
#[test]
fn export_loads_in_specforge() {
    let target = load("random");
    let dir = fixture("eagle3-export");
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join(f)).unwrap()).unwrap()
    };
    let (inputs, expected) = (read("inputs.json"), read("expected.json"));
    let tokens: Vec<u32> = inputs["tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let rows: Vec<Vec<f32>> = serde_json::from_value(inputs["taps"].clone()).unwrap();
    let drafter = Eagle3Drafter::load(&dir.join("drafter"), &Device::Cpu).unwrap();
    let head = specula::speculative::dflash::TargetHead::of(&target.model);
    let n = tokens.len() - 1;
    let taps = Tensor::from_vec(rows[..n].concat(), (n, rows[0].len()), &Device::Cpu).unwrap();
    let features = drafter.fuse(&taps).unwrap();
    let embeds = drafter.embed(&tokens[1..], Some(&head)).unwrap();
    let positions: Vec<usize> = (0..n).collect();
    let (out, kv) = drafter.forward(&embeds, &features, &positions, &drafter.empty_kv().unwrap(), None).unwrap();
    let theirs: Vec<Vec<f32>> = serde_json::from_value(expected["first_pass_logits"].clone()).unwrap();
    let ours = drafter.logits(&out).unwrap().to_vec2::<f32>().unwrap();
    let worst = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0f32, f32::max)
    };
    assert_eq!(ours.len(), theirs.len());
    let d = worst(&ours, &theirs);
    assert!(d <= 1e-4, "first pass: max |Δ logit| {d} against SpecForge");
    let (mut h, mut past) = (out.narrow(0, n - 1, 1).unwrap(), kv);
    let chain: Vec<Vec<f32>> = serde_json::from_value(expected["chain_logits"].clone()).unwrap();
    let drafted: Vec<u32> = serde_json::from_value(expected["drafted"].clone()).unwrap();
    for (step, theirs) in chain.iter().enumerate() {
        let logits = drafter.logits(&h).unwrap();
        let d = worst(&logits.to_vec2::<f32>().unwrap(), std::slice::from_ref(theirs));
        assert!(d <= 1e-4, "chain step {step}: max |Δ logit| {d} against SpecForge");
        let token = drafter.target_token(logits.flatten_all().unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap());
        assert_eq!(token, drafted[step], "chain step {step}");
        let (next, kv) =
            drafter.forward(&drafter.embed(&[token], Some(&head)).unwrap(), &h, &[n + step], &past, None).unwrap();
        past = specula::speculative::nn::LayerKv {
            k: Tensor::cat(&[&past.k, &kv.k], 1).unwrap(),
            v: Tensor::cat(&[&past.v, &kv.v], 1).unwrap(),
        };
        h = next;
    }
}
