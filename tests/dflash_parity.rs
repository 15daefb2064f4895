//! DFlash against the official reference and against plain greedy decoding.
//!
//! - Parity: for every fixture in `tests/fixtures/dflash/<case>/` (tiny Hugging Face Qwen3
//!   targets and z-lab-format drafters, with the rounds the official `dflash==0.1.0`
//!   `dflash_generate` ran on them; generator: `tools/dflash_reference/`), the reference loop
//!   replayed here gives identical per-round draft tokens, acceptance, bonus tokens and output,
//!   and first-round draft logits within 1e-4. The real engine (`engine::generate`) gives the
//!   same output and the same rounds wherever it asks for a full block.
//! - Lossless: greedy DFlash output equals plain greedy output (fixtures, a tiny random Qwen3
//!   written here with several drafter shapes, block sizes and context windows, and the real
//!   Qwen2.5-Coder-0.5B with a random drafter when it is in the model cache).
//! - Loading: missing tensors, wrong shapes, a MASK id outside the target vocabulary, a hidden
//!   size that is not the target's and tapped layers beyond its depth are refused by name.

mod common;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use specula::engine::{generate, GenerateOptions, Generation};
use specula::kv::KvDtype;
use specula::model::{ForwardBatch, LogitsRows, Transformer, WeightFormat};
use specula::sample::{argmax, SamplerRng, SamplingParams};
use specula::speculative::dflash::{self, DflashConfig, DflashProposer, DflashSettings, TargetHead};
use specula::speculative::Proposer;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const LOGIT_TOLERANCE: f32 = 1e-4;

/// `tests/fixtures/dflash`, or `$DFLASH_FIXTURES` (a fresh generator run elsewhere).
fn fixtures_dir() -> PathBuf {
    std::env::var_os("DFLASH_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dflash"))
}

fn fixture_cases() -> Vec<PathBuf> {
    let mut cases: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures/dflash is missing (tools/dflash_reference/make_fixtures.py writes it)")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.json").is_file())
        .collect();
    cases.sort();
    assert!(!cases.is_empty(), "no DFlash fixtures in {}", fixtures_dir().display());
    cases
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("a list of ids").iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn load_target(dir: &Path) -> Transformer {
    Transformer::from_path(dir, Some(WeightFormat::F32), &Device::Cpu).unwrap()
}

fn proposer(target: &Transformer, drafter_dir: &Path, settings: DflashSettings) -> DflashProposer {
    let drafter = dflash::load_for_target(drafter_dir, target, &Device::Cpu).unwrap();
    DflashProposer::new(Arc::new(drafter), TargetHead::of(target), settings).unwrap()
}

/// One round of the reference loop, as recorded in expected.json.
#[derive(Debug, PartialEq)]
struct Round {
    start: usize,
    anchor: u32,
    /// Context rows new in this round.
    context_rows: usize,
    draft_tokens: Vec<u32>,
    accepted: usize,
    next_token: u32,
}

struct LoopResult {
    output: Vec<u32>,
    rounds: Vec<Round>,
    acceptance_lengths: Vec<usize>,
    first_draft_logits: Vec<Vec<f32>>,
}

