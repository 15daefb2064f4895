//! Our forward against llama.cpp's greedy outputs on the same GGUF file.
//! Qwen models: `SPECULA_PARITY_MODELS=qwen2.5-coder-0.5b,qwen2.5-coder-1.5b cargo test --release --test reference_parity -- --ignored`.

mod common;

use specula::engine::LoadedModel;
use specula::model::{ForwardBatch, LogitsRows, WeightFormat};
use specula::sample::log_softmax;

struct Step {
    token: u32,
    top: Vec<(u32, f32)>,
}

struct Case {
    prompt: String,
    /// llama.cpp's prompt length in tokens, where the file records it.
    prompt_tokens: Option<usize>,
    steps: Vec<Step>,
}

fn reference_cases(file: &str) -> Vec<Case> {
    let path = common::reference_dir().join(file);
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    json["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["mode"] == "completion")
        .map(|r| Case {
            prompt: r["prompt"].as_str().unwrap().to_string(),
            prompt_tokens: r["prompt_tokens"].as_u64().map(|n| n as usize),
            steps: r["token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .zip(r["top3"].as_array().unwrap())
                .map(|(t, top)| Step {
                    token: t.as_u64().unwrap() as u32,
                    top: top
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
                        .collect(),
                })
                .collect(),
        })
        .collect()
}

/// How far apart two candidates may be and still count as a near-tie, where a different greedy
/// pick is legitimate. llama.cpp's log-probs carry its 8-bit activation noise: against exact
/// f32 arithmetic on the same file it is off by up to 0.19 nats on these prompts, and our
/// default path (two-level activations) by 0.003 (docs/kernels.md). At "Once upon a time" step 4
/// llama.cpp prefers its token by 0.19 nats where exact arithmetic prefers the other by 0.16;
/// so a different pick is legitimate within llama.cpp's own error, 0.19 + margin.
const NEAR_TIE_NATS: f32 = 0.25;

/// Teacher-forced comparison: one forward over prompt + llama.cpp's 24 tokens, logits for every
/// row. At each step our argmax must be llama.cpp's token unless the two were within
/// [`NEAR_TIE_NATS`]; the log-prob differences are bounded on average and per step below.
fn check_model(key_or_path: &str, reference_file: &str, weights: WeightFormat) {
    check_model_within(key_or_path, reference_file, weights, 0.25)
}

/// [`check_model`] with a per-step cap on |Δ log-prob| other than 0.25.
fn check_model_within(key_or_path: &str, reference_file: &str, weights: WeightFormat, max_diff: f32) {
    let path = specula::fetch::resolve_model(key_or_path, false).unwrap();
    let loaded = LoadedModel::load(&path, Some(weights), &candle_core::Device::Cpu).unwrap();
    let pool = loaded.model.new_kv_pool(1024);
    let (mut worst, mut sum, mut n, mut within) = (0f32, 0f32, 0usize, 0usize);
    for case in reference_cases(reference_file) {
        let prompt = loaded.encode_prompt(&case.prompt).unwrap();
        if let Some(n) = case.prompt_tokens {
            assert_eq!(prompt.len(), n, "{key_or_path} {:?}: prompt length in tokens", case.prompt);
        }
        let mut input = prompt.clone();
        input.extend(case.steps.iter().map(|s| s.token));
        let mut cache = pool.new_sequence();
        let mut batch = ForwardBatch::new();
        batch.push(&input, &mut cache, LogitsRows::All);
        let out = loaded.model.forward(&mut batch).unwrap();
        let rows = out.seq_logits(0).unwrap();
        for (i, step) in case.steps.iter().enumerate() {
            let lp = log_softmax(&rows[prompt.len() - 1 + i]);
            let ours_top = specula::sample::argmax(&lp);
            let theirs = step.top[0].1;
            // A different pick is legitimate when the two candidates are within a near-tie,
            // by llama.cpp's numbers or by ours.
            let near_tie = (step.top.len() > 1 && (step.top[0].1 - step.top[1].1) < NEAR_TIE_NATS)
                || (lp[ours_top as usize] - lp[step.token as usize]) < NEAR_TIE_NATS;
            let diff = (lp[step.token as usize] - theirs).abs();
            if std::env::var("SPECULA_PARITY_VERBOSE").is_ok() {
                eprintln!(
                    "{i:2} ours {ours_top} {:.4} theirs {} {theirs:.4} diff {diff:.4}",
                    lp[ours_top as usize], step.token
                );
            }
            assert!(
                ours_top == step.token || near_tie,
                "{key_or_path} {:?} step {i}: our argmax {ours_top} (lp {}) vs llama.cpp {} (lp {theirs})",
                case.prompt,
                lp[ours_top as usize],
                step.token
            );
            worst = worst.max(diff);
            sum += diff;
            n += 1;
            within += (diff < 0.05) as usize;
        }
    }
    let mean = sum / n.max(1) as f32;
    eprintln!("{key_or_path}: {n} steps, {within} within 0.05 nats, mean |Δ log-prob| {mean:.4}, max {worst:.4}");
    // Kernels differ in rounding (candle's activation quantisation, llama.cpp's flash-attention
    // accumulation), and a 30-layer model turns 1e-3 relative noise into ~0.03 nats; so the bound
    // is on the mean, with a looser cap per step. docs/performance.md reports the numbers.
    assert!(mean < 0.05, "{key_or_path}: mean log-prob difference {mean}");
    assert!(worst < max_diff, "{key_or_path}: max log-prob difference {worst}");
}

#[test]
fn smollm2_matches_llamacpp_teacher_forced() {
    let w = std::env::var("SPECULA_PARITY_WEIGHTS")
        .ok()
        .map(|w| WeightFormat::parse(&w).unwrap())
        .unwrap_or(WeightFormat::Native);
    check_model("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.json", w);
}

/// Gemma 3 (sliding-window layers, post-norms, GELU, SentencePiece vocabulary) on 8 prompts
/// of our own (`tests/fixtures/llamacpp-greedy/gemma3-prompts.txt`, 32 greedy tokens each from
/// llama.cpp, `tools/llamacpp_reference/greedy.py`). Prompt token counts must match too.
#[test]
fn gemma3_matches_llamacpp_teacher_forced() {
    check_model("gemma3-270m", "gemma-3-270m-q4_k_m.json", WeightFormat::Native);
}

/// A 781-token prompt: the windowed layers (512 positions) must forget its start exactly as
/// llama.cpp's do. The per-step cap is wider: on this prompt llama.cpp is 0.33 nats from exact
/// f32 arithmetic at its worst step, and our default path 0.002 (docs/kernels.md).
#[test]
fn gemma3_long_prompt_matches_llamacpp_past_the_window() {
    check_model_within("gemma3-270m", "gemma-3-270m-q4_k_m-long.json", WeightFormat::Native, 0.40);
}

#[test]
#[ignore = "needs the Qwen models (specula fetch qwen2.5-coder-0.5b qwen2.5-coder-1.5b)"]
fn qwen_matches_llamacpp_teacher_forced() {
    let wanted = std::env::var("SPECULA_PARITY_MODELS").unwrap_or("qwen2.5-coder-0.5b,qwen2.5-coder-1.5b".into());
    for key in wanted.split(',') {
        let file = match key {
            "qwen2.5-coder-0.5b" => "qwen2.5-coder-0.5b-instruct-q4_k_m.json",
            "qwen2.5-coder-1.5b" => "qwen2.5-coder-1.5b-instruct-q4_k_m.json",
            other => panic!("no reference for {other}"),
        };
        check_model(key, file, WeightFormat::Native);
    }
}
