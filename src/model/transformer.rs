//! The decoder shared by Llama, Qwen2/3 and Gemma 3: pre-norm attention with GQA over the
//! paged KV cache and a gated MLP, run over a packed batch of sequences. What differs per
//! architecture (q/k norms, post-norms, activation, windows, RoPE per layer) is in the config.

use super::batch::{ForwardBatch, ForwardOutput, LogitsRows};
use super::config::ModelConfig;
use super::gguf::GgufFile;
use super::kernels::KernelSettings;
use super::kernels::WeightFormat;
use super::linear::{FusedLinear, Linear};
use super::profile::{self, Phase};
use super::rope::Rope;
use super::source::TensorSource;
use crate::kv::{paged_attention, AttentionSeq, KvDtype, KvLayout, KvPool, NO_PARENT};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use std::sync::Arc;

struct Layer {
    attn_norm: Tensor,
    /// Per-head query/key RMSNorm weights `[head_dim]` (Qwen3).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// q, k, v projections as one matmul.
    qkv: FusedLinear,
    o: Linear,
    ffn_norm: Tensor,
    /// gate and up projections as one matmul.
    gate_up: FusedLinear,
    down: Linear,
    /// RMSNorm weights on the attention and MLP outputs before the residual adds (Gemma 3).
    post_norms: Option<(Tensor, Tensor)>,
    /// Sliding attention window (positions), `None` for global attention.
    window: Option<usize>,
    /// Index of this layer's RoPE in `Transformer::ropes`.
    rope: usize,
}

pub struct Transformer {
    pub config: ModelConfig,
    pub weight_format: WeightFormat,
    device: Device,
    /// Token embedding, kept in the file's type; rows are dequantised on lookup.
    embedding: Arc<candle_core::quantized::QTensor>,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// The distinct RoPEs of the layers (Gemma 3: one for windowed layers, one for global).
    ropes: Vec<Rope>,
    /// The file or directory the weights came from, when loaded from a path: an untied LM
    /// head's weights are read again from there when asked for ([`Self::lm_head_weights`]).
    source_path: Option<std::path::PathBuf>,
}

impl Transformer {
    /// Loads with `kernels.weights`, or the file's measured default when that is `None`.
    pub fn load(file: &mut GgufFile, kernels: &KernelSettings, device: &Device) -> Result<Self> {
        let config = ModelConfig::from_gguf(&file.content)?;
        let format = kernels.weights.unwrap_or_else(|| WeightFormat::default_for(file, kernels));
        Self::load_from(file, config, format, kernels, device)
    }

