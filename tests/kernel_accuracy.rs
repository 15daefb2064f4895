//! The default weight path against exact arithmetic: SmolLM2-135M's Q4_1/Q8_0 and Gemma 3's k-quant weights on
//! our kernels vs the same weights dequantised to f32, teacher-forced over prompt + llama.cpp's
//! greedy tokens (definitions in `specula::model::accuracy`; docs/kernels.md has the tables
//! and the commands that reproduce them).

use specula::engine::LoadedModel;
use specula::model::accuracy::{teacher_forced_logprobs, Agreement};
use specula::model::WeightFormat;
use std::path::PathBuf;

struct Case {
    prompt: String,
    tokens: Vec<u32>,
    /// llama.cpp's log-prob of each of its (greedy) tokens.
    llama_lp: Vec<f32>,
}

/// `which` picks results by index from a greedy-reference file (all when empty).
fn cases(file: &str, which: &[usize]) -> Vec<Case> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(file);
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let results: Vec<&serde_json::Value> = json["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["mode"] == "completion" && !r["top3"].is_null())
        .collect();
    let picked: Vec<usize> = if which.is_empty() { (0..results.len()).collect() } else { which.to_vec() };
    picked
        .into_iter()
        .map(|i| {
            let r = results[i];
            Case {
                prompt: r["prompt"].as_str().unwrap().to_string(),
                tokens: r["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect(),
                llama_lp: r["top3"].as_array().unwrap().iter().map(|t| t[0][1].as_f64().unwrap() as f32).collect(),
            }
        })
        .collect()
}

/// The default weights' and llama.cpp's agreement with `--weights f32` on `cases` (teacher
/// forced over prompt + llama.cpp's tokens).
fn agreements(model: &str, cases: &[Case]) -> (Agreement, Agreement) {
    let path = specula::fetch::resolve_model(model, false).unwrap_or_else(|e| panic!("fetching {model}: {e:#}"));
    let device = candle_core::Device::Cpu;
    let exact = LoadedModel::load(&path, Some(WeightFormat::F32), &device).unwrap();
    let default = LoadedModel::load(&path, None, &device).unwrap();
    let (mut ours, mut llama) = (Agreement::default(), Agreement::default());
    for c in cases {
        let prompt = exact.encode_prompt(&c.prompt).unwrap();
        let f32_rows = teacher_forced_logprobs(&exact.model, &prompt, &c.tokens).unwrap();
        let rows = teacher_forced_logprobs(&default.model, &prompt, &c.tokens).unwrap();
        for ((row, f32_row), (&t, &lp)) in rows.iter().zip(&f32_rows).zip(c.tokens.iter().zip(&c.llama_lp)) {
            ours.add_row(row, f32_row, t);
            llama.add(t, lp, f32_row, t);
        }
    }
    (ours, llama)
}

#[test]
fn smollm2_default_weights_stay_within_f32_rounding_of_exact_arithmetic() {
    // The three reference prompts, and five held-out ones where one-level (llama.cpp's)
    // activation quantisation put our greedy output off f32's or moved a log-prob by 0.2-0.5
    // nats ("My favourite food is", "Photosynthesis is the process", "To make a cup of tea,",
    // "The weather today is", "The cat sat on the").
    let mut all = cases("llamacpp-greedy/SmolLM2-135M-Instruct.Q4_1.json", &[]);
    all.extend(cases("kernel-accuracy/smollm2-135m.json", &[5, 8, 11, 17, 25]));
    let (ours, llama) = agreements("smollm2-135m", &all);
    eprintln!("default vs f32: {ours:?}, mean {:.5}", ours.mean_abs());
    eprintln!("llama.cpp vs f32: {llama:?}, mean {:.5}", llama.mean_abs());
    assert_eq!(ours.steps, 232);
    // Measured (8 prompts, 232 steps): every argmax the same as f32's, max |Δ log-prob| 0.0027,
    // mean 0.0004, all f32 rounding once activations carry two 8-bit levels. One level, as
    // llama.cpp's arithmetic, measured 0.21-0.48 max and 0.03-0.05 mean. The bounds are ~4×
    // the measured values: far below one level's noise, above any reordering of f32 sums.
    assert_eq!(ours.top1_same, ours.steps, "default's argmax differs from f32's");
    assert!(ours.max_abs < 0.01, "max |Δ log-prob| {} against f32", ours.max_abs);
    assert!(ours.mean_abs() < 0.0015, "mean |Δ log-prob| {} against f32", ours.mean_abs());
    // And no worse than llama.cpp on the same steps (measured: 0.30 max, 0.040 mean).
    assert!(ours.max_abs <= llama.max_abs && ours.mean_abs() <= llama.mean_abs());
}

/// Gemma 3 270M's Q4_K_M file: Q5_0/Q8_0 and the k-quants (Q4_K, Q6_K) all on our kernels,
/// against f32 on the same weights, over the 8 prompts of its llama.cpp reference.
#[test]
fn gemma3_k_quant_weights_stay_within_f32_rounding_of_exact_arithmetic() {
    let (ours, llama) = agreements("gemma3-270m", &cases("llamacpp-greedy/gemma-3-270m-q4_k_m.json", &[]));
    eprintln!("default vs f32: {ours:?}, mean {:.5}", ours.mean_abs());
    eprintln!("llama.cpp vs f32: {llama:?}, mean {:.5}", llama.mean_abs());
    assert_eq!(ours.steps, 256);
    // Measured: every argmax the same as f32's, max 0.0028, mean 0.0002 (llama.cpp: 253 of
    // 256, 0.19 max, 0.033 mean). With candle's one-level k-quant kernels it was 247 of 256
    // and 0.23 max.
    assert_eq!(ours.top1_same, ours.steps, "default's argmax differs from f32's");
    assert!(ours.max_abs < 0.01, "max |Δ log-prob| {} against f32", ours.max_abs);
    assert!(ours.mean_abs() < 0.0015, "mean |Δ log-prob| {} against f32", ours.mean_abs());
    assert!(ours.max_abs <= llama.max_abs && ours.mean_abs() <= llama.mean_abs());
}
