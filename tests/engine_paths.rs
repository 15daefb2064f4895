//! `generate` (the CLI's and bench's path) and the server's engine run the same step loop: for
//! every drafter kind, the same request gives the same tokens, text and speculation counters
//! through both.

mod common;

use specula::engine::{
    generate, Engine, EngineConfig, EngineEvent, EngineModel, EngineRequest, GenerateOptions, LoadedModel,
};
use specula::model::WeightFormat;
use specula::sample::SamplingParams;
use specula::speculative::{build_proposer, DraftLen, DrafterSpec, SpecMetrics, StepCost};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one path produced.
#[derive(Debug, PartialEq)]
struct Outcome {
    tokens: Vec<u32>,
    text: String,
    finish: &'static str,
    /// The speculation counters without the timings.
    counts: (u64, u64, u64, u64, u64, Vec<u64>, Vec<u64>),
}

fn counts(m: &SpecMetrics) -> (u64, u64, u64, u64, u64, Vec<u64>, Vec<u64>) {
    (m.steps, m.spec_steps, m.drafted, m.accepted, m.committed, m.drafted_at.clone(), m.accepted_at.clone())
}

fn through_generate(
    loaded: &LoadedModel,
    spec: &DrafterSpec,
    prompt: &[u32],
    params: &SamplingParams,
    k: usize,
) -> Outcome {
    let pool = loaded.model.new_kv_pool(4096);
    let mut proposer = build_proposer(spec, loaded.target(), specula::speculative::Caller::default()).unwrap();
    let opts =
        GenerateOptions { stop_ids: loaded.stop_ids(), draft_len: DraftLen::Fixed(k), ..GenerateOptions::default() };
    let target = EngineModel { model: &loaded.model, tokenizer: Some(&loaded.tokenizer) };
    let gen = generate(target, &pool, prompt, params.clone(), Some(proposer.as_mut()), &opts, &mut |_| {}).unwrap();
    Outcome { tokens: gen.tokens, text: gen.text, finish: gen.finish.openai(), counts: counts(&gen.metrics) }
}

