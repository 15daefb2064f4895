//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod fuzz;

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
    let mut random = |shape: &[usize]| random_weight(&mut rng, shape);
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

/// Writes a Hugging Face model directory (`config.json` + safetensors) as a GGUF file of the
/// given architecture (`qwen3` or `llama`), its weight matrices as `matrices` (f32 or a
/// quantised type) and everything else f32: the metadata llama.cpp's converter writes for
/// these architectures, Llama's q/k rows permuted to the GGUF layout (adjacent pairs rotate
/// together), and Llama 3 RoPE scaling as the `rope_freqs` tensor.
pub fn write_gguf_from_hf(
    hf_dir: &std::path::Path,
    arch: &str,
    matrices: candle_core::quantized::GgmlDType,
    out: &std::path::Path,
) {
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::{GgmlDType, QTensor};
    use specula::model::{HfModelDir, TensorSource};
    let device = candle_core::Device::Cpu;
    let mut dir = HfModelDir::open(hf_dir).unwrap();
    let c = dir.config().unwrap();
    let mut names = vec!["token_embd.weight".to_string(), "output_norm.weight".to_string()];
    if !c.tied_head {
        names.push("output.weight".into());
    }
    for i in 0..c.n_layers {
        for part in
            ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
        {
            names.push(format!("blk.{i}.{part}.weight"));
        }
        if c.qk_norm {
            names.push(format!("blk.{i}.attn_q_norm.weight"));
            names.push(format!("blk.{i}.attn_k_norm.weight"));
        }
    }
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for name in &names {
        let mut t = dir.qtensor(name, &device).unwrap().dequantize(&device).unwrap();
        let heads = if name.ends_with("attn_q.weight") {
            Some(c.n_heads)
        } else if name.ends_with("attn_k.weight") {
            Some(c.n_kv_heads)
        } else {
            None
        };
        if let (Some(heads), "llama") = (heads, arch) {
            // HF rotates the two halves of each head; GGUF llama rotates adjacent pairs.
            let (rows, cols) = t.dims2().unwrap();
            t = t
                .reshape((heads, 2, rows / heads / 2, cols))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
                .reshape((rows, cols))
                .unwrap();
        }
        let dtype = if t.rank() == 2 { matrices } else { GgmlDType::F32 };
        tensors.push((name.clone(), QTensor::quantize(&t, dtype).unwrap()));
    }
    if let Some(r) = c.extras.llama3_rope {
        let divisors = r.freq_divisors(c.rope_theta, c.rope_dim);
        let n = divisors.len();
        let t = candle_core::Tensor::from_vec(divisors, n, &device).unwrap();
        tensors.push(("rope_freqs.weight".into(), QTensor::quantize(&t, GgmlDType::F32).unwrap()));
    }
    let u32v = |v: usize| Value::U32(v as u32);
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.block_count"), u32v(c.n_layers)),
        (format!("{arch}.context_length"), u32v(c.context_len)),
        (format!("{arch}.embedding_length"), u32v(c.hidden)),
        (format!("{arch}.feed_forward_length"), u32v(c.ffn)),
        (format!("{arch}.attention.head_count"), u32v(c.n_heads)),
        (format!("{arch}.attention.head_count_kv"), u32v(c.n_kv_heads)),
        (format!("{arch}.attention.key_length"), u32v(c.head_dim)),
        (format!("{arch}.attention.value_length"), u32v(c.head_dim)),
        (format!("{arch}.rope.freq_base"), Value::F32(c.rope_theta)),
        (format!("{arch}.rope.dimension_count"), u32v(c.rope_dim)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(c.rms_eps as f32)),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(out).unwrap();
    candle_core::quantized::gguf_file::write(&mut file, &meta_refs, &tensor_refs).unwrap();
}

