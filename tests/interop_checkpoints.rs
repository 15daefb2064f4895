//! Drafters trained by the GPU frameworks load with `--drafter dflash:DIR` / `eagle3:DIR` and
//! compute what the frameworks compute.
//!
//! Fixtures: `tests/fixtures/interop/<case>/` (written by `tools/interop/`, see its README): a
//! drafter directory saved by speculators 0.9.0 (package-initialised, or trained by its own
//! trainer on data `specula train export` wrote) or exported by SpecForge 0.2.0, and
//! `fixture.json` with the package's own forward on fixed tokens and fixed target hidden states
//! (`taps`). The target is the tiny Qwen3 of `tests/fixtures/dflash/random/target`: only its
//! embedding and LM head are used by the fixtures.
//!
//! - Parity: each drafter, loaded by the loaders `--drafter` uses (exact f32, before the
//!   serving-time 8-bit conversion), gives the package's logits within 1e-4 (the packages
//!   computed in f32 on CPU and agree with independent forwards to ~2e-6; logits are O(1)) and
//!   the same argmax (smallest top-1/top-2 gap in the fixtures: 0.005). DFlash through the
//!   proposer's cached-context path; EAGLE-3 through the pass the proposer runs (first pass and
//!   chained steps) and the proposer itself for the first draft token of every prefix.
//! - Windows: speculators' sliding-window layers measure the window as speculators trains them
//!   (DFlash: from the block's anchor; EAGLE-3: from the row a chain starts at).
//! - Lossless: greedy speculative decoding with each drafter, built through `DrafterSpec` as
//!   the CLI builds it, gives plain greedy output.

use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use specula::engine::{generate, GenerateOptions, LoadedModel};
use specula::kv::KvDtype;
use specula::model::{Transformer, WeightFormat};
use specula::sample::SamplingParams;
use specula::speculative::dflash::{self, DflashLayout, DflashProposer, DflashSettings, TargetHead};
use specula::speculative::eagle3::{Eagle3Config, Eagle3Drafter, Eagle3Proposer, Eagle3Settings};
use specula::speculative::nn::LayerKv;
use specula::speculative::{build_proposer, Caller, DrafterSpec, Proposer, Target};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const LOGIT_TOLERANCE: f32 = 1e-4;

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(path)
}

fn tiny_target() -> LoadedModel {
    LoadedModel::load(&fixture("dflash/random/target"), Some(WeightFormat::F32), &Device::Cpu).unwrap()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn matrix(v: &Value) -> Vec<Vec<f32>> {
    serde_json::from_value(v.clone()).unwrap()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0f32, f32::max)
}

fn argmax(row: &[f32]) -> u32 {
    specula::sample::argmax(row)
}

/// Rows `r` of the fixture's taps, split into one `[rows, hidden]` tensor per tapped layer.
fn split_taps(taps: &[Vec<f32>], r: std::ops::Range<usize>, n_taps: usize) -> Vec<Tensor> {
    let width = taps[0].len() / n_taps;
    (0..n_taps)
        .map(|i| {
            let rows: Vec<f32> = taps[r.clone()].iter().flat_map(|t| t[i * width..(i + 1) * width].to_vec()).collect();
            Tensor::from_vec(rows, (r.len(), width), &Device::Cpu).unwrap()
        })
        .collect()
}

/// The proposer's draft logits `[B − 1, vocab]` for the block anchored at `p` with context rows
/// `ctx` (taps of those rows handed over as the engine hands them). Context that starts after
/// row 0 is what the engine hands over after a prefix restored from its cache; a context window
/// (wider than any context here) keeps the drafter's own store of prompt rows out of it.
fn dflash_block_logits(
    drafter: &Arc<dflash::DflashDrafter>,
    target: &Transformer,
    tokens: &[u32],
    taps: &[Vec<f32>],
    p: usize,
    ctx: std::ops::Range<usize>,
) -> Vec<Vec<f32>> {
    let settings = match ctx.start {
        0 => DflashSettings::default(),
        _ => DflashSettings { context_window: Some(1 << 20), ..Default::default() },
    };
    let mut prop = DflashProposer::new(drafter.clone(), TargetHead::of(target), settings).unwrap();
    prop.begin(&tokens[..p]).unwrap();
    let n = drafter.config.target_layer_ids.len();
    prop.observe(&tokens[..=p], ctx.clone(), &split_taps(taps, ctx, n)).unwrap();
    prop.draft_logits(&tokens[..=p], drafter.config.block_size - 1).unwrap().to_vec2::<f32>().unwrap()
}