/// `dflash_generate` (greedy, no stop tokens) replayed on our target forward and proposer:
/// verify block `min(B, max_length − start)`, the draft block shrinking with it; commit the
/// accepted prefix and the bonus; the committed rows' taps become the next context.
fn reference_loop(target: &Transformer, p: &mut DflashProposer, prompt: &[u32], max_new: usize) -> LoopResult {
    let pool = target.new_kv_pool_typed(prompt.len() + max_new + 64, KvDtype::F32);
    let mut cache = pool.new_sequence();
    let taps_wanted = p.tap_layers().to_vec();
    p.begin(prompt).unwrap();
    let mut batch = ForwardBatch::new();
    batch.tap_layers = taps_wanted.clone();
    batch.push(prompt, &mut cache, LogitsRows::Last);
    let out = target.forward(&mut batch).unwrap();
    let first = argmax(&out.seq_logits(0).unwrap()[0]);
    p.observe(&[prompt, &[first]].concat(), 0..prompt.len(), &out.seq_taps(0).unwrap()).unwrap();

    let max_length = prompt.len() + max_new;
    let block_size = p.block_size();
    let mut tokens = [prompt, &[first]].concat();
    let mut start = prompt.len();
    let (mut rounds, mut acceptance_lengths, mut first_draft_logits) = (Vec::new(), Vec::new(), Vec::new());
    let mut ingested = 0;
    while start + 1 < max_length {
        let verify_size = block_size.min(max_length - start);
        // New context rows this round (the reference's `target_hidden` length); together with
        // the earlier ones they end right before the anchor.
        assert_eq!(p.context_rows().end, start);
        let context_rows = start - ingested;
        ingested = start;
        if rounds.is_empty() {
            first_draft_logits = p.draft_logits(&tokens, verify_size - 1).unwrap().to_vec2::<f32>().unwrap();
        }
        let draft = p.propose(&tokens, verify_size - 1).unwrap().tokens;
        assert_eq!(draft.len(), verify_size - 1);
        let input = [&[tokens[start]], draft.as_slice()].concat();
        let mut batch = ForwardBatch::new();
        batch.tap_layers = taps_wanted.clone();
        batch.push(&input, &mut cache, LogitsRows::All);
        let out = target.forward(&mut batch).unwrap();
        let posterior: Vec<u32> = out.seq_logits(0).unwrap().iter().map(|r| argmax(r)).collect();
        let accepted = draft.iter().zip(&posterior).take_while(|(d, t)| d == t).count();
        let next_token = posterior[accepted];
        rounds.push(Round {
            start,
            anchor: tokens[start],
            context_rows,
            draft_tokens: draft.clone(),
            accepted,
            next_token,
        });
        let produced = (accepted + 1).min(max_length - start - 1);
        acceptance_lengths.push(produced);
        cache.truncate(start + produced);
        tokens.extend(draft[..accepted].iter().chain([&next_token]).take(produced));
        let taps: Vec<Tensor> = out.seq_taps(0).unwrap().iter().map(|t| t.narrow(0, 0, produced).unwrap()).collect();
        p.observe(&tokens, start..start + produced, &taps).unwrap();
        start += produced;
    }
    LoopResult {
        output: tokens[prompt.len()..max_length.min(start + 1)].to_vec(),
        rounds,
        acceptance_lengths,
        first_draft_logits,
    }
}

fn greedy_params(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens: Some(max_tokens), ..SamplingParams::greedy() }
}

/// `engine::generate`, greedy, with a proposer (drafting `draft_len` per step) or plain.
fn engine_generate(
    target: &Transformer,
    prompt: &[u32],
    max_new: usize,
    p: Option<&mut dyn Proposer>,
    draft_len: usize,
) -> Generation {
    let pool = target.new_kv_pool_typed(prompt.len() + max_new + 64, KvDtype::F32);
    let opts = GenerateOptions { trace: true, ..GenerateOptions::fixed_draft(draft_len) };
    generate(target.into(), &pool, prompt, greedy_params(max_new), p, &opts, &mut |_| {}).unwrap()
}

/// A DFlash proposer that checks the engine's invariant at every draft: the drafter's context
/// ends exactly before the anchor (all committed rows but the last were handed over).
struct Checked {
    inner: DflashProposer,
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
        self.inner.observe(tokens, cached, taps)
    }
    fn propose(&mut self, tokens: &[u32], max_len: usize) -> anyhow::Result<specula::speculative::Draft> {
        assert_eq!(self.inner.context_rows().end, tokens.len() - 1, "context out of step with the commits");
        self.proposals += 1;
        self.inner.propose(tokens, max_len)
    }
}

#[test]
fn fixtures_match_the_reference_round_for_round() {
    for case in fixture_cases() {
        let target = load_target(&case.join("target"));
        check_case(&case, &target);
    }
}

