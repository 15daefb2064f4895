//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// The real SmolLM2-135M, fetched into the model cache on first use (once per test process;
/// concurrent processes wait for each other through the fetch's file lock).
pub fn smollm2_path() -> PathBuf {
    specula::fetch::fetch_once("smollm2-135m", true).unwrap_or_else(|e| panic!("fetching smollm2-135m: {e:#}"))
}

/// An optional model (the Qwen ones are large and never fetched by the tests): its path when
/// it is already in the cache, else `None` and a line saying the test is skipped.
pub fn optional_model(key: &str) -> Option<PathBuf> {
    let asset = specula::fetch::find_asset(key).unwrap_or_else(|| panic!("unknown model {key}"));
    if !asset.path().is_file() {
        eprintln!("SKIPPED: optional model {key} is not in the cache (`specula fetch {key}` to run this test)");
        return None;
    }
    Some(specula::fetch::fetch_once(key, true).unwrap_or_else(|e| panic!("verifying {key}: {e:#}")))
}

/// llama.cpp's greedy reference outputs, kept in the repository (see the README there).
pub fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llamacpp-greedy")
}