/// A DFlash fixture: every anchor's block rows 1..B−1 (the drafted ones) against the package's,
/// and the drafted target ids. Returns the largest logit difference.
fn check_dflash_case(case: &str, target: &LoadedModel) -> f32 {
    let dir = fixture(&format!("interop/{case}"));
    let f = read_json(&dir.join("fixture.json"));
    let drafter = Arc::new(dflash::load_for_target(&dir.join("drafter"), &target.model, &Device::Cpu).unwrap());
    let (tokens, taps) = (ids(&f["tokens"]), matrix(&f["taps"]));
    let b = f["block_size"].as_u64().unwrap() as usize;
    assert_eq!(drafter.config.block_size, b);
    let mut worst = 0f32;
    for (a, p) in ids(&f["anchors"]).into_iter().enumerate() {
        let p = p as usize;
        let ours = dflash_block_logits(&drafter, &target.model, &tokens, &taps, p, 0..p);
        let theirs = matrix(&f["block_logits"][a]);
        worst = worst.max(max_diff(&ours, &theirs[1..]));
        let drafted: Vec<u32> = ours.iter().map(|r| drafter.target_token(argmax(r))).collect();
        let expected = match f.get("drafted_target_ids") {
            Some(v) => ids(&v[a]),
            None => ids(&f["draft_argmax"][a]),
        };
        assert_eq!(drafted, expected[1..], "{case}: anchor {p}: drafted tokens");
    }
    eprintln!("{case}: max |Δ logit| {worst:.3e} over {} blocks", f["anchors"].as_array().unwrap().len());
    assert!(worst <= LOGIT_TOLERANCE, "{case}: max |Δ logit| {worst} against the package");
    worst
}

/// speculators' DFlash layout: shape in `transformer_layer_config`, taps in Hugging Face
/// numbering, a reduced vocabulary with `d2t` offsets, a sliding layer causal inside the block.
#[test]
fn speculators_dflash_computes_what_speculators_computes() {
    let target = tiny_target();
    let dir = fixture("interop/speculators-dflash/drafter");
    let drafter = dflash::load_for_target(&dir, &target.model, &Device::Cpu).unwrap();
    let c = &drafter.config;
    assert_eq!(c.layout, DflashLayout::Speculators);
    assert_eq!((c.hidden, c.n_layers, c.block_size, c.mask_token_id), (64, 2, 4, 255));
    assert_eq!(c.target_layer_ids, vec![0, 2], "aux_hidden_state_layer_ids [1, 3] are HF hidden_states indices");
    assert!(c.layer_attention[0].causal && c.layer_attention[0].window == Some(2048));
    assert!(c.layer_attention[0].window_from_anchor);
    assert!(c.layer_attention[1].is_full());
    assert_eq!(c.draft_vocab_size, Some(128));
    // speculators' lm_head is frozen to the target's head rows of its vocabulary: the drafter
    // scores with those rows of the target's own head.
    let vocab: Vec<u32> = drafter.draft_vocab().unwrap().to_vec();
    // (`load` would refuse the file: `t2d` is a bool tensor; the loader reads past it.)
    let stored = unsafe { candle_core::safetensors::MmapedSafetensors::new(dir.join("model.safetensors")) }.unwrap();
    let stored_head = stored.load("lm_head.weight", &Device::Cpu).unwrap();
    let target_head = candle_core::safetensors::load(fixture("dflash/random/target/model.safetensors"), &Device::Cpu)
        .unwrap()
        .remove("lm_head.weight")
        .unwrap();
    let rows = target_head.index_select(&Tensor::new(vocab.as_slice(), &Device::Cpu).unwrap(), 0).unwrap();
    let d = (stored_head.to_dtype(DType::F32).unwrap() - rows).unwrap().abs().unwrap();
    assert_eq!(d.max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "lm_head = the target's rows d2t");
    check_dflash_case("speculators-dflash", &target);
    // The fixture tells a causal sliding layer from a bidirectional one
    // (`sliding_window_non_causal`): the latter does not reproduce it.
    let f = read_json(&fixture("interop/speculators-dflash/fixture.json"));
    let dir = rewritten("speculators-dflash", |_| {}, |c| c["sliding_window_non_causal"] = true.into());
    let bidirectional = Arc::new(dflash::load_for_target(dir.path(), &target.model, &Device::Cpu).unwrap());
    assert!(!bidirectional.config.layer_attention[0].causal);
    let (tokens, taps) = (ids(&f["tokens"]), matrix(&f["taps"]));
    let ours = dflash_block_logits(&bidirectional, &target.model, &tokens, &taps, 5, 0..5);
    assert!(max_diff(&ours, &matrix(&f["block_logits"][0])[1..]) > 1e-3);
}