/// The fixtures' targets written as GGUF files (f32 tensors, `qwen3` metadata): the same
/// logits bit for bit as the Hugging Face directories, and the same DFlash rounds; and as
/// Q8_0 GGUF files, DFlash greedy output equal to the quantised target's plain greedy.
#[test]
fn a_gguf_qwen3_target_reproduces_the_fixtures() {
    for case in fixture_cases() {
        let tmp = tempfile::tempdir().unwrap();
        let gguf_path = tmp.path().join("target.gguf");
        common::write_gguf_from_hf(&case.join("target"), "qwen3", candle_core::quantized::GgmlDType::F32, &gguf_path);
        let gguf = Transformer::from_path(&gguf_path, Some(WeightFormat::F32), &Device::Cpu).unwrap();
        assert_eq!(gguf.config.arch, specula::model::Arch::Qwen3);
        let hf = load_target(&case.join("target"));
        let expected: Value =
            serde_json::from_str(&std::fs::read_to_string(case.join("expected.json")).unwrap()).unwrap();
        let prompt = ids(&expected["prompt_ids"]);
        let logits = |model: &Transformer| {
            let pool = model.new_kv_pool(512);
            let mut cache = pool.new_sequence();
            let mut batch = ForwardBatch::new();
            batch.push(&prompt, &mut cache, LogitsRows::All);
            let out = model.forward(&mut batch).unwrap();
            out.logits.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(bits(logits(&gguf)), bits(logits(&hf)), "{}", case.display());
        check_case(&case, &gguf);

        // Quantised (Q8_0 matrices, on the kernels a served GGUF uses): DFlash greedy is
        // still exactly the target's own greedy output.
        let q8_path = tmp.path().join("target-q8_0.gguf");
        common::write_gguf_from_hf(&case.join("target"), "qwen3", candle_core::quantized::GgmlDType::Q8_0, &q8_path);
        let q8 = Transformer::from_path(&q8_path, None, &Device::Cpu).unwrap();
        let max_new = expected["max_new_tokens"].as_u64().unwrap() as usize;
        let mut p = proposer(&q8, &case.join("drafter"), DflashSettings::default());
        let block = p.block_size();
        let dflash = engine_generate(&q8, &prompt, max_new, Some(&mut p as &mut dyn Proposer), block - 1);
        let plain = engine_generate(&q8, &prompt, max_new, None, 0);
        assert_eq!(dflash.tokens, plain.tokens, "{}: Q8_0 target", case.display());
    }
}

/// The reference loop and the engine on `target` against the fixture's expected rounds.
fn check_case(case: &Path, target: &Transformer) {
    {
        let name = case.file_name().unwrap().to_string_lossy().to_string();
        let expected: Value =
            serde_json::from_str(&std::fs::read_to_string(case.join("expected.json")).unwrap()).unwrap();
        let prompt = ids(&expected["prompt_ids"]);
        let max_new = expected["max_new_tokens"].as_u64().unwrap() as usize;
        let mut p = proposer(target, &case.join("drafter"), DflashSettings::default());
        let cfg = &p.drafter().config;
        assert_eq!(cfg.block_size as u64, expected["block_size"].as_u64().unwrap(), "{name}");
        assert_eq!(cfg.mask_token_id as u64, expected["mask_token_id"].as_u64().unwrap(), "{name}");
        assert_eq!(
            cfg.target_layer_ids.iter().map(|&l| l as u32).collect::<Vec<_>>(),
            ids(&expected["target_layer_ids"]),
            "{name}"
        );

        let got = reference_loop(target, &mut p, &prompt, max_new);
        let want_rounds: Vec<Round> = expected["rounds"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| Round {
                start: r["start"].as_u64().unwrap() as usize,
                anchor: r["anchor"].as_u64().unwrap() as u32,
                context_rows: r["context_rows"].as_u64().unwrap() as usize,
                draft_tokens: ids(&r["draft_tokens"]),
                accepted: r["accepted"].as_u64().unwrap() as usize,
                next_token: r["next_token"].as_u64().unwrap() as u32,
            })
            .collect();
        for (i, (g, w)) in got.rounds.iter().zip(&want_rounds).enumerate() {
            assert_eq!(g, w, "{name}: round {i}");
        }
        assert_eq!(got.rounds.len(), want_rounds.len(), "{name}: number of rounds");
        assert_eq!(got.output, ids(&expected["output_ids"]), "{name}: output");
        assert_eq!(got.output, ids(&expected["target_greedy_ids"]), "{name}: output vs target greedy");
        let want_lengths: Vec<usize> = ids(&expected["acceptance_lengths"]).into_iter().map(|x| x as usize).collect();
        assert_eq!(got.acceptance_lengths, want_lengths, "{name}: acceptance lengths");

        let want_logits: Vec<Vec<f32>> = expected["first_round_draft_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
            .collect();
        assert_eq!(got.first_draft_logits.len(), want_logits.len(), "{name}: first-round logits rows");
        let mut worst = 0f32;
        for (g, w) in got.first_draft_logits.iter().zip(&want_logits) {
            assert_eq!(g.len(), w.len(), "{name}: vocabulary");
            worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(worst, f32::max);
        }
        assert!(worst <= LOGIT_TOLERANCE, "{name}: first-round draft logits differ by up to {worst}");
        let tau = want_lengths.iter().sum::<usize>() as f64 / want_lengths.len() as f64;
        eprintln!("{name}: {} rounds, tau {tau:.3}, first-round logits within {worst:.2e}", want_rounds.len());

        // Through the engine: same output, and the same rounds wherever it drafted as many tokens
        // (near max_tokens the engine drafts one token fewer than the reference, whose last bonus
        // token is cut off anyway, so its block is one row shorter there).
        let mut p = proposer(target, &case.join("drafter"), DflashSettings::default());
        let block = p.block_size();
        let dflash = engine_generate(target, &prompt, max_new, Some(&mut p as &mut dyn Proposer), block - 1);
        assert_eq!(dflash.tokens, ids(&expected["output_ids"]), "{name}: engine output");
        assert_eq!(dflash.trace.len(), want_rounds.len(), "{name}: engine rounds");
        for (i, (w, t)) in want_rounds.iter().zip(&dflash.trace).enumerate() {
            if t.draft.len() == w.draft_tokens.len() {
                assert_eq!(
                    (&t.draft, t.accepted, t.next_token),
                    (&w.draft_tokens, w.accepted, w.next_token),
                    "{name}: engine round {i}"
                );
            } else {
                assert!(w.start + block >= prompt.len() + max_new, "{name}: engine round {i} drafted {:?}", t.draft);
            }
        }
        let plain = engine_generate(target, &prompt, max_new, None, 0);
        assert_eq!(plain.tokens, ids(&expected["target_greedy_ids"]), "{name}: plain greedy");
    }
}

/// `--drafter dflash:PATH,...` through the factory, on a fixture target loaded as a served
/// model (with its tokenizer): the settings reach the proposer and the output is the reference's.
#[test]
fn the_factory_builds_dflash_from_a_drafter_string() {
    use specula::engine::LoadedModel;
    use specula::speculative::{build_proposer, DrafterSpec};
    let case = fixture_cases().into_iter().find(|c| c.ends_with("fitted")).expect("the fitted fixture");
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(case.join("expected.json")).unwrap()).unwrap();
    let loaded = LoadedModel::load(&case.join("target"), Some(WeightFormat::F32), &Device::Cpu).unwrap();
    let arg = format!("dflash:{},draft-max=3,window=64", case.join("drafter").display());
    let spec = DrafterSpec::parse(&arg).unwrap();
    assert_eq!(spec.label(), arg);
    let mut p = build_proposer(&spec, loaded.target(), specula::speculative::Caller::default()).unwrap();
    assert_eq!(p.name(), "dflash");
    let prompt = ids(&expected["prompt_ids"]);
    let max_new = expected["max_new_tokens"].as_u64().unwrap() as usize;
    let out = engine_generate(&loaded.model, &prompt, max_new, Some(p.as_mut()), 7);
    assert_eq!(out.tokens, ids(&expected["output_ids"]));
    assert!(out.trace.iter().all(|s| s.draft.len() <= 3));
    assert!(out.trace.iter().any(|s| s.accepted > 0));

    // The same drafter for a target it does not fit: refused with the reason.
    let other = fixture_cases().into_iter().find(|c| c.ends_with("layers_mismatch")).unwrap();
    let spec = DrafterSpec::parse(&format!("dflash:{}", other.join("drafter").display())).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write_target(&tmp.path().join("target"), 9);
    // The fixture's byte-level tokenizer, cut to the narrow target's vocabulary.
    let mut tok: Value =
        serde_json::from_str(&std::fs::read_to_string(case.join("target/tokenizer.json")).unwrap()).unwrap();
    tok["model"]["vocab"].as_object_mut().unwrap().retain(|_, id| id.as_u64().unwrap() < VOCAB as u64);
    if let Some(added) = tok["added_tokens"].as_array_mut() {
        added.retain(|t| t["id"].as_u64().unwrap() < VOCAB as u64);
    }
    std::fs::write(tmp.path().join("target/tokenizer.json"), tok.to_string()).unwrap();
    let narrow = LoadedModel::load(&tmp.path().join("target"), Some(WeightFormat::F32), &Device::Cpu).unwrap();
    let err = build_proposer(&spec, narrow.target(), specula::speculative::Caller::default())
        .err()
        .expect("hidden sizes differ");
    assert!(format!("{err:#}").contains("hidden size mismatch"), "{err:#}");
    assert!(DrafterSpec::parse("dflash:").is_err());
}

// ---------------------------------------------------------------------------------------------
// A tiny random Qwen3 target and random drafters written here
// ---------------------------------------------------------------------------------------------

const VOCAB: usize = 96;
const HIDDEN: usize = 48;
const TARGET_LAYERS: usize = 4;

fn uniform(rng: &mut SamplerRng, shape: &[usize], scale: f64, offset: f64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| (offset + (rng.next_f64() * 2.0 - 1.0) * scale) as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn weight(rng: &mut SamplerRng, shape: &[usize]) -> Tensor {
    if shape.len() == 1 {
        uniform(rng, shape, 0.2, 1.0)
    } else {
        uniform(rng, shape, 1.7 / (shape[1] as f64).sqrt(), 0.0)
    }
}

fn save(dir: &Path, config: &Value, tensors: &HashMap<String, Tensor>, dtype: DType) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
    let tensors: HashMap<String, Tensor> =
        tensors.iter().map(|(k, v)| (k.clone(), v.to_dtype(dtype).unwrap())).collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
}

/// A Hugging Face Qwen3 directory with random weights (untied head, q/k norms).
fn write_target(dir: &Path, seed: u64) {
    let (heads, kv_heads, head_dim, ffn) = (4, 2, 12, 80);
    let config = json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": HIDDEN,
        "num_hidden_layers": TARGET_LAYERS, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": ffn, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": false
    });
    let mut rng = SamplerRng::from_seed(seed);
    let mut t = HashMap::new();
    let mut put = |name: String, shape: &[usize]| {
        t.insert(name, weight(&mut rng, shape));
    };
    put("model.embed_tokens.weight".into(), &[VOCAB, HIDDEN]);
    put("model.norm.weight".into(), &[HIDDEN]);
    put("lm_head.weight".into(), &[VOCAB, HIDDEN]);
    for i in 0..TARGET_LAYERS {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        put(p("input_layernorm.weight"), &[HIDDEN]);
        put(p("post_attention_layernorm.weight"), &[HIDDEN]);
        put(p("self_attn.q_proj.weight"), &[heads * head_dim, HIDDEN]);
        put(p("self_attn.k_proj.weight"), &[kv_heads * head_dim, HIDDEN]);
        put(p("self_attn.v_proj.weight"), &[kv_heads * head_dim, HIDDEN]);
        put(p("self_attn.o_proj.weight"), &[HIDDEN, heads * head_dim]);
        put(p("self_attn.q_norm.weight"), &[head_dim]);
        put(p("self_attn.k_norm.weight"), &[head_dim]);
        put(p("mlp.gate_proj.weight"), &[ffn, HIDDEN]);
        put(p("mlp.up_proj.weight"), &[ffn, HIDDEN]);
        put(p("mlp.down_proj.weight"), &[HIDDEN, ffn]);
    }
    save(dir, &config, &t, DType::F32);
}

