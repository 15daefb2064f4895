//! Hugging Face model directories: `config.json` + `*.safetensors` (one file or shards)
//! + `tokenizer.json`, in f32/bf16/f16. Qwen3 (and Qwen2/Llama) checkpoints run on the same
//! forward as GGUF models: tensor names are mapped to GGUF names here.

use super::config::{Arch, DecoderExtras, Llama3Rope, ModelConfig, RopeStyle};
use super::source::TensorSource;
use anyhow::{bail, Context, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use serde_json::Value;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

pub struct HfModelDir {
    pub path: PathBuf,
    pub config_json: Value,
    tensors: MmapedSafetensors,
    names: HashSet<String>,
}

/// GGUF tensor name → Hugging Face name.
fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (part, kind) = rest.rsplit_once('.')?;
    let module = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{module}.{kind}"))
}

impl HfModelDir {
    pub fn is_model_dir(path: &Path) -> bool {
        path.is_dir() && path.join("config.json").is_file()
    }

    pub fn open(path: &Path) -> Result<Self> {
        let config_path = path.join("config.json");
        let text =
            std::fs::read_to_string(&config_path).with_context(|| format!("cannot read {}", config_path.display()))?;
        let config_json: Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", config_path.display()))?;
        let mut shards: Vec<PathBuf> = std::fs::read_dir(path)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        shards.sort();
        if shards.is_empty() {
            bail!("{}: no *.safetensors files", path.display());
        }
        // SAFETY: the files are mapped read-only; like every mmap loader, we assume nobody
        // truncates them while the model is loaded.
        let tensors = unsafe { MmapedSafetensors::multi(&shards) }
            .map_err(|e| anyhow::anyhow!("{}: cannot read safetensors: {e}", path.display()))?;
        let names = tensors.tensors().into_iter().map(|(n, _)| n).collect();
        Ok(Self { path: path.to_path_buf(), config_json, tensors, names })
    }

    pub fn has_hf_tensor(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// Reads a tensor by its Hugging Face name as dense f32.
    pub fn load_hf(&self, name: &str, device: &Device) -> Result<candle_core::Tensor> {
        if !self.names.contains(name) {
            bail!("{}: missing tensor `{name}`", self.path.display());
        }
        Ok(self.tensors.load(name, device)?.to_dtype(DType::F32)?)
    }

    pub fn tokenizer_json(&self) -> Option<PathBuf> {
        Some(self.path.join("tokenizer.json")).filter(|p| p.is_file())
    }

    pub fn config(&self) -> Result<ModelConfig> {
        let c = &self.config_json;
        let usize_of = |k: &str| -> Result<usize> {
            c.get(k)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .with_context(|| format!("config.json: missing integer `{k}`"))
        };
        let model_type = c.get("model_type").and_then(Value::as_str).unwrap_or("");
        let (arch, rope_style) = match model_type {
            "qwen3" => (Arch::Qwen3, RopeStyle::Halves),
            "qwen2" => (Arch::Qwen2, RopeStyle::Halves),
            "llama" => (Arch::Llama, RopeStyle::Halves),
            other => bail!("unsupported architecture `{other}` in config.json (supported: qwen3, qwen2, llama)"),
        };
        let hidden = usize_of("hidden_size")?;
        let n_heads = usize_of("num_attention_heads")?;
        let n_kv_heads = usize_of("num_key_value_heads").unwrap_or(n_heads);
        let head_dim = usize_of("head_dim").unwrap_or(hidden / n_heads.max(1));
        if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 || head_dim % 2 != 0 {
            bail!("config.json: invalid heads ({n_heads} query, {n_kv_heads} kv, head dim {head_dim})");
        }
        let vocab = usize_of("vocab_size")?;
        let tied = c.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false)
            || !self.has_hf_tensor("lm_head.weight");
        let mut extras = DecoderExtras::default();
        // transformers ≥ 5 writes `rope_parameters` (with `rope_theta` inside); older
        // versions `rope_scaling` and a top-level `rope_theta`.
        let rope_parameters = c.get("rope_parameters").filter(|v| v.is_object());
        let rope_theta = c
            .get("rope_theta")
            .or_else(|| rope_parameters.and_then(|p| p.get("rope_theta")))
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0) as f32;
        if let Some(scaling) = c.get("rope_scaling").filter(|v| !v.is_null()).or(rope_parameters) {
            let kind =
                scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(Value::as_str).unwrap_or("default");
            let num = |k: &str| -> Result<f32> {
                scaling
                    .get(k)
                    .and_then(Value::as_f64)
                    .map(|v| v as f32)
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .with_context(|| format!("config.json: rope_scaling needs a positive `{k}`"))
            };
            match kind {
                "default" => {}
                "linear" => extras.rope_linear_factor = Some(num("factor")?),
                "llama3" => {
                    let r = Llama3Rope {
                        factor: num("factor")?,
                        low_freq_factor: num("low_freq_factor")?,
                        high_freq_factor: num("high_freq_factor")?,
                        original_context: num("original_max_position_embeddings")?,
                    };
                    if r.high_freq_factor <= r.low_freq_factor {
                        bail!("config.json: rope_scaling high_freq_factor must exceed low_freq_factor");
                    }
                    extras.llama3_rope = Some(r);
                }
                other => bail!("config.json: unsupported rope_scaling type `{other}` (supported: linear, llama3)"),
            }
        }
        let config = ModelConfig {
            arch,
            n_layers: usize_of("num_hidden_layers")?,
            hidden,
            ffn: usize_of("intermediate_size")?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            context_len: usize_of("max_position_embeddings").unwrap_or(4096),
            rope_theta,
            rope_dim: head_dim,
            rope_style,
            rms_eps: c.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6),
            tied_head: tied,
            qkv_bias: self.has_hf_tensor("model.layers.0.self_attn.q_proj.bias"),
            qk_norm: self.has_hf_tensor("model.layers.0.self_attn.q_norm.weight"),
            extras,
        };
        config.check().context("config.json")?;
        Ok(config)
    }
}

impl TensorSource for HfModelDir {
    fn origin(&self) -> String {
        self.path.display().to_string()
    }

    fn has_tensor(&self, gguf_name: &str) -> bool {
        hf_name(gguf_name).is_some_and(|n| self.names.contains(&n))
    }

    fn qtensor(&mut self, gguf_name: &str, device: &Device) -> Result<QTensor> {
        let name = hf_name(gguf_name).with_context(|| format!("no Hugging Face name for `{gguf_name}`"))?;
        let t = self.load_hf(&name, device)?;
        Ok(QTensor::quantize(&t, GgmlDType::F32)?)
    }
}

#[cfg(test)]
mod tests {
    use super::hf_name;

    #[test]
    fn maps_gguf_names_to_hugging_face_names() {
        assert_eq!(hf_name("token_embd.weight").unwrap(), "model.embed_tokens.weight");
        assert_eq!(hf_name("blk.3.attn_q.bias").unwrap(), "model.layers.3.self_attn.q_proj.bias");
        assert_eq!(hf_name("blk.0.attn_k_norm.weight").unwrap(), "model.layers.0.self_attn.k_norm.weight");
        assert_eq!(hf_name("blk.12.ffn_down.weight").unwrap(), "model.layers.12.mlp.down_proj.weight");
        assert!(hf_name("blk.1.unknown.weight").is_none());
    }
}