/// SpecForge 0.2.0's DFlash export: the z-lab layout with a top-level `draft_vocab_size`
/// equal to the vocabulary (no reduction, no `d2t`).
#[test]
fn specforge_dflash_computes_what_specforge_computes() {
    let target = tiny_target();
    let drafter =
        dflash::load_for_target(&fixture("interop/specforge-dflash/drafter"), &target.model, &Device::Cpu).unwrap();
    assert_eq!(drafter.config.layout, DflashLayout::ZLab);
    assert_eq!(drafter.config.draft_vocab_size, None);
    assert!(drafter.draft_vocab().is_none());
    assert_eq!(drafter.config.target_layer_ids, vec![0, 2]);
    check_dflash_case("specforge-dflash", &target);
}

/// A speculators EAGLE-3 fixture: step 0 (one causal pass over every row) and steps 1..3 (each
/// row chained on its own output with the fixture's next tokens, as the proposer chains) against
/// the package's `step_logits`; and the proposer's first draft token after every prefix.
fn check_eagle3_case(case: &str, target: &LoadedModel) -> f32 {
    let dir = fixture(&format!("interop/{case}"));
    let f = read_json(&dir.join("fixture.json"));
    let config = Eagle3Config::from_file(&dir.join("drafter/config.json")).unwrap();
    config.check_target(&target.model.config).unwrap();
    let drafter = Eagle3Drafter::load(&dir.join("drafter"), &Device::Cpu).unwrap();
    assert!(drafter.has_embedding(), "speculators saves embed_tokens");
    let head = TargetHead::of(&target.model);
    let (tokens, taps) = (ids(&f["tokens"]), matrix(&f["taps"]));
    let t_len = tokens.len();
    let steps = matrix(&f["step_logits"][0]).len();
    assert_eq!(steps, t_len);
    let step_logits: Vec<Vec<Vec<f32>>> = serde_json::from_value(f["step_logits"].clone()).unwrap();
    let expected_ids: Vec<Vec<u32>> = serde_json::from_value(f["drafted_target_ids"].clone()).unwrap();

    let rows = Tensor::from_vec(taps.concat(), (t_len, taps[0].len()), &Device::Cpu).unwrap();
    let features = drafter.fuse(&rows).unwrap();
    let embeds = drafter.embed(&tokens, Some(&head)).unwrap();
    let positions: Vec<usize> = (0..t_len).collect();
    let (out0, kv0) = drafter.forward(&embeds, &features, &positions, &drafter.empty_kv().unwrap(), None).unwrap();
    let logits0 = drafter.logits(&out0).unwrap().to_vec2::<f32>().unwrap();
    let mut worst = max_diff(&logits0, &step_logits[0]);
    for (t, row) in logits0.iter().enumerate() {
        assert_eq!(drafter.target_token(argmax(row)), expected_ids[0][t], "{case}: step 0 row {t}");
    }
    for t in 0..t_len {
        let mut past = LayerKv { k: kv0.k.narrow(1, 0, t + 1).unwrap(), v: kv0.v.narrow(1, 0, t + 1).unwrap() };
        let mut h = out0.narrow(0, t, 1).unwrap();
        for (s, step) in step_logits.iter().enumerate().skip(1) {
            let token = tokens.get(t + s).copied().unwrap_or(0);
            let e = drafter.embed(&[token], Some(&head)).unwrap();
            let (next, kv) = drafter.forward(&e, &h, &[t + s], &past, None).unwrap();
            let logits = drafter.logits(&next).unwrap().to_vec2::<f32>().unwrap();
            worst = worst.max(max_diff(&logits, std::slice::from_ref(&step[t])));
            assert_eq!(drafter.target_token(argmax(&logits[0])), expected_ids[s][t], "{case}: step {s} row {t}");
            past = LayerKv {
                k: Tensor::cat(&[&past.k, &kv.k], 1).unwrap(),
                v: Tensor::cat(&[&past.v, &kv.v], 1).unwrap(),
            };
            h = next;
        }
    }
    // The proposer: fixture row r pairs tokens[r] with taps[r], as the proposer's row r pairs
    // committed token r + 1 with the target's states at r. After rows 0..=t its first draft is
    // step 0's argmax at row t.
    let drafter = Arc::new(drafter);
    let tap_layers = drafter.config.tap_layers(target.model.config.n_layers);
    for t in 0..t_len {
        let mut committed = vec![0u32];
        committed.extend_from_slice(&tokens[..=t]);
        let mut p =
            Eagle3Proposer::new(drafter.clone(), head.clone(), tap_layers.clone(), Eagle3Settings::default()).unwrap();
        p.begin(&committed).unwrap();
        p.observe(&committed, 0..t + 1, &split_taps(&taps, 0..t + 1, 3)).unwrap();
        let draft = p.propose(&committed, 3).unwrap();
        assert_eq!(draft.tokens.len(), 3);
        assert_eq!(draft.tokens[0], expected_ids[0][t], "{case}: the proposer's first draft after row {t}");
    }
    eprintln!("{case}: max |Δ logit| {worst:.3e} over {} steps × {t_len} rows", step_logits.len());
    assert!(worst <= LOGIT_TOLERANCE, "{case}: max |Δ logit| {worst} against speculators");
    worst
}