fn drafter_config(hidden: usize, layers: usize, block: usize, layer_ids: &[usize], mask: usize) -> Value {
    json!({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8,
        "intermediate_size": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "block_size": block,
        "num_target_layers": TARGET_LAYERS,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": layer_ids}
    })
}

fn random_drafter_weights(config: &Value, seed: u64) -> HashMap<String, Tensor> {
    let cfg = DflashConfig::from_json(config).unwrap();
    let mut rng = SamplerRng::from_seed(seed);
    dflash::expected_tensors(&cfg).into_iter().map(|(name, shape)| (name, weight(&mut rng, &shape))).collect()
}

fn write_drafter(dir: &Path, config: &Value, seed: u64, dtype: DType) {
    save(dir, config, &random_drafter_weights(config, seed), dtype);
}

#[test]
fn greedy_dflash_equals_plain_greedy_on_a_random_qwen3() {
    let tmp = tempfile::tempdir().unwrap();
    write_target(&tmp.path().join("target"), 1);
    let target = load_target(&tmp.path().join("target"));
    let prompt: Vec<u32> = (0..23).map(|i| (i * 37 + 5) % VOCAB as u32).collect();
    let max_new = 40;
    let plain = engine_generate(&target, &prompt, max_new, None, 0);
    assert_eq!(plain.tokens.len(), max_new);

    // (layers, block, taps incl. the last layer, weights dtype, settings)
    let window = |w| DflashSettings { context_window: Some(w), ..Default::default() };
    let variants: Vec<(usize, usize, Vec<usize>, DType, DflashSettings, usize)> = vec![
        (2, 8, vec![1, 2], DType::F32, DflashSettings::default(), 7),
        (1, 5, vec![0, 1, 3], DType::BF16, DflashSettings::default(), 4),
        (2, 16, vec![3], DType::F16, DflashSettings::default(), 15),
        (2, 8, vec![0, 2], DType::F32, window(6), 7),
        (2, 8, vec![1, 2], DType::F32, DflashSettings { block_size: Some(4), ..Default::default() }, 3),
        (2, 8, vec![1, 2], DType::F32, DflashSettings { max_draft: Some(2), ..Default::default() }, 7),
    ];
    for (i, (layers, block, taps, dtype, settings, draft_len)) in variants.into_iter().enumerate() {
        let dir = tmp.path().join(format!("drafter{i}"));
        write_drafter(&dir, &drafter_config(HIDDEN, layers, block, &taps, VOCAB - 1), 10 + i as u64, dtype);
        let mut p = Checked { inner: proposer(&target, &dir, settings.clone()), proposals: 0 };
        let spec = engine_generate(&target, &prompt, max_new, Some(&mut p as &mut dyn Proposer), draft_len);
        assert!(p.proposals + 1 >= spec.trace.len(), "variant {i}: the engine skipped drafting");
        assert_eq!(spec.tokens, plain.tokens, "variant {i}: {settings:?}");
        let drafted: usize = spec.trace.iter().map(|s| s.draft.len()).sum();
        assert!(drafted > 0, "variant {i} drafted nothing");
        assert!(spec.trace.iter().all(|s| s.draft.len() <= settings.max_draft.unwrap_or(usize::MAX)));
        if let Some(w) = settings.context_window {
            assert_eq!(p.inner.context_rows().len(), w);
        }
    }
}

