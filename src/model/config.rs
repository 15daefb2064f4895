//! Architecture hyper-parameters, read from the file's metadata (never hard-coded).

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};

/// Supported architectures. Llama and Qwen2 share one decoder; they differ in biases,
/// RoPE pairing and head tying, which the config records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    /// Qwen2 without q/k/v biases, with per-head RMSNorm on queries and keys.
    Qwen3,
}

impl Arch {
    pub fn name(&self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// How rotary embeddings pair dimensions. GGUF llama checkpoints are converted with
/// permuted Q/K rows so adjacent pairs rotate together; Qwen2 rotates halves (NeoX).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    Interleaved,
    Halves,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context_len: usize,
    pub rope_theta: f32,
    pub rope_dim: usize,
    pub rope_style: RopeStyle,
    pub rms_eps: f64,
    /// The LM head reuses the token embedding.
    pub tied_head: bool,
    pub qkv_bias: bool,
    /// Per-head RMSNorm on queries and keys before RoPE (Qwen3).
    pub qk_norm: bool,
}

fn get<'a>(content: &'a Content, key: &str) -> Result<&'a Value> {
    content.metadata.get(key).with_context(|| format!("GGUF metadata is missing `{key}`"))
}

fn get_usize(content: &Content, key: &str) -> Result<usize> {
    let v = get(content, key)?;
    let n = match v {
        Value::U8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::U64(x) => *x,
        Value::I32(x) if *x >= 0 => *x as u64,
        Value::I64(x) if *x >= 0 => *x as u64,
        other => bail!("GGUF metadata `{key}` should be a non-negative integer, found {other:?}"),
    };
    Ok(n as usize)
}

fn get_f32(content: &Content, key: &str) -> Result<f32> {
    match get(content, key)? {
        Value::F32(x) => Ok(*x),
        Value::F64(x) => Ok(*x as f32),
        other => bail!("GGUF metadata `{key}` should be a float, found {other:?}"),
    }
}

impl ModelConfig {
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let arch_name = match get(content, "general.architecture")? {
            Value::String(s) => s.clone(),
            other => bail!("GGUF `general.architecture` should be a string, found {other:?}"),
        };
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => bail!("unsupported architecture `{other}` (supported: llama, qwen2, qwen3)"),
        };
        let a = arch.name();
        let hidden = get_usize(content, &format!("{a}.embedding_length"))?;
        let n_heads = get_usize(content, &format!("{a}.attention.head_count"))?;
        let n_kv_heads = get_usize(content, &format!("{a}.attention.head_count_kv")).unwrap_or(n_heads);
        if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            bail!("invalid head counts: {n_heads} query heads, {n_kv_heads} KV heads");
        }
        let head_dim = get_usize(content, &format!("{a}.attention.key_length")).unwrap_or(hidden / n_heads);
        if head_dim == 0 || head_dim % 2 != 0 {
            bail!("invalid head dimension {head_dim}");
        }
        let rope_dim = get_usize(content, &format!("{a}.rope.dimension_count")).unwrap_or(head_dim);
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            bail!("invalid rope dimension {rope_dim} for head dimension {head_dim}");
        }
        let embd = content.tensor_infos.get("token_embd.weight").context("GGUF has no tensor `token_embd.weight`")?;
        let (vocab, embd_hidden) = embd.shape.dims2().context("`token_embd.weight` should be 2-D")?;
        if embd_hidden != hidden {
            bail!("`token_embd.weight` width {embd_hidden} differs from embedding_length {hidden}");
        }
        let n_layers = get_usize(content, &format!("{a}.block_count"))?;
        if n_layers == 0 {
            bail!("model has no layers");
        }
        Ok(Self {
            arch,
            n_layers,
            hidden,
            ffn: get_usize(content, &format!("{a}.feed_forward_length"))?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            context_len: get_usize(content, &format!("{a}.context_length")).unwrap_or(4096),
            rope_theta: get_f32(content, &format!("{a}.rope.freq_base")).unwrap_or(10_000.0),
            rope_dim,
            rope_style: match arch {
                Arch::Llama => RopeStyle::Interleaved,
                Arch::Qwen2 | Arch::Qwen3 => RopeStyle::Halves,
            },
            rms_eps: get_f32(content, &format!("{a}.attention.layer_norm_rms_epsilon"))? as f64,
            tied_head: !content.tensor_infos.contains_key("output.weight"),
            qkv_bias: content.tensor_infos.contains_key("blk.0.attn_q.bias"),
            qk_norm: content.tensor_infos.contains_key("blk.0.attn_q_norm.weight"),
        })
    }
}