/// `speculators train`'s defaults: `norm_before_residual`, `norm_before_fc` (`input_norm`),
/// `norm_output`, a sliding-window layer.
#[test]
fn speculators_eagle3_computes_what_speculators_computes() {
    let target = tiny_target();
    let c = Eagle3Config::from_file(&fixture("interop/speculators-eagle3/drafter/config.json")).unwrap();
    assert!(c.norm_before_residual && c.norm_before_fc && c.norm_output && !c.fc_norm);
    assert_eq!(c.window, Some(2048));
    assert_eq!(c.aux_layer_ids, Some(vec![0, 1, 2]), "eagle_aux_hidden_state_layer_ids [1, 2, 3] are HF indices");
    assert_eq!((c.vocab, c.draft_vocab, c.rope_theta), (256, 128, 10_000.0));
    check_eagle3_case("speculators-eagle3", &target);
}

/// The same layout with the three options off and full attention.
#[test]
fn speculators_eagle3_plain_computes_what_speculators_computes() {
    let target = tiny_target();
    let c = Eagle3Config::from_file(&fixture("interop/speculators-eagle3-plain/drafter/config.json")).unwrap();
    assert!(!c.norm_before_residual && !c.norm_before_fc && !c.norm_output && c.window.is_none());
    check_eagle3_case("speculators-eagle3-plain", &target);
}

/// Both directions with the packages' own training: `specula train data` had the tiny target
/// answer prompts, `specula train export` wrote them, and `speculators train` trained a DFlash
/// drafter (its default: the whole vocabulary, scored with the target's head; no `d2t`, no
/// `lm_head.weight`) and an EAGLE-3 drafter (draft vocabulary 128) on them for 8 steps, saving
/// bfloat16 checkpoints (tools/interop/make_trained_fixtures.sh). specula loads what it wrote
/// and computes what the package computes on it.
#[test]
fn drafters_speculators_trained_on_exported_data_compute_what_speculators_computes() {
    let target = tiny_target();
    let f = read_json(&fixture("interop/speculators-dflash-trained/fixture.json"));
    assert_eq!(f["training"]["training_state"]["global_step"], 8);
    assert_eq!(f["training"]["checkpoint_dtype"], serde_json::json!(["torch.bfloat16"]));
    let drafter =
        dflash::load_for_target(&fixture("interop/speculators-dflash-trained/drafter"), &target.model, &Device::Cpu)
            .unwrap();
    assert_eq!(drafter.config.layout, DflashLayout::Speculators);
    assert_eq!(drafter.config.target_layer_ids, vec![0, 2]);
    assert!(drafter.draft_vocab().is_none(), "the whole vocabulary: no d2t");
    check_dflash_case("speculators-dflash-trained", &target);
    let c = Eagle3Config::from_file(&fixture("interop/speculators-eagle3-trained/drafter/config.json")).unwrap();
    assert!(c.norm_before_residual && c.norm_before_fc && c.norm_output);
    assert_eq!((c.vocab, c.draft_vocab), (256, 128));
    check_eagle3_case("speculators-eagle3-trained", &target);
}