/// The replayed reference loop and `engine::generate` drive the proposer differently (the
/// engine drafts one token fewer near max_tokens); wherever they draft blocks of the same size
/// they must draft the same tokens, and their outputs must be plain greedy.
#[test]
fn the_reference_loop_and_the_engine_agree_on_a_random_qwen3() {
    let tmp = tempfile::tempdir().unwrap();
    write_target(&tmp.path().join("target"), 2);
    write_drafter(&tmp.path().join("drafter"), &drafter_config(HIDDEN, 2, 6, &[0, 3], 7), 3, DType::F32);
    let target = load_target(&tmp.path().join("target"));
    let prompt: Vec<u32> = (0..9).map(|i| (i * 11 + 2) % VOCAB as u32).collect();
    let mut p = proposer(&target, &tmp.path().join("drafter"), DflashSettings::default());
    let replay = reference_loop(&target, &mut p, &prompt, 30);
    let mut p = proposer(&target, &tmp.path().join("drafter"), DflashSettings::default());
    let engine = engine_generate(&target, &prompt, 30, Some(&mut p as &mut dyn Proposer), 5);
    assert_eq!(engine.tokens, replay.output);
    assert_eq!(engine.tokens, engine_generate(&target, &prompt, 30, None, 0).tokens);
    assert_eq!(replay.rounds.len(), engine.trace.len());
    for (i, (r, t)) in replay.rounds.iter().zip(&engine.trace).enumerate() {
        if r.draft_tokens.len() != t.draft.len() {
            // Only in the last block-size steps, where the engine leaves room for the bonus.
            assert!(r.start + 6 >= prompt.len() + 30, "round {i}: {r:?} vs {t:?}");
            continue;
        }
        assert_eq!((&r.draft_tokens, r.accepted, r.next_token), (&t.draft, t.accepted, t.next_token));
    }
}

