//! Drafter and proposer internals: the cached path equals the stateless forward (in chunks,
//! with rollbacks, gaps and a context window), causal/windowed layers hide what they should,
//! and broken checkpoints are refused with the tensor named.

use super::*;
use crate::model::{Linear as TargetLinear, WeightFormat};
use crate::sample::SamplerRng;
use crate::speculative::Proposer;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

const HIDDEN: usize = 32;
const VOCAB: usize = 50;

fn config_json() -> Value {
    json!({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 48, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "block_size": 6, "dflash_config": {"mask_token_id": 49, "target_layer_ids": [0, 2, 3]}
    })
}

fn uniform(rng: &mut SamplerRng, n: usize, scale: f64, offset: f64) -> Vec<f32> {
    (0..n).map(|_| (offset + (rng.next_f64() * 2.0 - 1.0) * scale) as f32).collect()
}

fn random_tensor(rng: &mut SamplerRng, shape: &[usize], scale: f64, offset: f64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(uniform(rng, n, scale, offset), shape, &Device::Cpu).unwrap()
}

/// Random weights for every tensor the config needs (norm weights near 1).
fn random_weights(cfg: &DflashConfig, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = SamplerRng::from_seed(seed);
    expected_tensors(cfg)
        .into_iter()
        .map(|(name, shape)| {
            let t = if shape.len() == 1 {
                random_tensor(&mut rng, &shape, 0.2, if name.ends_with("bias") { 0.0 } else { 1.0 })
            } else {
                random_tensor(&mut rng, &shape, 1.5 / (shape[1] as f64).sqrt(), 0.0)
            };
            (name, t)
        })
        .collect()
}

fn drafter(c: &Value, seed: u64) -> Arc<DflashDrafter> {
    let cfg = DflashConfig::from_json(c).unwrap();
    let vb = VarBuilder::from_tensors(random_weights(&cfg, seed), DType::F32, &Device::Cpu);
    Arc::new(DflashDrafter::from_var_builder(cfg, vb).unwrap())
}

fn head(seed: u64) -> TargetHead {
    let mut rng = SamplerRng::from_seed(seed);
    let emb = QTensor::quantize(&random_tensor(&mut rng, &[VOCAB, HIDDEN], 1.0, 0.0), GgmlDType::F32).unwrap();
    let lm = QTensor::quantize(&random_tensor(&mut rng, &[VOCAB, HIDDEN], 0.5, 0.0), GgmlDType::F32).unwrap();
    let lm =
        TargetLinear::from_qtensor(Arc::new(lm), None, WeightFormat::F32, &Default::default(), &Device::Cpu).unwrap();
    let norm = random_tensor(&mut rng, &[HIDDEN], 0.2, 1.0);
    TargetHead::from_parts(Arc::new(emb), norm, 1e-6, 8, lm, &Device::Cpu)
}

/// Target taps for `rows` context rows, one `[rows, hidden]` tensor per tapped layer.
fn taps(rows: usize, k: usize, seed: u64) -> Vec<Tensor> {
    let mut rng = SamplerRng::from_seed(seed);
    (0..k).map(|_| random_tensor(&mut rng, &[rows, HIDDEN], 2.0, 0.0)).collect()
}

fn rows(taps: &[Tensor], r: std::ops::Range<usize>) -> Vec<Tensor> {
    taps.iter().map(|t| t.narrow(0, r.start, r.len()).unwrap()).collect()
}

/// The stateless reference: block `[anchor, MASK…]` at `start..` against context rows given
/// by `ctx_taps` at `ctx_positions`.
fn stateless_logits(
    d: &DflashDrafter,
    h: &TargetHead,
    ctx_taps: &[Tensor],
    ctx_positions: &[usize],
    anchor: u32,
    start: usize,
    masks: usize,
) -> Vec<Vec<f32>> {
    let mut ids = vec![d.config.mask_token_id; masks + 1];
    ids[0] = anchor;
    let block = h.embed(&ids).unwrap();
    let positions: Vec<usize> = (start..=start + masks).collect();
    let hidden = d.forward(ctx_taps, ctx_positions, &block, &positions, Packing::ONE_BLOCK).unwrap();
    d.logits(h, &hidden.narrow(0, 1, masks).unwrap()).unwrap().to_vec2().unwrap()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + 3) % 40).collect()
}