fn through_server_engine(
    loaded: &Arc<LoadedModel>,
    spec: &DrafterSpec,
    prompt: &[u32],
    params: &SamplingParams,
    k: usize,
) -> Outcome {
    let config = EngineConfig {
        drafter: Some(spec.clone()),
        draft_len: DraftLen::Fixed(k),
        // Given, not measured: a fixed draft length does not consult it.
        step_cost: Some(Arc::new(StepCost::linear())),
        kv_tokens: 4096,
        ..EngineConfig::default()
    };
    let engine = Engine::start(loaded.clone(), config).unwrap();
    let request = EngineRequest::new(prompt.to_vec(), params.clone());
    let mut rx = engine.submit(request).unwrap();
    let (mut tokens, mut text) = (Vec::new(), String::new());
    loop {
        match rx.blocking_recv().expect("the engine ended the stream early") {
            EngineEvent::Tokens(chunk) => {
                tokens.extend_from_slice(&chunk.ids);
                text.push_str(&chunk.text());
            }
            EngineEvent::Done(c) => {
                text.push_str(&c.tail);
                assert_eq!(c.usage.draft_n, c.metrics.drafted);
                // The state is published after the step that finished the request.
                let mut snapshot = engine.snapshot();
                for _ in 0..200 {
                    if snapshot.running == 0 {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    snapshot = engine.snapshot();
                }
                assert_eq!(snapshot.kv_free_blocks, snapshot.kv_total_blocks, "blocks held after the request ended");
                return Outcome { tokens, text, finish: c.finish.openai(), counts: counts(&c.metrics) };
            }
            EngineEvent::Failed(e) => panic!("the request failed: {e}"),
        }
    }
}

fn assert_same(loaded: &Arc<LoadedModel>, spec: &DrafterSpec, prompt: &[u32], params: SamplingParams, k: usize) {
    let a = through_generate(loaded, spec, prompt, &params, k);
    let b = through_server_engine(loaded, spec, prompt, &params, k);
    assert!(a.counts.2 > 0, "{}: nothing was drafted, the comparison would be empty", spec.label());
    assert_eq!(a, b, "{} at temperature {}", spec.label(), params.temperature);
}

fn params(temperature: f32, max_tokens: usize) -> SamplingParams {
    SamplingParams { temperature, seed: Some(7), max_tokens: Some(max_tokens), ..SamplingParams::default() }
}

#[test]
fn ngram_suffix_and_draft_model_run_the_same_loop_in_generate_and_the_server() {
    let loaded = Arc::new(LoadedModel::load(&common::smollm2_path(), None, &candle_core::Device::Cpu).unwrap());
    let prompt = loaded
        .encode_prompt("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n")
        .unwrap();
    let ngram = DrafterSpec::parse("ngram").unwrap();
    assert_same(&loaded, &ngram, &prompt, params(0.0, 48), 4);
    assert_same(&loaded, &ngram, &prompt, params(0.8, 48), 4);
    let suffix = DrafterSpec::parse("suffix").unwrap();
    assert_same(&loaded, &suffix, &prompt, params(0.0, 48), 4);
    assert_same(&loaded, &suffix, &prompt, params(0.8, 48), 4);
    // SmolLM2 drafting for itself (same vocabulary).
    let draft_model =
        DrafterSpec::DraftModel { model: common::smollm2_path().display().to_string(), settings: Default::default() };
    assert_same(&loaded, &draft_model, &prompt, params(0.0, 32), 3);
}

#[test]
fn dflash_runs_the_same_loop_in_generate_and_the_server() {
    let case = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dflash/fitted");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(case.join("expected.json")).unwrap()).unwrap();
    let loaded =
        Arc::new(LoadedModel::load(&case.join("target"), Some(WeightFormat::F32), &candle_core::Device::Cpu).unwrap());
    let prompt: Vec<u32> =
        expected["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let spec = DrafterSpec::parse(&format!("dflash:{}", case.join("drafter").display())).unwrap();
    assert_same(&loaded, &spec, &prompt, params(0.0, 24), 7);
}

#[test]
fn eagle3_runs_the_same_loop_in_generate_and_the_server() {
    let loaded = Arc::new(LoadedModel::load(&common::smollm2_path(), None, &candle_core::Device::Cpu).unwrap());
    let c = &loaded.model.config;
    let prompt = loaded.encode_prompt("1, 2, 3, 4, 5, 6, 7, 8,").unwrap();
    // A random drafter over a handful of digit-like tokens, so that some drafts are accepted.
    let vocab: Vec<u32> = (0..64).collect();
    let tmp = tempfile::tempdir().unwrap();
    common::write_eagle3_drafter(tmp.path(), c.hidden, c.hidden, c.vocab, [1, 14, 26], false, Some(&vocab), 9);
    let spec = DrafterSpec::parse(&format!("eagle3:{}", tmp.path().display())).unwrap();
    assert_same(&loaded, &spec, &prompt, params(0.0, 24), 3);
    assert_same(&loaded, &spec, &prompt, params(0.8, 24), 3);
}

/// DFlash with prefix caching: a request whose prompt shares a prefix with an earlier one
/// restores the target's K/V and the drafter's context rows for it, and then drafts exactly as
/// it would have with the whole prompt computed (same tokens and speculation counters as
/// `generate`, which never uses the prefix cache).
#[test]
fn dflash_shares_prompt_prefixes_through_the_prefix_cache() {
    let case = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dflash/fitted");
    let loaded =
        Arc::new(LoadedModel::load(&case.join("target"), Some(WeightFormat::F32), &candle_core::Device::Cpu).unwrap());
    let spec = DrafterSpec::parse(&format!("dflash:{}", case.join("drafter").display())).unwrap();
    let shared: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % 250).collect();
    let first = [shared.clone(), vec![3, 4, 5]].concat();
    let second = [shared.clone(), vec![9, 8]].concat();
    let config = EngineConfig {
        drafter: Some(spec.clone()),
        draft_len: DraftLen::Fixed(7),
        step_cost: Some(Arc::new(StepCost::linear())),
        kv_tokens: 4096,
        prefix_caching: true,
        ..EngineConfig::default()
    };
    let engine = Engine::start(loaded.clone(), config).unwrap();
    let run = |prompt: &[u32]| {
        let request = EngineRequest::new(prompt.to_vec(), params(0.0, 24));
        let mut rx = engine.submit(request).unwrap();
        let mut tokens = Vec::new();
        loop {
            match rx.blocking_recv().expect("stream ended early") {
                EngineEvent::Tokens(chunk) => tokens.extend_from_slice(&chunk.ids),
                EngineEvent::Done(c) => return (tokens, counts(&c.metrics)),
                EngineEvent::Failed(e) => panic!("{e}"),
            }
        }
    };
    let a = run(&first);
    let hits_before = engine.snapshot().prefix_cache_hit_tokens;
    let b = run(&second);
    let hits = engine.snapshot().prefix_cache_hit_tokens - hits_before;
    assert!(hits >= 32, "the second prompt restored only {hits} tokens from the prefix cache");
    for (prompt, got) in [(&first, a), (&second, b)] {
        let want = through_generate(&loaded, &spec, prompt, &params(0.0, 24), 7);
        assert!(want.counts.2 > 0, "nothing drafted");
        assert_eq!((got.0, got.1), (want.tokens, want.counts), "prompt of {} tokens", prompt.len());
    }
}

/// Waiting requests whose cached prefixes would fill the pool: only the head of the queue
/// pins its prefix, so the head fits and the running request is not starved of blocks, and
/// every request finishes. (Were every waiting request to pin its own, the head could never
/// fit, or each admitted head would be preempted to make room for the others' pins.)
#[test]
fn waiting_requests_pinning_cached_prefixes_do_not_stall_the_queue() {
    let case = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dflash/fitted");
    let loaded =
        Arc::new(LoadedModel::load(&case.join("target"), Some(WeightFormat::F32), &candle_core::Device::Cpu).unwrap());
    // 64 blocks of 16 tokens.
    let config = EngineConfig { kv_tokens: 1024, prefix_caching: true, ..EngineConfig::default() };
    let engine = Engine::start(loaded, config).unwrap();
    let finish_all = |prompts: &[Vec<u32>]| {
        let mut streams: Vec<_> =
            prompts.iter().map(|p| engine.submit(EngineRequest::new(p.clone(), params(0.0, 2))).unwrap()).collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut done = vec![false; streams.len()];
        while done.contains(&false) {
            assert!(Instant::now() < deadline, "requests stalled: {:?}", engine.snapshot());
            for (rx, done) in streams.iter_mut().zip(done.iter_mut()) {
                match rx.try_recv() {
                    Ok(EngineEvent::Done(_)) => *done = true,
                    Ok(EngineEvent::Failed(e)) => panic!("{e}"),
                    _ => {}
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    // Four first turns of 12 blocks each: their prompts stay published, 48 blocks.
    let first: Vec<Vec<u32>> = (0..4u32).map(|c| (0..192u32).map(|i| (i * 31 + c * 57 + 5) % 256).collect()).collect();
    finish_all(&first);
    // Their second turns, all at once: each attaches its 12 cached blocks and needs 19 more,
    // and 16 are left.
    let second: Vec<Vec<u32>> = first
        .iter()
        .enumerate()
        .map(|(c, p)| [p.clone(), (0..300u32).map(|i| (i * 13 + c as u32 * 7 + 1) % 256).collect()].concat())
        .collect();
    finish_all(&second);
}