#[test]
fn broken_drafters_are_refused_with_the_problem_named() {
    let tmp = tempfile::tempdir().unwrap();
    write_target(&tmp.path().join("target"), 4);
    let target = load_target(&tmp.path().join("target"));
    let good = drafter_config(HIDDEN, 2, 8, &[1, 3], VOCAB - 1);
    let error = |config: &Value, weights: &HashMap<String, Tensor>| -> String {
        let dir = tmp.path().join("drafter");
        let _ = std::fs::remove_dir_all(&dir);
        save(&dir, config, weights, DType::BF16);
        match dflash::load_for_target(&dir, &target, &Device::Cpu) {
            Ok(_) => String::new(),
            Err(e) => format!("{e:#}"),
        }
    };
    let weights = random_drafter_weights(&good, 5);
    assert_eq!(error(&good, &weights), "");

    let mut missing = weights.clone();
    missing.remove("layers.1.self_attn.o_proj.weight");
    let msg = error(&good, &missing);
    assert!(msg.contains("missing tensor `layers.1.self_attn.o_proj.weight`"), "{msg}");

    let mut misshapen = weights.clone();
    misshapen
        .insert("layers.0.mlp.down_proj.weight".into(), Tensor::zeros((HIDDEN, 32), DType::F32, &Device::Cpu).unwrap());
    let msg = error(&good, &misshapen);
    assert!(msg.contains("`layers.0.mlp.down_proj.weight` has shape [48, 32], expected [48, 64]"), "{msg}");

    let msg = error(&drafter_config(HIDDEN, 2, 8, &[1, 3], VOCAB), &weights);
    assert!(msg.contains("mask_token_id 96 is outside the target's vocabulary (96 embedding rows)"), "{msg}");

    let narrow = drafter_config(32, 2, 8, &[1, 3], VOCAB - 1);
    let msg = error(&narrow, &random_drafter_weights(&narrow, 6));
    assert!(msg.contains("hidden size mismatch: the drafter's hidden_size is 32, the target's is 48"), "{msg}");

    let msg = error(&drafter_config(HIDDEN, 2, 8, &[1, 4], VOCAB - 1), &weights);
    assert!(msg.contains("layer 4 is beyond the target's 4 decoder layers"), "{msg}");

    let mut no_mask = good.clone();
    no_mask["dflash_config"] = json!({"target_layer_ids": [1, 3]});
    assert!(error(&no_mask, &weights).contains("no `mask_token_id`"));
}