#[test]
fn cached_context_in_chunks_equals_the_stateless_forward() {
    let d = drafter(&config_json(), 1);
    let h = head(2);
    let all = taps(11, 3, 3);
    let mut p = DflashProposer::new(d.clone(), h.clone(), DflashSettings::default()).unwrap();
    assert_eq!(p.tap_layers(), &[0, 2, 3]);
    p.begin(&tokens(4)).unwrap();
    for r in [0..4, 4..9, 9..11] {
        p.observe(&tokens(r.end + 1), r.clone(), &rows(&all, r)).unwrap();
    }
    let toks = tokens(12);
    let cached = p.draft_logits(&toks, 5).unwrap().to_vec2::<f32>().unwrap();
    let positions: Vec<usize> = (0..11).collect();
    let reference = stateless_logits(&d, &h, &all, &positions, toks[11], 11, 5);
    assert!(max_diff(&cached, &reference) < 1e-5, "{}", max_diff(&cached, &reference));

    // Drafting leaves no trace: the same draft again, and the next round after more commits.
    assert_eq!(p.draft_logits(&toks, 5).unwrap().to_vec2::<f32>().unwrap(), cached);
    let more = taps(3, 3, 4);
    p.observe(&tokens(15), 11..14, &more).unwrap();
    let all2: Vec<Tensor> = all.iter().zip(&more).map(|(a, b)| Tensor::cat(&[a, b], 0).unwrap()).collect();
    let toks = tokens(15);
    let cached = p.draft_logits(&toks, 5).unwrap().to_vec2::<f32>().unwrap();
    let positions: Vec<usize> = (0..14).collect();
    let reference = stateless_logits(&d, &h, &all2, &positions, toks[14], 14, 5);
    assert!(max_diff(&cached, &reference) < 1e-5);
}

#[test]
fn a_smaller_block_is_a_different_forward_and_the_draft_is_its_argmax() {
    let d = drafter(&config_json(), 5);
    let h = head(6);
    let all = taps(7, 3, 7);
    let mut p = DflashProposer::new(d.clone(), h.clone(), DflashSettings::default()).unwrap();
    p.begin(&tokens(7)).unwrap();
    p.observe(&tokens(8), 0..7, &all).unwrap();
    let toks = tokens(8);
    let positions: Vec<usize> = (0..7).collect();
    for masks in 1..=5 {
        let reference = stateless_logits(&d, &h, &all, &positions, toks[7], 7, masks);
        let draft = p.propose(&toks, masks).unwrap();
        let argmax: Vec<u32> = reference.iter().map(|r| crate::sample::argmax(r)).collect();
        assert_eq!(draft.tokens, argmax);
        assert!(draft.probs.is_none());
    }
    // More than B − 1 wanted: B − 1 proposed; max_draft caps the proposal, not the block.
    assert_eq!(p.propose(&toks, 99).unwrap().tokens.len(), 5);
    let full = p.propose(&toks, 5).unwrap().tokens;
    let settings = DflashSettings { max_draft: Some(2), ..Default::default() };
    let mut capped = DflashProposer::new(d, h, settings).unwrap();
    capped.observe(&tokens(8), 0..7, &all).unwrap();
    assert_eq!(capped.propose(&toks, 5).unwrap().tokens, full[..2]);
    assert!(capped.propose(&toks, 0).unwrap().tokens.is_empty());
}

