//! Architecture hyper-parameters, read from the file's metadata (never hard-coded).

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};

/// Supported architectures. All share one decoder; they differ in biases, norms, RoPE
/// pairing, activation, attention windows and head tying, which the config records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    /// Qwen2 without q/k/v biases, with per-head RMSNorm on queries and keys.
    Qwen3,
    /// Gemma 3: Qwen3's q/k norms plus scaled embeddings, norms after attention and MLP,
    /// a GELU-gated MLP and sliding-window attention in most layers.
    Gemma3,
}

impl Arch {
    pub fn name(&self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
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

/// The MLP's gate activation: `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    #[default]
    Silu,
    /// GELU, tanh approximation (Gemma).
    GeluTanh,
}

/// Layers that attend only to the most recent `window` positions (their own included).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingWindow {
    pub window: usize,
    /// Every `pattern`-th layer (layers `pattern−1`, `2·pattern−1`, …) attends globally; the
    /// others use the window. 0: every layer uses the window.
    pub pattern: usize,
    /// RoPE base of the windowed layers (the global ones use `rope_theta`).
    pub rope_theta: f32,
}

/// What sets one architecture's decoder apart from Llama's; all off for Llama and Qwen.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DecoderExtras {
    /// Token embeddings are multiplied by this (Gemma: √hidden).
    pub embed_scale: Option<f32>,
    /// RMSNorm on the attention and MLP outputs before each residual add (Gemma 3).
    pub post_norms: bool,
    pub activation: Activation,
    pub sliding_window: Option<SlidingWindow>,
    /// Attention score scale; `None` is 1/√head_dim.
    pub attn_scale: Option<f32>,
    /// Llama 3 RoPE scaling from a Hugging Face config (a GGUF stores the resulting
    /// per-frequency divisors as the tensor `rope_freqs.weight` instead).
    pub llama3_rope: Option<Llama3Rope>,
    /// Linear RoPE scaling (`rope.scaling.type` linear): positions divided by this factor,
    /// in the layers with global attention only (as llama.cpp does for Gemma 3).
    pub rope_linear_factor: Option<f32>,
}

/// `rope_scaling` of type `llama3`: low frequencies slowed by `factor`, high ones kept, a
/// smooth blend between (Hugging Face's `_compute_llama3_parameters`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Rope {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_context: f32,
}

impl Llama3Rope {
    /// The divisor of each pair's frequency for a head of `rope_dim` with base `theta`, as
    /// llama.cpp's converter writes them into `rope_freqs.weight`.
    pub fn freq_divisors(&self, theta: f32, rope_dim: usize) -> Vec<f32> {
        let low_wavelen = self.original_context / self.low_freq_factor;
        let high_wavelen = self.original_context / self.high_freq_factor;
        (0..rope_dim / 2)
            .map(|i| {
                let freq = 1.0 / (theta as f64).powf(2.0 * i as f64 / rope_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                if wavelen < high_wavelen as f64 {
                    1.0
                } else if wavelen > low_wavelen as f64 {
                    self.factor
                } else {
                    let smooth = (self.original_context as f64 / wavelen - self.low_freq_factor as f64)
                        / (self.high_freq_factor - self.low_freq_factor) as f64;
                    (1.0 / ((1.0 - smooth) / self.factor as f64 + smooth)) as f32
                }
            })
            .collect()
    }
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
    /// Per-head RMSNorm on queries and keys before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    pub extras: DecoderExtras,
}

impl ModelConfig {
    /// Refuses sizes no real model has: the configuration comes from an untrusted file, and
    /// buffers (RoPE tables, KV caches, per-layer vectors) are sized by it before any tensor
    /// is read. The bounds are well above every supported family's largest model.
    pub fn check(&self) -> Result<()> {
        let within = |what: &str, v: usize, lo: usize, hi: usize| -> Result<()> {
            if v < lo || v > hi {
                bail!("model configuration: {what} {v} is outside {lo}..={hi}");
            }
            Ok(())
        };
        within("layer count", self.n_layers, 1, 1024)?;
        within("hidden size", self.hidden, 1, 1 << 16)?;
        within("feed-forward size", self.ffn, 1, 1 << 20)?;
        within("query heads", self.n_heads, 1, 1024)?;
        within("KV heads", self.n_kv_heads, 1, self.n_heads)?;
        within("head dimension", self.head_dim, 2, 1024)?;
        within("RoPE dimension", self.rope_dim, 0, self.head_dim)?;
        within("vocabulary", self.vocab, 1, 1 << 22)?;
        within("context length", self.context_len, 1, 1 << 24)?;
        if self.n_heads % self.n_kv_heads != 0 || self.head_dim % 2 != 0 || self.rope_dim % 2 != 0 {
            bail!(
                "model configuration: {} query heads, {} KV heads, head dimension {}, RoPE dimension {}",
                self.n_heads,
                self.n_kv_heads,
                self.head_dim,
                self.rope_dim
            );
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            bail!("model configuration: RoPE base {} is not a positive number", self.rope_theta);
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0 && self.rms_eps < 1.0) {
            bail!("model configuration: RMSNorm epsilon {} is outside (0, 1)", self.rms_eps);
        }
        if let Some(sw) = self.extras.sliding_window {
            within("sliding window", sw.window, 1, 1 << 24)?;
            if !(sw.rope_theta.is_finite() && sw.rope_theta > 0.0) {
                bail!("model configuration: local RoPE base {} is not a positive number", sw.rope_theta);
            }
        }
        Ok(())
    }