/// The real Qwen2.5-Coder-0.5B (GGUF, 24 layers, hidden 896) with a random drafter tapping
/// three layers including the last: greedy DFlash output equals plain greedy output. Skipped
/// when the model is not in the cache (it is never downloaded here).
#[test]
fn greedy_dflash_equals_plain_greedy_on_a_real_model() {
    let path = specula::fetch::find_asset("qwen2.5-coder-0.5b").unwrap().path();
    if !path.is_file() {
        eprintln!("SKIPPED: optional model {} is not in the model cache", path.display());
        return;
    }
    let target = Transformer::from_path(&path, None, &Device::Cpu).unwrap();
    let hidden = target.config.hidden;
    let last = target.config.n_layers - 1;
    let tmp = tempfile::tempdir().unwrap();
    let config = json!({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "block_size": 8,
        "dflash_config": {"mask_token_id": 151643, "target_layer_ids": [1, 12, last]}
    });
    write_drafter(&tmp.path().join("drafter"), &config, 7, DType::BF16);
    // "def fibonacci(n):\n" in Qwen2.5's vocabulary.
    let prompt = [750u32, 75698, 1445, 982, 262];
    let plain = engine_generate(&target, &prompt, 24, None, 0);
    let mut p = proposer(&target, &tmp.path().join("drafter"), DflashSettings::default());
    let spec = engine_generate(&target, &prompt, 24, Some(&mut p as &mut dyn Proposer), 7);
    assert_eq!(spec.tokens, plain.tokens);
    assert!(spec.trace.iter().any(|s| !s.draft.is_empty()));
}