/// A copy of fixture drafter `case` whose `transformer_layer_config` is edited by `edit`.
fn edited_drafter(case: &str, edit: impl Fn(&mut Value)) -> tempfile::TempDir {
    let src = fixture(&format!("interop/{case}/drafter"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
    let mut c = read_json(&src.join("config.json"));
    edit(&mut c["transformer_layer_config"]);
    std::fs::write(dir.path().join("config.json"), serde_json::to_string_pretty(&c).unwrap()).unwrap();
    dir
}

/// speculators trains a DFlash sliding layer to see the context rows P − W ..< P of the block
/// anchored at P, whatever the block row: with every layer sliding and W = 3, a block against
/// the whole context equals the same drafter (W large) against rows P − 3 ..< P only, for
/// every block row. (The per-query rule would hide rows P − 3 + k from block row k.)
#[test]
fn speculators_dflash_windows_are_measured_from_the_anchor() {
    let target = tiny_target();
    let f = read_json(&fixture("interop/speculators-dflash/fixture.json"));
    let (tokens, taps) = (ids(&f["tokens"]), matrix(&f["taps"]));
    let with_window = |w: usize| {
        let dir = edited_drafter("speculators-dflash", |l| {
            l["layer_types"] = serde_json::json!(["sliding_attention", "sliding_attention"]);
            l["sliding_window"] = w.into();
        });
        Arc::new(dflash::load_for_target(dir.path(), &target.model, &Device::Cpu).unwrap())
    };
    let (narrow, wide) = (with_window(3), with_window(2048));
    let mut worst = 0f32;
    for p in [5, 11, 17, 20] {
        let windowed = dflash_block_logits(&narrow, &target.model, &tokens, &taps, p, 0..p);
        let last_rows = dflash_block_logits(&wide, &target.model, &tokens, &taps, p, p - 3..p);
        worst = worst.max(max_diff(&windowed, &last_rows));
        let everything = dflash_block_logits(&wide, &target.model, &tokens, &taps, p, 0..p);
        assert!(max_diff(&windowed, &everything) > 1e-3, "the window must hide something at anchor {p}");
    }
    eprintln!("anchored DFlash window: max |Δ logit| {worst:.3e}");
    assert!(worst <= 1e-5, "windowed context ≠ the last W rows: {worst}");
}

/// An EAGLE-3 sliding layer as speculators trains it: committed row r sees rows r − W + 1..=r,
/// and a draft chain from row e − 1 sees rows e − W ..< e and its own rows. So with W = 3 the
/// proposer that saw every row (in two chunks) drafts what the same drafter (W large) drafts
/// having seen only rows e − 3 ..< e.
#[test]
fn speculators_eagle3_windows_follow_training() {
    let target = tiny_target();
    let f = read_json(&fixture("interop/speculators-eagle3/fixture.json"));
    let (tokens, taps) = (ids(&f["tokens"]), matrix(&f["taps"]));
    let head = TargetHead::of(&target.model);
    let with_window = |w: usize| {
        let dir = edited_drafter("speculators-eagle3", |l| l["sliding_window"] = w.into());
        Arc::new(Eagle3Drafter::load(dir.path(), &Device::Cpu).unwrap())
    };
    let (narrow, wide) = (with_window(3), with_window(2048));
    let taps_of = |d: &Arc<Eagle3Drafter>| d.config.tap_layers(target.model.config.n_layers);
    let mut committed = vec![0u32];
    committed.extend_from_slice(&tokens);
    let draft = |d: &Arc<Eagle3Drafter>, e: usize, chunks: &[std::ops::Range<usize>]| -> Vec<u32> {
        let mut p = Eagle3Proposer::new(d.clone(), head.clone(), taps_of(d), Eagle3Settings::default()).unwrap();
        p.begin(&committed[..=e]).unwrap();
        for r in chunks {
            p.observe(&committed[..=r.end], r.clone(), &split_taps(&taps, r.clone(), 3)).unwrap();
            p.propose(&committed[..=r.end], 4).unwrap();
        }
        p.propose(&committed[..=e], 4).unwrap().tokens
    };
    let mut differs = 0;
    for e in 4..=tokens.len() {
        let windowed = draft(&narrow, e, &[0..2, 2..e]);
        assert_eq!(windowed, draft(&wide, e, std::slice::from_ref(&(e - 3..e))), "after {e} rows");
        differs += usize::from(windowed != draft(&wide, e, std::slice::from_ref(&(0..e))));
    }
    assert!(differs > 0, "the window never changed a draft: the test shows nothing");
}

fn greedy(target: &LoadedModel, prompt: &[u32], max_new: usize, p: Option<&mut dyn Proposer>) -> (Vec<u32>, usize) {
    let pool = target.model.new_kv_pool_typed(prompt.len() + max_new + 64, KvDtype::F32);
    let params = SamplingParams { temperature: 0.0, max_tokens: Some(max_new), ..Default::default() };
    let g = generate((&target.model).into(), &pool, prompt, params, p, &GenerateOptions::fixed_draft(4), &mut |_| {})
        .unwrap();
    (g.tokens, g.metrics.drafted as usize)
}

/// Every fixture drafter, built as `--drafter dflash:DIR` / `eagle3:DIR` builds it (8-bit
/// projections, the real target's taps), leaves greedy output unchanged; so do the speculators
/// ones with a 3-row window, which the context outgrows.
#[test]
fn greedy_decoding_with_each_drafter_is_lossless() {
    let target = tiny_target();
    let prompt: Vec<u32> = (0..12u32).map(|i| (i * 37 + 11) % 250).collect();
    let (plain, _) = greedy(&target, &prompt, 32, None);
    let windowed_dflash = edited_drafter("speculators-dflash", |l| l["sliding_window"] = 3.into());
    let windowed_eagle3 = edited_drafter("speculators-eagle3", |l| l["sliding_window"] = 3.into());
    for (kind, case, dir) in [
        ("dflash", "speculators-dflash", fixture("interop/speculators-dflash/drafter")),
        ("dflash", "specforge-dflash", fixture("interop/specforge-dflash/drafter")),
        ("eagle3", "speculators-eagle3", fixture("interop/speculators-eagle3/drafter")),
        ("eagle3", "speculators-eagle3-plain", fixture("interop/speculators-eagle3-plain/drafter")),
        ("dflash", "speculators-dflash-trained", fixture("interop/speculators-dflash-trained/drafter")),
        ("eagle3", "speculators-eagle3-trained", fixture("interop/speculators-eagle3-trained/drafter")),
        ("dflash", "speculators-dflash, window 3", windowed_dflash.path().to_path_buf()),
        ("eagle3", "speculators-eagle3, window 3", windowed_eagle3.path().to_path_buf()),
    ] {
        let arg = format!("{kind}:{}", dir.display());
        let spec = DrafterSpec::parse(&arg).unwrap();
        let t = Target { model: &target.model, tokenizer: &target.tokenizer };
        let mut p = build_proposer(&spec, t, Caller::default()).unwrap();
        let (spec_out, drafted) = greedy(&target, &prompt, 32, Some(p.as_mut()));
        eprintln!("{case}: lossless, {drafted} tokens drafted");
        assert!(drafted > 0, "{case}: nothing was drafted");
        assert_eq!(spec_out, plain, "{case}: speculative output differs from plain greedy");
    }
}

/// A copy of fixture drafter `case` with its tensors and config edited (`t2d`, a bool tensor
/// candle does not hold, is left out: no loader reads it).
fn rewritten(
    case: &str,
    tensors: impl Fn(&mut std::collections::HashMap<String, Tensor>),
    config: impl Fn(&mut Value),
) -> tempfile::TempDir {
    let src = fixture(&format!("interop/{case}/drafter"));
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(src.join("model.safetensors")) }.unwrap();
    let mut all: std::collections::HashMap<String, Tensor> = st
        .tensors()
        .into_iter()
        .filter(|(name, _)| name != "t2d")
        .map(|(name, _)| (name.clone(), st.load(&name, &Device::Cpu).unwrap()))
        .collect();
    tensors(&mut all);
    let dir = tempfile::tempdir().unwrap();
    candle_core::safetensors::save(&all, dir.path().join("model.safetensors")).unwrap();
    let mut c = read_json(&src.join("config.json"));
    config(&mut c);
    std::fs::write(dir.path().join("config.json"), serde_json::to_string(&c).unwrap()).unwrap();
    dir
}

/// Broken speculators checkpoints are refused with the tensor or field named, by the loaders
/// `--drafter` uses (no panic).
#[test]
fn broken_speculators_checkpoints_are_refused_by_name() {
    let target = tiny_target();
    let set = |name: &'static str, t: Tensor| {
        move |m: &mut std::collections::HashMap<String, Tensor>| {
            m.insert(name.to_string(), t.clone());
        }
    };
    let d2t_with = |i: usize, v: i64| {
        let mut d: Vec<i64> = vec![0; 128];
        d[i] = v;
        Tensor::from_vec(d, 128, &Device::Cpu).unwrap()
    };
    let keep = |_: &mut Value| {};
    let dflash_err = |dir: tempfile::TempDir| {
        let spec = DrafterSpec::parse(&format!("dflash:{}", dir.path().display())).unwrap();
        let t = Target { model: &target.model, tokenizer: &target.tokenizer };
        format!("{:#}", build_proposer(&spec, t, Caller::default()).err().expect("refused"))
    };
    let cases: Vec<(tempfile::TempDir, &str)> = vec![
        (rewritten("speculators-dflash", set("d2t", d2t_with(5, -100)), keep), "maps to 5 + -100"),
        (rewritten("speculators-dflash", set("d2t", d2t_with(127, 1000)), keep), "beyond the head's 256 rows"),
        (
            rewritten("speculators-dflash", set("d2t", Tensor::zeros(127, DType::I64, &Device::Cpu).unwrap()), keep),
            "d2t",
        ),
        (
            rewritten("speculators-dflash", set("d2t", Tensor::zeros(128, DType::F32, &Device::Cpu).unwrap()), keep),
            "integers",
        ),
        (
            rewritten(
                "speculators-dflash",
                set("lm_head.weight", Tensor::zeros((100, 64), DType::F32, &Device::Cpu).unwrap()),
                keep,
            ),
            "lm_head.weight",
        ),
        (rewritten("speculators-dflash", |m| drop(m.remove("d2t")), keep), "needs it"),
        (rewritten("speculators-dflash", |m| drop(m.remove("layers.1.self_attn.q_norm.weight")), keep), "q_norm"),
        (
            rewritten("speculators-dflash", |_| {}, |c| c["transformer_layer_config"]["hidden_size"] = 32.into()),
            "hidden",
        ),
    ];
    for (dir, why) in cases {
        let err = dflash_err(dir);
        assert!(err.contains(why), "{why}: {err}");
    }
    let eagle3_err = |dir: tempfile::TempDir| {
        let spec = DrafterSpec::parse(&format!("eagle3:{}", dir.path().display())).unwrap();
        let t = Target { model: &target.model, tokenizer: &target.tokenizer };
        format!("{:#}", build_proposer(&spec, t, Caller::default()).err().expect("refused"))
    };
    let cases: Vec<(tempfile::TempDir, &str)> = vec![
        (rewritten("speculators-eagle3", |m| drop(m.remove("input_norm.weight")), keep), "input_norm.weight"),
        (
            rewritten(
                "speculators-eagle3",
                set("input_norm.weight", Tensor::ones(64, DType::F32, &Device::Cpu).unwrap()),
                keep,
            ),
            "input_norm.weight",
        ),
        (rewritten("speculators-eagle3", set("d2t", d2t_with(127, 1000)), keep), "d2t"),
        (rewritten("speculators-eagle3", |m| drop(m.remove("layers.0.hidden_norm.weight")), keep), "hidden_norm"),
        (
            rewritten(
                "speculators-eagle3",
                |m| drop(m.remove("embed_tokens.weight")),
                |c| c["embed_requires_grad"] = true.into(),
            ),
            "embed_tokens",
        ),
        (rewritten("speculators-eagle3", |_| {}, |c| c["fc_norm"] = true.into()), "fc_norm.0.weight"),
        (
            rewritten("speculators-eagle3", |_| {}, |c| c["transformer_layer_config"]["vocab_size"] = 300.into()),
            "vocabulary",
        ),
    ];
    for (dir, why) in cases {
        let err = eagle3_err(dir);
        assert!(err.contains(why), "{why}: {err}");
    }
}