#[test]
fn rerun_rows_replace_cached_ones_and_a_gap_restarts_the_context() {
    let d = drafter(&config_json(), 8);
    let h = head(9);
    let first = taps(11, 3, 10);
    let rerun = taps(4, 3, 11);
    let mut p = DflashProposer::new(d.clone(), h.clone(), DflashSettings::default()).unwrap();
    p.observe(&tokens(12), 0..11, &first).unwrap();
    // The engine ran rows 9..13 again: the new features win.
    p.observe(&tokens(14), 9..13, &rerun).unwrap();
    assert_eq!(p.context_rows(), 0..13);
    let expect: Vec<Tensor> =
        rows(&first, 0..9).iter().zip(&rerun).map(|(a, b)| Tensor::cat(&[a, b], 0).unwrap()).collect();
    let toks = tokens(14);
    let positions: Vec<usize> = (0..13).collect();
    let cached = p.draft_logits(&toks, 5).unwrap().to_vec2::<f32>().unwrap();
    assert!(max_diff(&cached, &stateless_logits(&d, &h, &expect, &positions, toks[13], 13, 5)) < 1e-5);

    // Rows 13..16 never ran through the target: the context restarts at 16.
    let later = taps(2, 3, 12);
    p.observe(&tokens(19), 16..18, &later).unwrap();
    assert_eq!(p.context_rows(), 16..18);
    let toks = tokens(19);
    let cached = p.draft_logits(&toks, 5).unwrap().to_vec2::<f32>().unwrap();
    assert!(max_diff(&cached, &stateless_logits(&d, &h, &later, &[16, 17], toks[18], 18, 5)) < 1e-5);

    // begin() forgets everything; a draft without any context is the block attending to itself.
    p.begin(&tokens(3)).unwrap();
    assert_eq!(p.context_rows(), 0..0);
    let toks = tokens(3);
    let alone = p.draft_logits(&toks, 5).unwrap().to_vec2::<f32>().unwrap();
    let one = taps(1, 3, 13);
    let mut q = DflashProposer::new(d.clone(), h.clone(), DflashSettings::default()).unwrap();
    q.observe(&toks, 1..2, &one).unwrap();
    assert_eq!(q.context_rows(), 1..2);
    let with_one = q.draft_logits(&toks, 5).unwrap().to_vec2::<f32>().unwrap();
    assert!(max_diff(&with_one, &stateless_logits(&d, &h, &one, &[1], toks[2], 2, 5)) < 1e-5);
    assert!(max_diff(&alone, &with_one) > 1e-3, "the context must matter");
}

#[test]
fn a_context_window_keeps_only_the_last_rows_at_their_positions() {
    let d = drafter(&config_json(), 13);
    let h = head(14);
    let all = taps(40, 3, 15);
    let settings = DflashSettings { context_window: Some(6), ..Default::default() };
    let mut p = DflashProposer::new(d.clone(), h.clone(), settings).unwrap();
    // A long first chunk (only its last 6 rows are projected), then steps that slide the window
    // across the buffer's reallocations.
    p.observe(&tokens(21), 0..20, &rows(&all, 0..20)).unwrap();
    let mut end = 20;
    for step in [1, 3, 2, 5, 1, 4, 4] {
        p.observe(&tokens(end + step + 1), end..end + step, &rows(&all, end..end + step)).unwrap();
        end += step;
        assert_eq!(p.context_rows(), end - 6..end);
        let toks = tokens(end + 1);
        let positions: Vec<usize> = (end - 6..end).collect();
        let reference = stateless_logits(&d, &h, &rows(&all, end - 6..end), &positions, toks[end], end, 5);
        let cached = p.draft_logits(&toks, 5).unwrap().to_vec2::<f32>().unwrap();
        assert!(max_diff(&cached, &reference) < 1e-5, "window at {end}");
    }
}

/// Block rows at `start..` for random block embeddings, with context `ctx` rows at 0.. .
fn block_forward(d: &DflashDrafter, ctx: &[Tensor], block: &Tensor, start: usize) -> Vec<Vec<f32>> {
    let ctx_pos: Vec<usize> = (0..ctx[0].dim(0).unwrap()).collect();
    let pos: Vec<usize> = (start..start + block.dim(0).unwrap()).collect();
    d.forward(ctx, &ctx_pos, block, &pos, Packing::ONE_BLOCK).unwrap().to_vec2().unwrap()
}

