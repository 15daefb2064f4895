//! Bad input gives one clear error line and a non-zero exit, never a panic.

mod common;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use std::path::Path;
use std::process::Command;

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_specula")).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts a failed run whose stderr is exactly one `error:` line containing `needle`.
fn assert_clean_error(args: &[&str], needle: &str) {
    let (code, _, err) = run(args);
    assert_ne!(code, 0, "{args:?} should fail");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?} should print one line, got: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(lines[0].contains(needle), "{args:?}: expected `{needle}` in `{}`", lines[0]);
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn missing_model_file() {
    assert_clean_error(
        &["generate", "-m", "/nonexistent/model.gguf", "-p", "hi"],
        "neither an existing file nor a known model",
    );
}

#[test]
fn file_that_is_not_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("notes.gguf");
    std::fs::write(&p, "this is a text file, not a model\n").unwrap();
    assert_clean_error(&["generate", "-m", path_str(&p), "-p", "hi"], "not a GGUF file");
    assert_clean_error(&["inspect", path_str(&p)], "not a GGUF file");
}

#[test]
fn truncated_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let real = std::fs::read(common::smollm2_path()).unwrap();
    // Cut inside the tensor data, and inside the header.
    for (name, len, needle) in [("data.gguf", real.len() / 2, "truncated"), ("head.gguf", 100_000, "truncated")] {
        let p = dir.path().join(name);
        std::fs::write(&p, &real[..len]).unwrap();
        assert_clean_error(&["generate", "-m", path_str(&p), "-p", "hi"], needle);
    }
    let p = dir.path().join("tiny.gguf");
    std::fs::write(&p, &real[..64]).unwrap();
    assert_clean_error(&["generate", "-m", path_str(&p), "-p", "hi"], "corrupt or truncated");
}

#[test]
fn unknown_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("mamba.gguf");
    let w = QTensor::quantize(
        &Tensor::zeros((4, 8), candle_core::DType::F32, &Device::Cpu).unwrap(),
        candle_core::quantized::GgmlDType::F32,
    )
    .unwrap();
    let arch = Value::String("mamba".into());
    let mut f = std::fs::File::create(&p).unwrap();
    gguf_file::write(&mut f, &[("general.architecture", &arch)], &[("token_embd.weight", &w)]).unwrap();
    drop(f);
    assert_clean_error(&["generate", "-m", path_str(&p), "-p", "hi"], "unsupported architecture `mamba`");
}

#[test]
fn prompt_longer_than_the_context() {
    let long = "word ".repeat(400);
    let model = path_str(&common::smollm2_path()).to_string();
    assert_clean_error(&["generate", "-m", &model, "--kv-tokens", "64", "-p", &long], "context");
}

#[test]
fn bad_arguments() {
    let model = path_str(&common::smollm2_path()).to_string();
    assert_clean_error(&["generate", "-m", &model, "-p", "hi", "--top-p", "0"], "top_p");
    assert_clean_error(&["generate", "-m", &model, "-p", "hi", "--weights", "q3"], "unknown weight format");
    assert_clean_error(&["generate", "-m", &model, "--prompt-ids", "1,999999"], "outside the vocabulary");
    // Checked before the model is loaded: the missing file is never reached.
    assert_clean_error(
        &["generate", "-m", "/nonexistent/model.gguf", "-p", "hi", "--drafter", "bogus"],
        "unknown drafter",
    );
    assert_clean_error(&["generate", "-m", "/nonexistent/model.gguf"], "no prompt");
}

/// A tensor dimension set to 2^63 in SmolLM2's header: the element count wraps to 0 in
/// unchecked arithmetic, which passed the bounds check and later sized an allocation (capacity
/// overflow) or a slice (out of range) — panics found by mutating header fields.
#[test]
fn tensor_dimensions_that_overflow() {
    let dir = tempfile::tempdir().unwrap();
    let real = std::fs::read(common::smollm2_path()).unwrap();
    let head = &real[..real.len().min(4 << 20)];
    for (tensor, dims) in [("blk.28.ffn_norm.weight", vec![576u64]), ("blk.12.ffn_down.weight", vec![1536, 576])] {
        // The tensor info: name, number of dimensions, the dimensions.
        let mut pattern = (tensor.len() as u64).to_le_bytes().to_vec();
        pattern.extend_from_slice(tensor.as_bytes());
        pattern.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in &dims {
            pattern.extend_from_slice(&d.to_le_bytes());
        }
        let at = head.windows(pattern.len()).position(|w| w == pattern).unwrap_or_else(|| panic!("{tensor} info"));
        let last_dim = at + pattern.len() - 8;
        let mut bad = real.clone();
        bad[last_dim..last_dim + 8].copy_from_slice(&(1u64 << 63).to_le_bytes());
        let p = dir.path().join(format!("{tensor}.gguf"));
        std::fs::write(&p, &bad).unwrap();
        assert_clean_error(&["generate", "-m", path_str(&p), "-p", "hi"], "impossible dimensions");
        assert_clean_error(&["inspect", path_str(&p)], "impossible dimensions");
    }
}

/// `general.alignment` = 0: candle's header reader divides by it (a panic); refused first.
#[test]
fn zero_alignment() {
    use candle_core::quantized::gguf_file::{write, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("aligned-to-zero.gguf");
    let t = QTensor::quantize(
        &candle_core::Tensor::zeros((2, 32), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(),
        GgmlDType::F32,
    )
    .unwrap();
    let arch = Value::String("llama".into());
    let zero = Value::U32(0);
    write(
        &mut std::fs::File::create(&p).unwrap(),
        &[("general.architecture", &arch), ("general.alignment", &zero)],
        &[("token_embd.weight", &t)],
    )
    .unwrap();
    assert_clean_error(&["inspect", path_str(&p)], "general.alignment");
    assert_clean_error(&["generate", "-m", path_str(&p), "-p", "hi"], "general.alignment");
}