    /// Loads from any tensor source with an already-read config.
    pub fn load_from(
        file: &mut dyn TensorSource,
        config: ModelConfig,
        format: WeightFormat,
        kernels: &KernelSettings,
        device: &Device,
    ) -> Result<Self> {
        let embedding = Arc::new(file.qtensor("token_embd.weight", device)?);
        let lm_head = if config.tied_head {
            Linear::from_qtensor(embedding.clone(), None, format, kernels, device)?
        } else {
            Linear::load(file, "output", false, format, kernels, device)?
        };
        let mut ropes: Vec<(f32, bool, Rope)> = Vec::new();
        // Llama 3 frequency divisors: the GGUF's tensor, else computed from the HF config.
        let llama3_divisors = if file.has_tensor("rope_freqs.weight") {
            Some(file.dense("rope_freqs.weight", device)?.flatten_all()?.to_vec1::<f32>()?)
        } else {
            config.extras.llama3_rope.map(|r| r.freq_divisors(config.rope_theta, config.rope_dim))
        };
        let mut layers = Vec::with_capacity(config.n_layers);
        for i in 0..config.n_layers {
            let window = config.layer_window(i);
            let theta = config.layer_rope_theta(i);
            let linear = config.extras.rope_linear_factor.filter(|_| window.is_none());
            let rope = match ropes.iter().position(|(t, g, _)| *t == theta && *g == linear.is_some()) {
                Some(r) => r,
                None => {
                    let mut divisors = llama3_divisors.clone().unwrap_or_else(|| vec![1.0; config.rope_dim / 2]);
                    if let Some(f) = linear {
                        divisors.iter_mut().for_each(|d| *d *= f);
                    }
                    let mut rope = Rope::new(config.rope_style, theta, config.rope_dim, config.head_dim);
                    if llama3_divisors.is_some() || linear.is_some() {
                        rope = rope.with_divisors(&divisors).context("rope_freqs.weight")?;
                    }
                    ropes.push((theta, linear.is_some(), rope));
                    ropes.len() - 1
                }
            };
            let names = |parts: &[&str]| parts.iter().map(|p| format!("blk.{i}.{p}")).collect::<Vec<_>>();
            let layer = Layer {
                qkv: FusedLinear::load(
                    file,
                    &names(&["attn_q", "attn_k", "attn_v"]),
                    config.qkv_bias,
                    format,
                    kernels,
                    device,
                )?,
                o: Linear::load(file, &format!("blk.{i}.attn_output"), false, format, kernels, device)?,
                gate_up: FusedLinear::load(file, &names(&["ffn_gate", "ffn_up"]), false, format, kernels, device)?,
                down: Linear::load(file, &format!("blk.{i}.ffn_down"), false, format, kernels, device)?,
                attn_norm: file.dense(&format!("blk.{i}.attn_norm.weight"), device)?,
                ffn_norm: file.dense(&format!("blk.{i}.ffn_norm.weight"), device)?,
                qk_norm: if config.qk_norm {
                    let q = file.dense(&format!("blk.{i}.attn_q_norm.weight"), device)?.to_vec1::<f32>()?;
                    let k = file.dense(&format!("blk.{i}.attn_k_norm.weight"), device)?.to_vec1::<f32>()?;
                    if q.len() != config.head_dim || k.len() != config.head_dim {
                        bail!("blk.{i}: q/k norm weights should have {} elements", config.head_dim);
                    }
                    Some((q, k))
                } else {
                    None
                },
                post_norms: if config.extras.post_norms {
                    Some((
                        file.dense(&format!("blk.{i}.post_attention_norm.weight"), device)?,
                        file.dense(&format!("blk.{i}.post_ffw_norm.weight"), device)?,
                    ))
                } else {
                    None
                },
                window,
                rope,
            };
            let (q, kv) = (config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim);
            check_shape(layer.qkv.widths(), layer.qkv.in_features(), &[q, kv, kv], config.hidden, i, "attn_q/k/v")?;
            check_shape(
                layer.gate_up.widths(),
                layer.gate_up.in_features(),
                &[config.ffn, config.ffn],
                config.hidden,
                i,
                "ffn_gate/up",
            )?;
            check_shape(&[layer.o.out_features()], layer.o.in_features(), &[config.hidden], q, i, "attn_output")?;
            check_vector(&layer.attn_norm, config.hidden, &format!("blk.{i}.attn_norm.weight"))?;
            check_vector(&layer.ffn_norm, config.hidden, &format!("blk.{i}.ffn_norm.weight"))?;
            if let Some((a, f)) = &layer.post_norms {
                check_vector(a, config.hidden, &format!("blk.{i}.post_attention_norm.weight"))?;
                check_vector(f, config.hidden, &format!("blk.{i}.post_ffw_norm.weight"))?;
            }
            check_shape(
                &[layer.down.out_features()],
                layer.down.in_features(),
                &[config.hidden],
                config.ffn,
                i,
                "ffn_down",
            )?;
            layers.push(layer);
        }
        let norm = file.dense("output_norm.weight", device)?;
        check_vector(&norm, config.hidden, "output_norm.weight")?;
        if lm_head.in_features() != config.hidden || lm_head.out_features() != config.vocab {
            bail!(
                "LM head is {} × {}, expected {} × {} (vocabulary × hidden)",
                lm_head.out_features(),
                lm_head.in_features(),
                config.vocab,
                config.hidden
            );
        }
        let ropes = ropes.into_iter().map(|(_, _, r)| r).collect();
        Ok(Self {
            config,
            weight_format: format,
            device: device.clone(),
            embedding,
            layers,
            norm,
            lm_head,
            ropes,
            source_path: None,
        })
    }

    /// Opens a GGUF file or a Hugging Face model directory and loads it with the
    /// environment's kernel settings ([`KernelSettings::from_env`]); `format` None picks the
    /// measured default.
    pub fn from_path(path: &std::path::Path, format: Option<WeightFormat>, device: &Device) -> Result<Self> {
        Self::from_path_with(path, &KernelSettings::from_env().with_weights(format), device)
    }