/// Writes a DFlash drafter with random weights in the z-lab layout for a `hidden`-wide target
/// of `target_layers` layers: blocks of `block`, taps `layer_ids`, MASK id `mask`. With
/// `draft_vocab` (target ids) it drafts only those tokens (`draft_vocab_size` + `d2t`).
#[allow(clippy::too_many_arguments)]
pub fn write_dflash_drafter(
    dir: &std::path::Path,
    hidden: usize,
    target_layers: usize,
    layer_ids: &[usize],
    mask: usize,
    block: usize,
    draft_vocab: Option<&[u32]>,
    seed: u64,
) {
    use candle_core::{Device, Tensor};
    use specula::speculative::dflash::{expected_tensors, DflashConfig};
    let mut dflash = serde_json::json!({"mask_token_id": mask, "target_layer_ids": layer_ids});
    if let Some(ids) = draft_vocab {
        dflash["draft_vocab_size"] = ids.len().into();
    }
    let config = serde_json::json!({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 2 * hidden, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "block_size": block,
        "num_target_layers": target_layers, "dflash_config": dflash
    });
    let cfg = DflashConfig::from_json(&config).unwrap();
    let mut rng = specula::sample::SamplerRng::from_seed(seed);
    let mut random = |shape: &[usize]| random_weight(&mut rng, shape);
    let mut tensors: std::collections::HashMap<String, Tensor> =
        expected_tensors(&cfg).into_iter().map(|(name, shape)| (name, random(&shape))).collect();
    if let Some(ids) = draft_vocab {
        let d2t: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        tensors.insert("d2t".into(), Tensor::from_vec(d2t, ids.len(), &Device::Cpu).unwrap());
    }
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
}

/// A random drafter weight: norms near one, matrices scaled by their input width.
fn random_weight(rng: &mut specula::sample::SamplerRng, shape: &[usize]) -> candle_core::Tensor {
    let n: usize = shape.iter().product();
    let (scale, offset) = if shape.len() == 1 { (0.2, 1.0) } else { (1.7 / (shape[1] as f64).sqrt(), 0.0) };
    let v: Vec<f32> = (0..n).map(|_| (offset + (rng.next_f64() * 2.0 - 1.0) * scale) as f32).collect();
    candle_core::Tensor::from_vec(v, shape, &candle_core::Device::Cpu).unwrap()
}

/// Samples each draft token from a fixed distribution `q` (not the target's), reporting `q`:
/// exercises the verifier's non-one-hot path.
pub struct StochasticDrafter {
    pub rng: specula::sample::SamplerRng,
    pub q: Vec<f32>,
}

impl specula::speculative::Proposer for StochasticDrafter {
    fn name(&self) -> &str {
        "stochastic"
    }
    fn begin(&mut self, _prompt: &[u32]) -> anyhow::Result<()> {
        Ok(())
    }
    fn observe(
        &mut self,
        _tokens: &[u32],
        _cached: std::ops::Range<usize>,
        _taps: &[candle_core::Tensor],
    ) -> anyhow::Result<()> {
        Ok(())
    }
    fn propose(&mut self, _tokens: &[u32], max_len: usize) -> anyhow::Result<specula::speculative::Draft> {
        let tokens: Vec<u32> =
            (0..max_len).map(|_| specula::sample::sample_from_weights(&self.q, &mut self.rng).unwrap()).collect();
        Ok(specula::speculative::Draft { probs: Some(vec![self.q.clone(); tokens.len()]), tokens, parents: Vec::new() })
    }
}

/// Critical value of the chi-square distribution with `df` degrees of freedom at upper tail
/// probability 0.001 (Wilson–Hilferty; within 1% for df >= 3).
pub fn chi_square_critical_001(df: usize) -> f64 {
    let (d, z) = (df as f64, 3.090_232);
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

/// Chi-square statistic and degrees of freedom of `counts` against `exact`; cells expected
/// fewer than 5 times are pooled. Panics on a sample the target can never produce.
pub fn chi_square(
    counts: &std::collections::HashMap<Vec<u32>, usize>,
    exact: &std::collections::HashMap<Vec<u32>, f64>,
    n: usize,
) -> (f64, usize) {
    for seq in counts.keys() {
        assert!(exact.contains_key(seq), "sampled {seq:?}, which has probability 0");
    }
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (seq, &p) in exact {
        let expected = p * n as f64;
        let observed = counts.get(seq).copied().unwrap_or(0) as f64;
        if expected < 5.0 {
            pooled_obs += observed;
            pooled_exp += expected;
        } else {
            stat += (observed - expected).powi(2) / expected;
            cells += 1;
        }
    }
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp;
        cells += 1;
    }
    (stat, cells.saturating_sub(1))
}

/// The model's logits on every row of `tokens`, from one ordinary forward (f32 KV cache).
pub fn logits_of_every_row(model: &specula::model::Transformer, tokens: &[u32]) -> candle_core::Tensor {
    let pool = model.new_kv_pool_typed(tokens.len().next_multiple_of(16), specula::kv::KvDtype::F32);
    let mut cache = pool.new_sequence();
    let mut batch = specula::model::ForwardBatch::new();
    batch.push(tokens, &mut cache, specula::model::LogitsRows::All);
    model.forward(&mut batch).unwrap().logits
}