fn with_row(t: &Tensor, row: usize, seed: u64) -> Tensor {
    let mut rng = SamplerRng::from_seed(seed);
    let mut v = t.to_vec2::<f32>().unwrap();
    v[row] = uniform(&mut rng, v[row].len(), 2.0, 0.0);
    Tensor::new(v, &Device::Cpu).unwrap()
}

#[test]
fn full_layers_are_bidirectional_sliding_layers_causal_and_windowed() {
    let mut rng = SamplerRng::from_seed(16);
    let block = random_tensor(&mut rng, &[6, HIDDEN], 1.0, 0.0);
    let ctx = taps(10, 3, 17);
    let changed_last = with_row(&block, 5, 18);
    let same_rows = |a: &[Vec<f32>], b: &[Vec<f32>], r: std::ops::Range<usize>| {
        r.into_iter().all(|i| max_diff(&a[i..i + 1], &b[i..i + 1]) < 1e-6)
    };

    // Full attention (the Qwen3 drafters): the last block row influences the first.
    let full = drafter(&config_json(), 19);
    let (a, b) = (block_forward(&full, &ctx, &block, 10), block_forward(&full, &ctx, &changed_last, 10));
    assert!(!same_rows(&a, &b, 0..1));

    // Sliding layers: causal in the block, and a query at q sees context keys k > q − window.
    let mut c = config_json();
    c["layer_types"] = json!(["sliding_attention", "sliding_attention"]);
    c["sliding_window"] = json!(4);
    let swa = drafter(&c, 19);
    let (a, b) = (block_forward(&swa, &ctx, &block, 10), block_forward(&swa, &ctx, &changed_last, 10));
    assert!(same_rows(&a, &b, 0..5) && !same_rows(&a, &b, 5..6));
    // Keys at positions <= 6 are outside every query's window (queries start at 10, window 4),
    // in every layer; position 7 is inside the window of the query at 10.
    let old = rows(&ctx, 0..10).iter().map(|t| with_row(t, 6, 20)).collect::<Vec<_>>();
    assert!(same_rows(&block_forward(&swa, &ctx, &block, 10), &block_forward(&swa, &old, &block, 10), 0..6));
    let recent = rows(&ctx, 0..10).iter().map(|t| with_row(t, 7, 21)).collect::<Vec<_>>();
    let (a, b) = (block_forward(&swa, &ctx, &block, 10), block_forward(&swa, &recent, &block, 10));
    assert!(!same_rows(&a, &b, 0..1));
}

fn write_checkpoint(dir: &std::path::Path, c: &Value, weights: &HashMap<String, Tensor>) {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(c).unwrap()).unwrap();
    candle_core::safetensors::save(weights, dir.join("model.safetensors")).unwrap();
}

