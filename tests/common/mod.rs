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

/// Writes an EAGLE-3 drafter with random weights in the published layout: width `hidden`,
/// fusing the target layers `taps` of a `target_hidden`-wide target with `vocab` tokens. With
/// `own_embedding` it carries `embed_tokens`; `draft_vocab` (target ids) gives it a reduced
/// vocabulary with its `d2t`.
pub fn write_eagle3_drafter(
    dir: &std::path::Path,
    hidden: usize,
    target_hidden: usize,
    vocab: usize,
    taps: [usize; 3],
    own_embedding: bool,
    draft_vocab: Option<&[u32]>,
    seed: u64,
) {
    use candle_core::{Device, Tensor};
    use specula::speculative::eagle3::{model, Eagle3Config};
    let n_draft = draft_vocab.map_or(vocab, |v| v.len());
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": hidden, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 2 * hidden, "vocab_size": vocab, "draft_vocab_size": n_draft,
        "target_hidden_size": target_hidden, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": taps}
    });
    let cfg = Eagle3Config::from_json(&config).unwrap();
    let mut rng = specula::sample::SamplerRng::from_seed(seed);
    let mut random = |shape: &[usize]| -> Tensor {
        let n: usize = shape.iter().product();
        let (scale, offset) = if shape.len() == 1 { (0.2, 1.0) } else { (1.7 / (shape[1] as f64).sqrt(), 0.0) };
        let v: Vec<f32> = (0..n).map(|_| (offset + (rng.next_f64() * 2.0 - 1.0) * scale) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    };
    let mut tensors: std::collections::HashMap<String, Tensor> =
        model::expected_tensors(&cfg).into_iter().map(|(name, shape)| (name, random(&shape))).collect();
    if own_embedding {
        tensors.insert("embed_tokens.weight".into(), random(&[vocab, hidden]));
    }
    if let Some(ids) = draft_vocab {
        let d2t = model::d2t_offsets(ids);
        tensors.insert("d2t".into(), Tensor::from_vec(d2t, ids.len(), &Device::Cpu).unwrap());
    }
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
}