    /// [`Self::from_path`] with explicit kernel settings.
    pub fn from_path_with(path: &std::path::Path, kernels: &KernelSettings, device: &Device) -> Result<Self> {
        let mut model = if super::hf::HfModelDir::is_model_dir(path) {
            let mut dir = super::hf::HfModelDir::open(path)?;
            let config = dir.config()?;
            Self::load_from(&mut dir, config, kernels.weights.unwrap_or(WeightFormat::Native), kernels, device)?
        } else {
            let mut file = GgufFile::open(path)?;
            Self::load(&mut file, kernels, device)?
        };
        model.source_path = Some(path.to_path_buf());
        Ok(model)
    }

    /// Keeps the LM head's first `n` rows only: logits then cover tokens `0..n`, and the head
    /// costs `n / vocab` of the full one in every forward. For a draft model, whose drafts a
    /// lossless verifier checks anyway: a byte-level BPE vocabulary lists its earliest (most
    /// frequent) merges first, so the first ids hold most of what gets written, and a small
    /// model's head over a 152k vocabulary is over a third of the bytes each token reads. Any
    /// token can still be fed as input.
    pub fn keep_head_rows(&mut self, n: usize, kernels: &KernelSettings) -> Result<()> {
        let (vocab, hidden) = (self.config.vocab, self.config.hidden);
        if n == 0 || n > vocab {
            bail!("a head of {n} rows for a vocabulary of {vocab} tokens (1..={vocab})");
        }
        if n == self.lm_head.out_features() {
            return Ok(());
        }
        let full = self.lm_head_weights()?;
        let dtype = full.dtype();
        if full.shape().dims() != [vocab, hidden] || hidden % dtype.block_size() != 0 {
            bail!("LM head of shape {:?} and type {dtype:?} cannot be cut into rows", full.shape());
        }
        let row_bytes = hidden / dtype.block_size() * dtype.type_size();
        let data = full.data()?;
        let rows = candle_core::quantized::ggml_file::qtensor_from_ggml(
            dtype,
            &data[..n * row_bytes],
            vec![n, hidden],
            &self.device,
        )?;
        self.lm_head = Linear::from_qtensor(Arc::new(rows), None, self.weight_format, kernels, &self.device)?;
        Ok(())
    }

    /// Records where the weights came from (see [`Self::lm_head_weights`]).
    pub fn with_source_path(mut self, path: &std::path::Path) -> Self {
        self.source_path = Some(path.to_path_buf());
        self
    }

    /// A tensor by its GGUF name, read again from the model's file and dequantised to f32
    /// (drafters initialised from the target's layers read them so).
    pub fn read_dense(&self, gguf_name: &str) -> Result<Tensor> {
        let path = self.source_path.as_ref().context("the model was not loaded from a path")?;
        let q = if super::hf::HfModelDir::is_model_dir(path) {
            super::hf::HfModelDir::open(path)?.qtensor(gguf_name, &self.device)?
        } else {
            GgufFile::open(path)?.qtensor(gguf_name, &self.device)?
        };
        Ok(q.dequantize(&self.device)?.to_dtype(candle_core::DType::F32)?)
    }

    /// The LM head's weights `[vocab, hidden]` in the file's own type: the embedding when the
    /// head is tied, otherwise read again from the model's file (the loaded head may be
    /// repacked for our kernels). Drafters train against it and take rows of it.
    pub fn lm_head_weights(&self) -> Result<Arc<candle_core::quantized::QTensor>> {
        if self.config.tied_head {
            return Ok(self.embedding.clone());
        }
        let path = self
            .source_path
            .as_ref()
            .context("the model was not loaded from a path; its LM head cannot be read again")?;
        let q = if super::hf::HfModelDir::is_model_dir(path) {
            super::hf::HfModelDir::open(path)?.qtensor("output.weight", &self.device)?
        } else {
            GgufFile::open(path)?.qtensor("output.weight", &self.device)?
        };
        Ok(Arc::new(q))
    }