    /// The attention window of layer `layer`, `None` for global attention.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let sw = self.extras.sliding_window?;
        let global = sw.pattern > 0 && (layer + 1).is_multiple_of(sw.pattern);
        (!global).then_some(sw.window)
    }

    /// The RoPE base of layer `layer`.
    pub fn layer_rope_theta(&self, layer: usize) -> f32 {
        match (self.layer_window(layer), self.extras.sliding_window) {
            (Some(_), Some(sw)) => sw.rope_theta,
            _ => self.rope_theta,
        }
    }
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
            "gemma3" => Arch::Gemma3,
            other => bail!("unsupported architecture `{other}` (supported: llama, qwen2, qwen3, gemma3)"),
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
        let extras: DecoderExtras = match arch {
            Arch::Gemma3 => gemma3_extras(content, hidden, n_heads, head_dim, n_layers)?,
            _ => DecoderExtras::default(),
        };
        let mut extras = extras;
        if let Some(Value::String(kind)) = content.metadata.get(&format!("{a}.rope.scaling.type")) {
            match kind.as_str() {
                "none" => {}
                "linear" => {
                    let factor = get_f32(content, &format!("{a}.rope.scaling.factor"))?;
                    if !(factor.is_finite() && factor > 0.0) {
                        bail!("invalid {a}.rope.scaling.factor {factor}");
                    }
                    extras.rope_linear_factor = Some(factor).filter(|&f| f != 1.0);
                }
                other => bail!(
                    "unsupported RoPE scaling `{other}` ({a}.rope.scaling.type); supported: none, linear, and \
                     llama3 (as the rope_freqs tensor)"
                ),
            }
        }
        let config = Self {
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
                Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => RopeStyle::Halves,
            },
            rms_eps: get_f32(content, &format!("{a}.attention.layer_norm_rms_epsilon"))? as f64,
            tied_head: !content.tensor_infos.contains_key("output.weight"),
            qkv_bias: content.tensor_infos.contains_key("blk.0.attn_q.bias"),
            qk_norm: content.tensor_infos.contains_key("blk.0.attn_q_norm.weight"),
            extras,
        };
        config.check()?;
        Ok(config)
    }
}

/// Gemma 3's settings. The window and global RoPE base are in the file; the rest is fixed
/// by the architecture, as llama.cpp fixes it: every 6th layer global, local layers at RoPE
/// base 10 000, queries scaled by 1/√head_dim except in the 27B (62 layers), which uses
/// 1/√(hidden/heads).
fn gemma3_extras(
    content: &Content,
    hidden: usize,
    n_heads: usize,
    head_dim: usize,
    n_layers: usize,
) -> Result<DecoderExtras> {
    let window = get_usize(content, "gemma3.attention.sliding_window")?;
    if window == 0 {
        bail!("gemma3.attention.sliding_window is 0");
    }
    for t in ["attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"] {
        if !content.tensor_infos.contains_key(&format!("blk.0.{t}.weight")) {
            bail!("gemma3 GGUF has no `blk.0.{t}.weight`");
        }
    }
    let scale_dim = if n_layers == 62 { hidden / n_heads } else { head_dim };
    Ok(DecoderExtras {
        embed_scale: Some((hidden as f32).sqrt()),
        post_norms: true,
        activation: Activation::GeluTanh,
        sliding_window: Some(SlidingWindow { window, pattern: 6, rope_theta: 10_000.0 }),
        attn_scale: Some(1.0 / (scale_dim as f32).sqrt()),
        llama3_rope: None,
        rope_linear_factor: None,
    })
}
