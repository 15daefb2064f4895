//! The step-cost curve kept between starts: a cold engine serves with a quick curve and times
//! the full one in idle time, then caches it; a warm start reads it; a damaged or foreign file
//! is measured again; the key follows the model and the threads; outputs never depend on the
//! curve. On the real SmolLM2-135M. No timing is asserted.

mod common;

use specula::engine::{Engine, EngineConfig, EngineEvent, EngineRequest, LoadedModel, StepCostOrigin};
use specula::sample::SamplingParams;
use specula::speculative::step_cost_cache::{self, StepCostKey};
use specula::speculative::{DrafterSpec, StepCost, StepCostSettings, StepCostTimer};
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

fn model() -> Arc<LoadedModel> {
    static MODEL: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            Arc::new(LoadedModel::load(&common::smollm2_path(), None, &candle_core::Device::Cpu).expect("loading"))
        })
        .clone()
}

/// The n-gram drafter with the curve from (and for) `dir`; `step_tokens` sets the full
/// curve's largest block.
fn cached_config(dir: &Path, step_tokens: usize) -> EngineConfig {
    EngineConfig {
        drafter: Some(DrafterSpec::parse("ngram").unwrap()),
        step_cost_dir: Some(dir.to_path_buf()),
        step_tokens,
        kv_tokens: 2048,
        ..EngineConfig::default()
    }
}

fn key_for(config: &EngineConfig, dir: &Path) -> StepCostKey {
    let m = model();
    let settings = StepCostSettings::up_to(config.step_tokens.clamp(config.max_draft + 1, 64));
    StepCostKey::new(&m.model, &m.path, config.kv_dtype, &settings, dir).unwrap()
}

/// A prompt whose continuation repeats itself, so that the n-gram drafter drafts.
fn prompt() -> Vec<u32> {
    model().encode_prompt("def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return").unwrap()
}

/// Greedy tokens of one request.
fn complete(engine: &Engine, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let params = SamplingParams { max_tokens: Some(max_tokens), ..SamplingParams::greedy() };
    let mut rx = engine.submit(EngineRequest::new(prompt.to_vec(), params)).unwrap();
    let mut tokens = Vec::new();
    loop {
        match rx.blocking_recv().expect("the engine ended the stream early") {
            EngineEvent::Tokens(chunk) => tokens.extend_from_slice(&chunk.ids),
            EngineEvent::Done(_) => return tokens,
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
        }
    }
}