    /// Runs one throwaway token so lazily built kernel layouts (candle repacks weights on
    /// first use) are ready before the first request is timed.
    pub fn warm_up(&self) -> Result<()> {
        let pool = self.new_kv_pool(16);
        let mut cache = pool.new_sequence();
        let mut batch = ForwardBatch::new();
        batch.push(&[0], &mut cache, LogitsRows::Last);
        self.forward(&mut batch)?;
        Ok(())
    }

    /// Token embeddings `[ids, hidden]` as the first layer sees them (scaled for Gemma);
    /// drafters such as DFlash share the target's.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let ids = Tensor::new(ids, &self.device)?;
        let x = self.embedding.embedding(&ids)?;
        Ok(match self.config.extras.embed_scale {
            Some(s) => (x * s as f64)?,
            None => x,
        })
    }

    /// The LM head alone, on already-normalised hidden states `[rows, hidden]` → logits.
    pub fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// What a drafter borrows from its target (DFlash has no embedding, final norm or LM head
    /// of its own): the token embedding table, the final RMSNorm weight and the LM head. All
    /// are reference-counted, so this is cheap.
    pub fn embedding_norm_head(&self) -> (Arc<candle_core::quantized::QTensor>, Tensor, Linear) {
        (self.embedding.clone(), self.norm.clone(), self.lm_head.clone())
    }

    pub fn kv_layout(&self, block_size: usize, dtype: KvDtype) -> KvLayout {
        KvLayout {
            dtype,
            n_layers: self.config.n_layers,
            n_kv_heads: self.config.n_kv_heads,
            head_dim: self.config.head_dim,
            block_size,
        }
    }

    /// A block pool sized for `capacity_tokens` tokens of this model (f16 cache).
    pub fn new_kv_pool(&self, capacity_tokens: usize) -> KvPool {
        self.new_kv_pool_typed(capacity_tokens, KvDtype::F16)
    }

    pub fn new_kv_pool_typed(&self, capacity_tokens: usize, dtype: KvDtype) -> KvPool {
        KvPool::new(self.kv_layout(16, dtype), capacity_tokens)
    }

    /// Runs every sequence's new tokens on top of its cache, appends their K/V, and returns
    /// the wanted logits rows and taps. On error no cache has advanced.
    pub fn forward(&self, batch: &mut ForwardBatch<'_>) -> Result<ForwardOutput> {
        let _timer = profile::PROFILER.forward_timer();
        self.device.with_context(|| self.forward_inner(batch))
    }

    /// Whether the profiler counts int8 multiply-adds for this matmul kind (its weights are
    /// quantised in every layer). False for phases that are not matmuls.
    pub fn int8_matmul(&self, kind: Phase) -> bool {
        let every_layer = |f: fn(&Layer) -> bool| self.layers.iter().all(f);
        match kind {
            Phase::Qkv => every_layer(|l| l.qkv.runs_int8()),
            Phase::AttnOut => every_layer(|l| l.o.runs_int8()),
            Phase::GateUp => every_layer(|l| l.gate_up.runs_int8()),
            Phase::Down => every_layer(|l| l.down.runs_int8()),
            Phase::LmHead => self.lm_head.runs_int8(),
            _ => false,
        }
    }

    fn forward_inner(&self, batch: &mut ForwardBatch<'_>) -> Result<ForwardOutput> {
        let cfg = &self.config;
        for &l in &batch.tap_layers {
            if l >= cfg.n_layers {
                bail!("tap layer {l} is beyond the model's {} layers", cfg.n_layers);
            }
        }
        let n_rows = batch.total_rows();
        if n_rows == 0 {
            bail!("forward called with no tokens");
        }
        let Some(pool) = batch.seqs.first().map(|s| s.cache.pool().clone()) else {
            bail!("forward called with no sequences");
        };
        let mut storage = pool.lock();
        if storage.layout != self.kv_layout(storage.layout.block_size, storage.layout.dtype) {
            bail!("KV pool layout does not match this model");
        }
        let bs = storage.layout.block_size;

        // Validate and reserve first, so a failure leaves every cache as it was.
        let mut tokens = Vec::with_capacity(n_rows);
        let mut positions = Vec::with_capacity(n_rows);
        let mut row_ranges = Vec::with_capacity(batch.seqs.len());
        let mut logit_rows = Vec::new();
        let mut logits_ranges = Vec::with_capacity(batch.seqs.len());
        for s in batch.seqs.iter_mut() {
            if !s.cache.pool().same_pool(&pool) {
                bail!("all sequences of one forward must share a KV pool");
            }
            if s.tokens.is_empty() {
                bail!("a sequence in the batch has no new tokens");
            }
            let start = s.cache.len();
            let end = start + s.tokens.len();
            if end > cfg.context_len {
                bail!("sequence of {end} tokens exceeds the model's context length {}", cfg.context_len);
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
                bail!("token id {bad} is outside the vocabulary ({} tokens)", cfg.vocab);
            }
            match s.parents {
                None => positions.extend(start..end),
                Some(parents) => {
                    if parents.len() != s.tokens.len() {
                        bail!("a draft tree has {} parents for {} rows", parents.len(), s.tokens.len());
                    }
                    // Parents come before their children, so depths fill in one pass.
                    let mut depth = Vec::with_capacity(parents.len());
                    for (r, &p) in parents.iter().enumerate() {
                        depth.push(match p {
                            NO_PARENT => 0,
                            p if (p as usize) < r => depth[p as usize] + 1,
                            p => bail!("draft tree row {r} has parent {p}, not an earlier row"),
                        });
                    }
                    positions.extend(depth.iter().map(|d| start + d));
                }
            }
            s.cache.reserve_locked(&mut storage, end)?;
            let row0 = tokens.len();
            tokens.extend_from_slice(s.tokens);
            row_ranges.push(row0..tokens.len());
            let l0 = logit_rows.len();
            match s.logits {
                LogitsRows::None => {}
                LogitsRows::Last => logit_rows.push((tokens.len() - 1) as u32),
                LogitsRows::All => logit_rows.extend(row0 as u32..tokens.len() as u32),
            }
            logits_ranges.push(l0..logit_rows.len());
        }
        let attn_seqs: Vec<AttentionSeq<'_>> = batch
            .seqs
            .iter()
            .zip(&row_ranges)
            .map(|(s, r)| AttentionSeq {
                row_start: r.start,
                n_rows: r.len(),
                cached: s.cache.len(),
                blocks: s.cache.blocks(),
                parents: s.parents,
            })
            .collect();

        let mut x = {
            let _t = profile::timer(Phase::Embedding);
            self.embed(&tokens)?
        };
        let (hd, nh, nkv) = (cfg.head_dim, cfg.n_heads, cfg.n_kv_heads);
        let kv_width = nkv * hd;
        let mut taps = vec![None; batch.tap_layers.len()];
        let mut attn_out = vec![0f32; n_rows * nh * hd];
        let rope_tables: Vec<_> = {
            let _t = profile::timer(Phase::Rope);
            self.ropes.iter().map(|r| r.tables(&positions)).collect()
        };
        let attn_scale = cfg.extras.attn_scale.unwrap_or(1.0 / (hd as f32).sqrt());
        let rms_norm = |x: &Tensor, w: &Tensor| {
            let _t = profile::timer(Phase::Norm);
            super::elementwise::rms_norm(x, w, cfg.rms_eps as f32)
        };

        for (li, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm)?;
            let mut qkv = {
                let width = layer.qkv.widths().iter().sum();
                let _t = profile::matmul(Phase::Qkv, layer.qkv.runs_int8(), n_rows, width, layer.qkv.in_features());
                layer.qkv.forward_host(&h)?
            };
            let v = qkv.pop().context("qkv projection has three parts")?;
            let mut k = qkv.pop().context("qkv projection has three parts")?;
            let mut q = qkv.pop().context("qkv projection has three parts")?;
            {
                let _t = profile::timer(Phase::Rope);
                if let Some((qn, kn)) = &layer.qk_norm {
                    head_rms_norm(&mut q, qn, cfg.rms_eps as f32);
                    head_rms_norm(&mut k, kn, cfg.rms_eps as f32);
                }
                let (rope, tables) = (&self.ropes[layer.rope], &rope_tables[layer.rope]);
                for row in 0..n_rows {
                    rope.apply(&mut q[row * nh * hd..(row + 1) * nh * hd], tables, row);
                    rope.apply(&mut k[row * kv_width..(row + 1) * kv_width], tables, row);
                }
            }
            {
                let _t = profile::timer(Phase::Attention);
                // Write this layer's new K/V into each sequence's blocks.
                for sq in &attn_seqs {
                    for i in 0..sq.n_rows {
                        let row = sq.row_start + i;
                        let (k_row, v_row) =
                            (&k[row * kv_width..(row + 1) * kv_width], &v[row * kv_width..(row + 1) * kv_width]);
                        storage.write(li, sq.blocks, sq.cached + i, k_row, v_row);
                    }
                }
                paged_attention(&storage, li, &q, nh, &attn_seqs, attn_scale, layer.window, &mut attn_out);
            }
            let attn = Tensor::from_slice(&attn_out, (n_rows, nh * hd), &self.device)?;
            let mut attn = {
                let o = &layer.o;
                let _t = profile::matmul(Phase::AttnOut, o.runs_int8(), n_rows, o.out_features(), o.in_features());
                layer.o.forward(&attn)?
            };
            if let Some((post_attn, _)) = &layer.post_norms {
                attn = rms_norm(&attn, post_attn)?;
            }
            x = {
                let _t = profile::timer(Phase::Elementwise);
                (x + attn)?
            };

            let h = rms_norm(&x, &layer.ffn_norm)?;
            let gate_up = {
                let width = layer.gate_up.widths().iter().sum();
                let gate_up = &layer.gate_up;
                let _t = profile::matmul(Phase::GateUp, gate_up.runs_int8(), n_rows, width, gate_up.in_features());
                layer.gate_up.forward(&h)?
            };
            let gated = {
                let _t = profile::timer(Phase::Elementwise);
                super::elementwise::gated_mul(&gate_up[0], &gate_up[1], cfg.extras.activation)?
            };
            let mut mlp = {
                let down = &layer.down;
                let _t =
                    profile::matmul(Phase::Down, down.runs_int8(), n_rows, down.out_features(), down.in_features());
                layer.down.forward(&gated)?
            };
            if let Some((_, post_ffn)) = &layer.post_norms {
                mlp = rms_norm(&mlp, post_ffn)?;
            }
            x = {
                let _t = profile::timer(Phase::Elementwise);
                (x + mlp)?
            };

            for (slot, &tl) in taps.iter_mut().zip(&batch.tap_layers) {
                if tl == li {
                    *slot = Some(x.clone());
                }
            }
        }
        drop(attn_seqs);
        drop(storage);

        let logits = if logit_rows.is_empty() {
            Tensor::zeros((0, self.lm_head.out_features()), candle_core::DType::F32, &self.device)?
        } else {
            let idx = Tensor::new(logit_rows.as_slice(), &self.device)?;
            let h = x.index_select(&idx, 0)?;
            let h = rms_norm(&h, &self.norm)?;
            let _t = profile::matmul(
                Phase::LmHead,
                self.lm_head.runs_int8(),
                logit_rows.len(),
                self.lm_head.out_features(),
                self.lm_head.in_features(),
            );
            self.lm_head.forward(&h)?
        };
        for s in batch.seqs.iter_mut() {
            s.cache.advance(s.tokens.len(), bs);
        }
        let taps = taps.into_iter().map(|t| t.context("tap layer not reached")).collect::<Result<Vec<_>>>()?;
        Ok(ForwardOutput { logits, logits_ranges, row_ranges, taps })
    }
}

fn check_shape(
    widths: &[usize],
    cols: usize,
    want: &[usize],
    want_cols: usize,
    layer: usize,
    name: &str,
) -> Result<()> {
    if widths != want || cols != want_cols {
        bail!("blk.{layer}.{name}: output widths {widths:?} × input {cols}, expected {want:?} × {want_cols}");
    }
    Ok(())
}

/// A norm weight must be one vector of `len` values.
fn check_vector(t: &Tensor, len: usize, name: &str) -> Result<()> {
    if t.dims() != [len] {
        bail!("{name}: shape {:?}, expected [{len}]", t.dims());
    }
    Ok(())
}

/// RMSNorm over each `weight.len()`-wide head of `x`, in place.
fn head_rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    for head in x.chunks_exact_mut(weight.len()) {
        let ms = head.iter().map(|v| v * v).sum::<f32>() / weight.len() as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, w) in head.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
}
