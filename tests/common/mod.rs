//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

/// The real SmolLM2-135M, fetched on first use (CI's `.ci/run` fetches it beforehand).
pub fn smollm2_path() -> PathBuf {
    specula::fetch::resolve_model("smollm2-135m", false).expect("fetching smollm2-135m")
}

pub fn reference_dir() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let candidates = [here.join("../shared/reference/llamacpp-greedy"), here.join("shared/reference/llamacpp-greedy")];
    candidates.into_iter().find(|p| p.exists()).expect("../shared/reference/llamacpp-greedy not found")
}