#[test]
fn loads_checkpoints_in_bf16_and_names_missing_or_misshapen_tensors() {
    let c = config_json();
    let cfg = DflashConfig::from_json(&c).unwrap();
    let weights = random_weights(&cfg, 22);
    let dir = tempfile::tempdir().unwrap();

    // bf16 on disk loads, held in f32, equal to the bf16-rounded weights.
    let bf16: HashMap<String, Tensor> =
        weights.iter().map(|(k, v)| (k.clone(), v.to_dtype(DType::BF16).unwrap())).collect();
    write_checkpoint(dir.path(), &c, &bf16);
    let loaded = DflashDrafter::load(dir.path(), &Device::Cpu).unwrap();
    let rounded: HashMap<String, Tensor> =
        bf16.iter().map(|(k, v)| (k.clone(), v.to_dtype(DType::F32).unwrap())).collect();
    let expected =
        DflashDrafter::from_var_builder(cfg.clone(), VarBuilder::from_tensors(rounded, DType::F32, &Device::Cpu))
            .unwrap();
    let ctx = taps(4, 3, 23);
    let mut rng = SamplerRng::from_seed(24);
    let block = random_tensor(&mut rng, &[3, HIDDEN], 1.0, 0.0);
    assert_eq!(block_forward(&loaded, &ctx, &block, 4), block_forward(&expected, &ctx, &block, 4));

    let err = |w: &HashMap<String, Tensor>| {
        write_checkpoint(dir.path(), &c, w);
        format!("{:#}", DflashDrafter::load(dir.path(), &Device::Cpu).err().expect("should fail"))
    };
    let mut missing = weights.clone();
    missing.remove("layers.1.mlp.up_proj.weight");
    assert!(err(&missing).contains("missing tensor `layers.1.mlp.up_proj.weight`"), "{}", err(&missing));
    let mut bad = weights.clone();
    bad.insert("fc.weight".into(), Tensor::zeros((HIDDEN, 2 * HIDDEN), DType::F32, &Device::Cpu).unwrap());
    let msg = err(&bad);
    assert!(msg.contains("`fc.weight` has shape [32, 64], expected [32, 96]"), "{msg}");
    let mut bad = weights.clone();
    bad.insert("layers.0.self_attn.k_norm.weight".into(), Tensor::zeros(16, DType::F32, &Device::Cpu).unwrap());
    assert!(err(&bad).contains("layers.0.self_attn.k_norm.weight"));
}

#[test]
fn the_last_target_layer_is_tapped_after_the_final_norm_as_in_hugging_face() {
    let mut rng = SamplerRng::from_seed(25);
    let emb =
        Arc::new(QTensor::quantize(&random_tensor(&mut rng, &[VOCAB, HIDDEN], 1.0, 0.0), GgmlDType::F32).unwrap());
    let lm =
        TargetLinear::from_qtensor(emb.clone(), None, WeightFormat::F32, &Default::default(), &Device::Cpu).unwrap();
    let norm = random_tensor(&mut rng, &[HIDDEN], 0.2, 1.0);
    let h = TargetHead::from_parts(emb, norm.clone(), 1e-6, 4, lm, &Device::Cpu);
    let x = random_tensor(&mut rng, &[3, HIDDEN], 3.0, 0.0);
    assert_eq!(h.hidden_state(2, &x).unwrap().to_vec2::<f32>().unwrap(), x.to_vec2::<f32>().unwrap());
    let normed = h.hidden_state(3, &x).unwrap().to_vec2::<f32>().unwrap();
    let w = norm.to_vec1::<f32>().unwrap();
    for (row, out) in x.to_vec2::<f32>().unwrap().iter().zip(&normed) {
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / HIDDEN as f32 + 1e-6).sqrt();
        for ((v, o), w) in row.iter().zip(out).zip(&w) {
            assert!((v * inv * w - o).abs() < 1e-5);
        }
    }
}

#[test]
fn drafter_arguments_parse_settings_off_the_end() {
    let (path, s) = parse_drafter_arg("/m/Qwen3-8B-DFlash-b16").unwrap();
    assert_eq!((path.to_str().unwrap(), s), ("/m/Qwen3-8B-DFlash-b16", DflashSettings::default()));
    let (path, s) = parse_drafter_arg("/m/a,b,block=8,window=4096,max=5").unwrap();
    assert_eq!(path.to_str().unwrap(), "/m/a,b");
    assert_eq!(s, DflashSettings { block_size: Some(8), max_draft: Some(5), context_window: Some(4096) });
    assert_eq!(drafter_label(&path, &s), "dflash:/m/a,b,block=8,draft-max=5,window=4096");
    assert!(parse_drafter_arg("").is_err());
    assert!(parse_drafter_arg("/m/a,block=0").unwrap_err().to_string().contains("positive"));
    assert!(parse_drafter_arg("/m/a,block=1").is_err());
    assert!(parse_drafter_arg("/m/a,max=2,max=3").unwrap_err().to_string().contains("twice"));
}