fn wait_for_full_curve(engine: &Engine) {
    let start = Instant::now();
    while engine.step_cost_origin() != Some(StepCostOrigin::Measured) {
        assert!(start.elapsed() < Duration::from_secs(600), "the full curve was never timed");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_cold_engine_serves_at_once_refines_when_idle_and_a_warm_one_reads_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let config = cached_config(dir.path(), 32);
    let key = key_for(&config, dir.path());
    let cold = Engine::start(model(), config.clone()).unwrap();
    assert_eq!(cold.step_cost_origin(), Some(StepCostOrigin::Quick));
    assert_eq!(cold.step_cost().unwrap().points().len(), 5, "1, 2, 4, 8 and 16 rows");
    // A request submitted now is served with the quick curve (the full one's 10 sizes in 9
    // rounds take far longer than 24 tokens), between two timings.
    let tokens = complete(&cold, &prompt(), 24);
    assert_eq!(tokens.len(), 24);
    assert_eq!(cold.step_cost_origin(), Some(StepCostOrigin::Quick), "served before the refinement ended");
    wait_for_full_curve(&cold);
    let full = cold.step_cost().unwrap();
    assert_eq!(full.measured().iter().map(|p| p.0).collect::<Vec<_>>(), key.sizes);
    // Served with the full curve too.
    assert_eq!(complete(&cold, &prompt(), 24), tokens);
    drop(cold);

    let cached = step_cost_cache::load(dir.path(), &key).unwrap().expect("the full curve is cached");
    assert_eq!(cached, *full);
    let warm = Engine::start(model(), config).unwrap();
    assert_eq!(warm.step_cost_origin(), Some(StepCostOrigin::Cached));
    assert_eq!(*warm.step_cost().unwrap(), *full);
    assert_eq!(complete(&warm, &prompt(), 24), tokens);

    // Asked to measure again: the cache is not read, and is replaced once timed.
    let again =
        Engine::start(model(), EngineConfig { remeasure_step_cost: true, ..cached_config(dir.path(), 32) }).unwrap();
    assert_eq!(again.step_cost_origin(), Some(StepCostOrigin::Quick));
    wait_for_full_curve(&again);
    assert_eq!(step_cost_cache::load(dir.path(), &key).unwrap().as_ref(), Some(&*again.step_cost().unwrap()));
}

#[test]
fn a_damaged_truncated_or_foreign_cache_file_is_ignored_and_measured_again() {
    let dir = tempfile::tempdir().unwrap();
    let config = cached_config(dir.path(), 16);
    let key = key_for(&config, dir.path());
    let path = key.path_in(dir.path());
    // A valid file of another key (more threads), copied over this key's file.
    let foreign_key = StepCostKey { threads: key.threads + 1, ..key.clone() };
    let measured: Vec<(usize, f64)> = key.sizes.iter().map(|&m| (m, 0.01 + 0.001 * m as f64)).collect();
    let foreign_path =
        step_cost_cache::save(dir.path(), &foreign_key, &StepCost::from_measured(measured), 1.0).unwrap();
    let foreign = std::fs::read(&foreign_path).unwrap();
    let valid_looking = String::from_utf8(foreign.clone()).unwrap();
    let damaged: Vec<Vec<u8>> = vec![
        foreign,
        Vec::new(),
        valid_looking.as_bytes()[..valid_looking.len() / 2].to_vec(),
        b"\xff\xfe not json".to_vec(),
        vec![b' '; 1 << 20],
    ];
    for bytes in &damaged {
        std::fs::write(&path, bytes).unwrap();
        assert!(step_cost_cache::load(dir.path(), &key).is_err());
        let engine = Engine::start(model(), config.clone()).unwrap();
        assert_eq!(engine.step_cost_origin(), Some(StepCostOrigin::Quick), "{:.60}", String::from_utf8_lossy(bytes));
        assert_eq!(complete(&engine, &prompt(), 8).len(), 8);
    }
    // The last engine's refinement replaces the damaged file with a good one.
    let engine = Engine::start(model(), config.clone()).unwrap();
    wait_for_full_curve(&engine);
    drop(engine);
    assert!(step_cost_cache::load(dir.path(), &key).unwrap().is_some());
    assert_eq!(Engine::start(model(), config).unwrap().step_cost_origin(), Some(StepCostOrigin::Cached));
}

#[test]
fn the_key_follows_the_model_the_threads_and_the_kv_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let settings = StepCostSettings::up_to(16);
    let key = StepCostKey::new(&m.model, &m.path, specula::kv::KvDtype::F16, &settings, dir.path()).unwrap();
    // The fetched model's hash comes from the fetcher's marker: nothing hashed or remembered.
    assert!(!dir.path().join("sha256").exists());
    let same = StepCostKey::new(&m.model, &m.path, specula::kv::KvDtype::F16, &settings, dir.path()).unwrap();
    assert_eq!(key.file_name(), same.file_name());
    let threads = StepCostKey { threads: key.threads + 1, ..key.clone() };
    assert_ne!(threads.file_name(), key.file_name());
    let f32_kv = StepCostKey::new(&m.model, &m.path, specula::kv::KvDtype::F32, &settings, dir.path()).unwrap();
    assert_ne!(f32_kv.file_name(), key.file_name());
    // Another model file (here: other bytes under another path) is another key, its hash
    // computed once and remembered.
    let other = dir.path().join("other.gguf");
    std::fs::write(&other, b"another model's bytes").unwrap();
    let other_key = StepCostKey::new(&m.model, &other, specula::kv::KvDtype::F16, &settings, dir.path()).unwrap();
    assert_ne!(other_key.model_sha256, key.model_sha256);
    assert_ne!(other_key.file_name(), key.file_name());
    assert_eq!(std::fs::read_dir(dir.path().join("sha256")).unwrap().count(), 1);
    // A curve cached for one key is not found under the others.
    let measured: Vec<(usize, f64)> = key.sizes.iter().map(|&m| (m, 0.01 + 0.001 * m as f64)).collect();
    step_cost_cache::save(dir.path(), &key, &StepCost::from_measured(measured), 1.0).unwrap();
    for k in [&threads, &f32_kv, &other_key] {
        assert!(step_cost_cache::load(dir.path(), k).unwrap().is_none());
    }
    assert!(step_cost_cache::load(dir.path(), &key).unwrap().is_some());
}

#[test]
fn outputs_are_the_same_with_the_quick_and_the_full_curve() {
    let m = model();
    let full = StepCostSettings::up_to(16);
    let mut timer = StepCostTimer::new(&m.model, &StepCostSettings::quick(&full), specula::kv::KvDtype::F16).unwrap();
    while !timer.advance().unwrap() {}
    let quick = Arc::new(timer.finish());
    let full = Arc::new(StepCost::measure(&m.model, &full).unwrap());
    let prompt = prompt();
    let run = |drafter: Option<&str>, cost: Option<Arc<StepCost>>| {
        let config = EngineConfig {
            drafter: drafter.map(|d| DrafterSpec::parse(d).unwrap()),
            step_cost: cost,
            kv_tokens: 2048,
            ..EngineConfig::default()
        };
        complete(&Engine::start(model(), config).unwrap(), &prompt, 48)
    };
    let plain = run(None, None);
    assert_eq!(run(Some("ngram"), Some(quick)), plain);
    assert_eq!(run(Some("ngram"), Some(full)), plain);
}
