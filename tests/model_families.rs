//! Architecture features checked against independent implementations: Llama 3 RoPE scaling
//! against Hugging Face transformers (fixture `tests/fixtures/llama3-rope/`, made by
//! `tools/llama3_rope_reference/make_fixture.py`), in a Hugging Face directory and in the GGUF
//! written from it (its `rope_freqs` tensor, as llama.cpp's converter writes it).

mod common;

use candle_core::quantized::GgmlDType;
use specula::kv::KvDtype;
use specula::model::{ForwardBatch, LogitsRows, Transformer, WeightFormat};
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama3-rope")
}

/// Logits of every row of one forward over `ids` (f32 KV cache, as the reference).
fn all_logits(model: &Transformer, ids: &[u32]) -> Vec<Vec<f32>> {
    let pool = model.new_kv_pool_typed(ids.len().next_multiple_of(16), KvDtype::F32);
    let mut cache = pool.new_sequence();
    let mut batch = ForwardBatch::new();
    batch.push(ids, &mut cache, LogitsRows::All);
    model.forward(&mut batch).unwrap().seq_logits(0).unwrap()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
}

fn load(path: &Path) -> Transformer {
    Transformer::from_path(path, Some(WeightFormat::F32), &candle_core::Device::Cpu).unwrap()
}

#[test]
fn llama3_rope_scaling_matches_transformers_in_both_formats() {
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture().join("expected.json")).unwrap()).unwrap();
    let ids: Vec<u32> = expected["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let want: Vec<Vec<f32>> = expected["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect();

    let hf = load(&fixture());
    let rope = hf.config.extras.llama3_rope.expect("rope_scaling read from config.json");
    assert_eq!((rope.factor, rope.original_context), (8.0, 64.0));
    let got = all_logits(&hf, &ids);
    let worst = max_diff(&got, &want);
    assert!(worst < 1e-4, "Hugging Face directory: logits differ from transformers by {worst}");

    // The same weights as a GGUF (q/k rows permuted, frequencies from `rope_freqs.weight`).
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("llama3.gguf");
    common::write_gguf_from_hf(&fixture(), "llama", GgmlDType::F32, &gguf);
    let from_gguf = all_logits(&load(&gguf), &ids);
    let worst = max_diff(&from_gguf, &want);
    assert!(worst < 1e-4, "GGUF: logits differ from transformers by {worst}");

    // The check has teeth: without the scaling the logits are far off.
    let plain = tmp.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap();
    config["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 500000.0});
    std::fs::write(plain.join("config.json"), serde_json::to_vec(&config).unwrap()).unwrap();
    std::fs::copy(fixture().join("model.safetensors"), plain.join("model.safetensors")).unwrap();
    let unscaled = all_logits(&load(&plain), &ids);
    assert!(max_diff(&unscaled, &want) > 1e-2, "RoPE scaling made no difference");
}

#[test]
fn unsupported_rope_scaling_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap();
    config["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0});
    std::fs::write(tmp.path().join("config.json"), serde_json::to_vec(&config).unwrap()).unwrap();
    std::fs::copy(fixture().join("model.safetensors"), tmp.path().join("model.safetensors")).unwrap();
    let err = Transformer::from_path(tmp.path(), Some(WeightFormat::F32), &candle_core::Device::Cpu)
        .err()
        .expect("yarn scaling should be refused")
        .to_string();
    assert!(err.contains("unsupported rope_scaling type `yarn`"), "{err}");
}

/// A GGUF whose tensors disagree with its configuration is refused at load, naming the tensor:
/// an LM head of the wrong width, a norm of the wrong length.
#[test]
fn tensors_that_disagree_with_the_config_are_refused_by_name() {
    use candle_core::quantized::{gguf_file, QTensor};
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good.gguf");
    common::write_gguf_from_hf(&fixture(), "llama", GgmlDType::F32, &good);
    let rewrite = |replace: &str, shape: &[usize], out: &Path| {
        let mut file = std::fs::File::open(&good).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        for name in content.tensor_infos.keys() {
            let t = if name == replace {
                let zeros =
                    candle_core::Tensor::zeros(shape, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
                QTensor::quantize(&zeros, GgmlDType::F32).unwrap()
            } else {
                content.tensor(&mut file, name, &candle_core::Device::Cpu).unwrap()
            };
            tensors.push((name.clone(), t));
        }
        let meta: Vec<(&str, &gguf_file::Value)> = content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut std::fs::File::create(out).unwrap(), &meta, &refs).unwrap();
    };
    for (name, shape, needle) in [
        ("output.weight", vec![256, 96], "LM head is 256 × 96, expected 256 × 64"),
        ("blk.1.ffn_norm.weight", vec![32], "blk.1.ffn_norm.weight: shape [32], expected [64]"),
        ("output_norm.weight", vec![64, 2], "output_norm.weight: shape [64, 2], expected [64]"),
    ] {
        let bad = tmp.path().join("bad.gguf");
        rewrite(name, &shape, &bad);
        let err = Transformer::from_path(&bad, None, &candle_core::Device::Cpu).err().expect(name);
        assert!(format!("{err:#}").contains(needle), "{name}: {err:#}");
    }
}
