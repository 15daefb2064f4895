//! `specula train dflash`: trains a DFlash drafter for a target on data made by
//! `specula train data` (docs/training.md).
//!
//! - [`objective`]: the loss of one sequence (anchors, block mask, decayed cross-entropy),
//!   computed with the drafter's serving forward.
//! - [`optim`]: AdamW, clipping and the learning-rate schedule.
//! - this file: settings, the drafter's initialisation, the training loop (batches, features,
//!   validation, progress), checkpoints, `--resume`, and export in the z-lab layout.
//!
//! Determinism: parameters are initialised from `seed`; the examples of each epoch are
//! shuffled by `(seed, epoch)`, and the anchors of step `s` are drawn from `(seed, s)`, so a
//! run resumed from a checkpoint at step `s` continues exactly as the uninterrupted run.

pub mod objective;
pub mod optim;

use super::data::{read_examples, Example};
use super::features::{target_features, FeatureCache, FeatureKey};
use crate::kv::KvDtype;
use crate::model::Transformer;
use crate::speculative::dflash::{default_target_layer_ids, expected_tensors, DflashConfig, DflashDrafter, TargetHead};
use crate::speculative::nn::RopeTable;
use crate::tokenize::{TokenKind, Tokenizer};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use objective::{scored_rows, sequence_loss, FrozenTarget, ObjectiveSettings, SequenceInput};
use optim::{scheduled_lr, AdamW, AdamWSettings};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Where target features come from during training.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FeatureMode {
    /// The target runs over every example each time it is used.
    Online,
    /// Computed once into an f16 cache in this directory, read back every epoch.
    Offline(PathBuf),
}

/// Everything `specula train dflash` can set. Shape fields left `None` take the target's.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainSettings {
    /// Drafter decoder layers.
    pub layers: usize,
    pub heads: Option<usize>,
    pub kv_heads: Option<usize>,
    pub head_dim: Option<usize>,
    /// Drafter MLP width (default: the target's).
    pub ffn: Option<usize>,
    /// B: block rows (the anchor + B − 1 masks).
    pub block: usize,
    /// Tapped target layers (0-based); None: `n_taps` spread from the second layer to the
    /// third-from-last.
    pub taps: Option<Vec<usize>>,
    pub n_taps: usize,
    /// Anchors drawn per sequence and step.
    pub anchors: usize,
    /// Loss decay γ; None: 7 for B = 16, 5 for 10, 4 for 8, otherwise 0.44·B.
    pub gamma: Option<f64>,
    pub adam: AdamWSettings,
    /// Fraction of the steps spent warming the learning rate up.
    pub warmup: f64,
    /// Gradient clipping (global L2 norm).
    pub clip: f64,
    /// Optimiser steps; None: `epochs` over the training split.
    pub steps: Option<usize>,
    pub epochs: f64,
    /// Sequences per optimiser step.
    pub batch: usize,
    pub seed: u64,
    /// Examples are cut to this many tokens.
    pub max_tokens: usize,
    /// Reduced drafter vocabulary: the N most frequent response tokens. None: the target's.
    pub draft_vocab: Option<usize>,
    /// MASK token id; None: picked from the target's unused control tokens.
    pub mask_token: Option<u32>,
    /// Examples held out for validation (chosen by a hash of their set/id).
    pub val_examples: usize,
    /// Checkpoint (and export) every this many steps.
    pub checkpoint_every: usize,
    /// Initialise drafter layer i from target layer i (attention, MLP and norm weights; q/k
    /// norms 1), `fc` to pass the first tap through and `hidden_norm` to the target's first
    /// attention norm, instead of random weights. Needs the target's head and MLP shapes.
    #[serde(default)]
    pub init_from_target: bool,
    /// Start from this exported drafter's weights, shape, MASK token and vocabulary instead of
    /// a fresh initialisation (to train further with a new schedule or more data).
    #[serde(default)]
    pub init_from: Option<PathBuf>,
    /// Give the drafter's attention q/k/v/o biases (`attention_bias` in its config), the q/k
    /// ones starting as relative-position heads ([`init_relative_position_heads`]).
    #[serde(default)]
    pub attention_bias: bool,
    /// Soft targets: score each row against the target's distribution over the drafter's
    /// vocabulary (forward KL) instead of its greedy token; the features then carry the
    /// target's last layer too ([`TrainSettings::feature_layers`]).
    #[serde(default)]
    pub distill: bool,
}

impl Default for TrainSettings {
    fn default() -> Self {
        Self {
            layers: 2,
            heads: None,
            kv_heads: None,
            head_dim: None,
            ffn: None,
            block: 16,
            taps: None,
            n_taps: 5,
            anchors: 64,
            gamma: None,
            adam: AdamWSettings::default(),
            warmup: 0.04,
            clip: 1.0,
            steps: None,
            epochs: 1.0,
            batch: 8,
            seed: 0,
            max_tokens: 1024,
            draft_vocab: None,
            mask_token: None,
            val_examples: 32,
            checkpoint_every: 200,
            init_from_target: false,
            init_from: None,
            attention_bias: false,
            distill: false,
        }
    }
}

impl TrainSettings {
    /// The target layers whose taps the trainer needs: the drafter's `taps`, then the
    /// target's last layer when distilling.
    pub fn feature_layers(&self, taps: &[usize], target_layers: usize) -> Vec<usize> {
        let mut l = taps.to_vec();
        if self.distill {
            l.push(target_layers - 1);
        }
        l
    }

    pub fn gamma(&self) -> f64 {
        self.gamma.unwrap_or(match self.block {
            16 => 7.0,
            10 => 5.0,
            8 => 4.0,
            b => 0.44 * b as f64,
        })
    }

    pub fn validate(&self) -> Result<()> {
        if self.layers == 0 {
            bail!("--layers must be at least 1");
        }
        if self.block < 2 {
            bail!("--block must be at least 2 (the anchor and one mask)");
        }
        if self.anchors == 0 || self.batch == 0 {
            bail!("--anchors and --batch must be at least 1");
        }
        if !(self.adam.lr > 0.0 && self.adam.lr.is_finite()) {
            bail!("--lr must be a positive number");
        }
        if !(0.0..1.0).contains(&self.warmup) {
            bail!("--warmup must be in [0, 1)");
        }
        if self.gamma() <= 0.0 || !self.gamma().is_finite() {
            bail!("--gamma must be positive");
        }
        if self.steps == Some(0) || (self.steps.is_none() && !(self.epochs > 0.0 && self.epochs.is_finite())) {
            bail!("--steps must be at least 1 (or --epochs positive)");
        }
        if self.max_tokens < 2 {
            bail!("--max-tokens must be at least 2");
        }
        if self.checkpoint_every == 0 {
            bail!("--checkpoint-every must be at least 1");
        }
        if self.draft_vocab == Some(0) {
            bail!("--draft-vocab must be at least 1");
        }
        Ok(())
    }
}

/// One training example as the trainer uses it.
#[derive(Debug, Clone)]
pub struct TrainExample {
    /// `set/id`.
    pub key: String,
    pub tokens: Vec<u32>,
    pub loss_mask: Vec<u8>,
}

impl TrainExample {
    pub fn from_example(e: &Example, max_tokens: usize) -> Self {
        let n = e.tokens.len().min(max_tokens);
        Self {
            key: format!("{}/{}", e.set, e.id),
            tokens: e.tokens[..n].to_vec(),
            loss_mask: e.loss_mask[..n].to_vec(),
        }
    }

    /// Positions that can anchor a block: response tokens with at least one token after them.
    fn anchor_candidates(&self) -> Vec<usize> {
        (0..self.tokens.len().saturating_sub(1)).filter(|&p| self.loss_mask[p] == 1).collect()
    }
}

/// Reads a `specula train data` directory into examples (cut to `max_tokens`).
pub fn load_examples(dir: &Path, max_tokens: usize) -> Result<Vec<TrainExample>> {
    let scan = read_examples(dir, false)?;
    let examples: Vec<TrainExample> = scan
        .examples
        .iter()
        .map(|e| TrainExample::from_example(e, max_tokens))
        .filter(|e| !e.anchor_candidates().is_empty())
        .collect();
    if examples.is_empty() {
        bail!("{} holds no example with a response to learn from", dir.display());
    }
    Ok(examples)
}

/// Splits examples into (train, validation) by a hash of their key: the same split whatever
/// the order of the shards.
pub fn split_validation(mut examples: Vec<TrainExample>, val: usize) -> (Vec<TrainExample>, Vec<TrainExample>) {
    let val = val.min(examples.len() / 2);
    let hash = |k: &str| {
        use sha2::Digest;
        let d = sha2::Sha256::digest(k.as_bytes());
        u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
    };
    examples.sort_by_key(|e| (hash(&e.key), e.key.clone()));
    let train = examples.split_off(val);
    let (mut train, mut val) = (train, examples);
    train.sort_by(|a, b| a.key.cmp(&b.key));
    val.sort_by(|a, b| a.key.cmp(&b.key));
    (train, val)
}

/// [`split_validation`] of `val_pool` (examples made apart, such as the target's answers when
/// training on a data set's own) held out, and every example of `examples` for one of the same
/// prompts left out of training. The held-out keys get a `val:` prefix so that an offline
/// feature cache never mixes them with a training example of the same prompt.
pub fn split_validation_from(
    examples: Vec<TrainExample>,
    val_pool: Vec<TrainExample>,
    val: usize,
) -> Result<(Vec<TrainExample>, Vec<TrainExample>)> {
    let (_, mut held) = split_validation(val_pool, val);
    let keys: std::collections::HashSet<&str> = held.iter().map(|e| e.key.as_str()).collect();
    let train: Vec<TrainExample> = examples.into_iter().filter(|e| !keys.contains(e.key.as_str())).collect();
    if train.is_empty() {
        bail!("the validation data holds every prompt of the training data: nothing left to train on");
    }
    for e in &mut held {
        e.key = format!("val:{}", e.key);
    }
    Ok((train, held))
}

/// The MASK token: the highest-numbered control/unused token of the target's tokenizer that
/// never occurs in the examples, else the highest-numbered token that never occurs.
pub fn pick_mask_token(tokenizer: &Tokenizer, vocab: usize, examples: &[TrainExample]) -> Result<u32> {
    let mut seen = vec![false; vocab];
    for e in examples {
        for &t in &e.tokens {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
    }
    let unseen = |id: &u32| !seen[*id as usize];
    let special = (0..vocab as u32)
        .rev()
        .filter(unseen)
        .find(|&id| matches!(tokenizer.token_kind(id), Some(TokenKind::Control | TokenKind::Unused)));
    special
        .or_else(|| (0..vocab as u32).rev().find(unseen))
        .context("every token of the vocabulary occurs in the data: give --mask-token")
}

/// The `n` most frequent response tokens (ties: lower id first), sorted by id.
pub fn frequent_tokens(examples: &[TrainExample], vocab: usize, n: usize) -> Vec<u32> {
    let mut counts = vec![0u64; vocab];
    for e in examples {
        for (&t, &m) in e.tokens.iter().zip(&e.loss_mask) {
            if m == 1 && (t as usize) < vocab {
                counts[t as usize] += 1;
            }
        }
    }
    let mut ids: Vec<u32> = (0..vocab as u32).collect();
    ids.sort_by_key(|&id| (std::cmp::Reverse(counts[id as usize]), id));
    ids.truncate(n.min(vocab));
    ids.sort_unstable();
    ids
}

/// The drafter's shape for `target` under `settings`.
pub fn drafter_config(target: &Transformer, settings: &TrainSettings, mask_token: u32) -> Result<DflashConfig> {
    let t = &target.config;
    let taps = match &settings.taps {
        Some(t) => t.clone(),
        None => default_target_layer_ids(t.n_layers, settings.n_taps),
    };
    let mut config = DflashConfig::for_target(
        t,
        settings.layers,
        settings.heads.unwrap_or(t.n_heads),
        settings.kv_heads.unwrap_or(t.n_kv_heads),
        settings.head_dim.unwrap_or(t.head_dim),
        settings.ffn.unwrap_or(t.ffn),
        settings.block,
        taps,
        mask_token,
    );
    config.draft_vocab_size = settings.draft_vocab;
    config.attention_bias = settings.attention_bias;
    config.check_target(t)?;
    if !config.n_heads.is_multiple_of(config.n_kv_heads) || !config.head_dim.is_multiple_of(2) {
        bail!(
            "drafter heads: {} query heads, {} KV heads, head_dim {}",
            config.n_heads,
            config.n_kv_heads,
            config.head_dim
        );
    }
    Ok(config)
}

/// Fresh parameters for `config`, from `seed`: linear weights ~ N(0, 0.02), norm weights 1.
/// Sorted by name (the order of gradients, moments and checkpoints).
pub fn init_params(config: &DflashConfig, seed: u64, device: &Device) -> Result<Vec<(String, Var)>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut params = Vec::new();
    let mut shapes = expected_tensors(config);
    shapes.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, shape) in shapes {
        let count: usize = shape.iter().product();
        let values: Vec<f32> = if name.ends_with("norm.weight") || name.ends_with("_norm.weight") {
            vec![1.0; count]
        } else if name.ends_with(".bias") {
            vec![0.0; count]
        } else {
            (0..count).map(|_| 0.02 * standard_normal(&mut rng)).collect()
        };
        params.push((name, Var::from_tensor(&Tensor::from_vec(values, shape.as_slice(), device)?)?));
    }
    Ok(params)
}

pub(crate) fn standard_normal(rng: &mut StdRng) -> f32 {
    // Box–Muller: two uniforms in (0, 1].
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// Copies target layer i into drafter layer i (see [`TrainSettings::init_from_target`]). GGUF
/// llama files store q/k rows permuted for interleaved RoPE; the drafter rotates halves
/// (NeoX), so those rows are put back in Hugging Face order.
pub fn init_from_target_layers(config: &DflashConfig, params: &[(String, Var)], target: &Transformer) -> Result<()> {
    let t = &target.config;
    if config.n_layers > t.n_layers
        || (config.n_heads, config.n_kv_heads, config.head_dim, config.ffn)
            != (t.n_heads, t.n_kv_heads, t.head_dim, t.ffn)
    {
        bail!(
            "--init-from-target needs the target's heads, KV heads, head width and MLP width ({}, {}, {}, {})",
            t.n_heads,
            t.n_kv_heads,
            t.head_dim,
            t.ffn
        );
    }
    let set = |name: &str, value: Tensor| set_param(params, name, &value);
    let unpermute = |w: Tensor, heads: usize| -> Result<Tensor> {
        if t.rope_style != crate::model::RopeStyle::Interleaved {
            return Ok(w);
        }
        let (rows, cols) = w.dims2()?;
        let hd = rows / heads;
        // GGUF row h·hd + 2r + j holds Hugging Face row h·hd + j·hd/2 + r.
        Ok(w.reshape((heads, hd / 2, 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))?)
    };
    for i in 0..config.n_layers {
        let g = |n: &str| target.read_dense(&format!("blk.{i}.{n}.weight"));
        let d = |n: &str| format!("layers.{i}.{n}.weight");
        set(&d("input_layernorm"), g("attn_norm")?)?;
        set(&d("post_attention_layernorm"), g("ffn_norm")?)?;
        set(&d("self_attn.q_proj"), unpermute(g("attn_q")?, t.n_heads)?)?;
        set(&d("self_attn.k_proj"), unpermute(g("attn_k")?, t.n_kv_heads)?)?;
        set(&d("self_attn.v_proj"), g("attn_v")?)?;
        set(&d("self_attn.o_proj"), g("attn_output")?)?;
        set(&d("mlp.gate_proj"), g("ffn_gate")?)?;
        set(&d("mlp.up_proj"), g("ffn_up")?)?;
        set(&d("mlp.down_proj"), g("ffn_down")?)?;
    }
    // fc passes the first tap through; the context rows then look like a residual stream.
    let h = config.hidden;
    let k = config.target_layer_ids.len();
    let eye = Tensor::eye(h, DType::F32, target.device())?;
    let zeros = Tensor::zeros((h, (k - 1) * h), DType::F32, target.device())?;
    set("fc.weight", Tensor::cat(&[&eye, &zeros], 1)?)?;
    set("hidden_norm.weight", target.read_dense("blk.0.attn_norm.weight")?)?;
    Ok(())
}

/// Sets the parameter `name` to `value`, which must have its shape.
fn set_param(params: &[(String, Var)], name: &str, value: &Tensor) -> Result<()> {
    let (_, v) = params.iter().find(|(n, _)| n == name).with_context(|| format!("no parameter `{name}`"))?;
    if v.dims() != value.dims() {
        bail!("`{name}`: a tensor of shape {:?} for a parameter of shape {:?}", value.dims(), v.dims());
    }
    Ok(v.set(value)?)
}

/// Query head `h` of every layer starts as a head that looks `1 + h/2` positions back.
pub fn relative_position_head_offset(head: usize) -> usize {
    1 + head / 2
}

/// Starts the q/k biases of a drafter with attention biases as relative-position heads. Why:
/// from random weights every head spreads its attention evenly over the context and the block,
/// so the one row that carries the anchor's token (and the context just before it) reaches a
/// block row with a weight of about 1/(context length), and the drafter spends many steps
/// learning where to look. Here, on the fastest [`POSITION_PAIRS`] RoPE pairs, every key bias
/// is the same vector `a` and query head `h`'s bias is `a` rotated back by
/// δ = [`relative_position_head_offset`]`(h)` positions, so a query at position m scores a key
/// at n by Σ cos(θᵢ·(m − n − δ)), largest at n = m − δ; q/k norm weights start at 2 to make
/// that peak sharp. The weights stay random, so content can take over as training proceeds.
pub fn init_relative_position_heads(config: &DflashConfig, params: &[(String, Var)]) -> Result<()> {
    const BIAS: f32 = 3.0;
    const NORM: f32 = 2.0;
    let d = config.head_dim;
    let pairs = POSITION_PAIRS.min(d / 2);
    let rope = RopeTable::new(d, config.rope_theta);
    let mut q = vec![0f32; config.n_heads * d];
    for h in 0..config.n_heads {
        let delta = relative_position_head_offset(h) as f32;
        for (i, theta) in rope.inv_freq()[..pairs].iter().enumerate() {
            let angle = theta * delta;
            q[h * d + i] = BIAS * angle.cos();
            q[h * d + d / 2 + i] = -BIAS * angle.sin();
        }
    }
    let mut k = vec![0f32; config.n_kv_heads * d];
    for h in 0..config.n_kv_heads {
        k[h * d..h * d + pairs].fill(BIAS);
    }
    let device = params.first().map_or(Device::Cpu, |(_, v)| v.device().clone());
    let q = Tensor::from_vec(q, config.n_heads * d, &device)?;
    let k = Tensor::from_vec(k, config.n_kv_heads * d, &device)?;
    let norm = Tensor::full(NORM, d, &device)?;
    for l in 0..config.n_layers {
        set_param(params, &format!("layers.{l}.self_attn.q_proj.bias"), &q)?;
        set_param(params, &format!("layers.{l}.self_attn.k_proj.bias"), &k)?;
        set_param(params, &format!("layers.{l}.self_attn.q_norm.weight"), &norm)?;
        set_param(params, &format!("layers.{l}.self_attn.k_norm.weight"), &norm)?;
    }
    Ok(())
}

/// RoPE pairs (the fastest-turning) that carry [`init_relative_position_heads`]' pattern.
pub const POSITION_PAIRS: usize = 12;

/// A drafter whose weights are `params` (sharing their storage: updating a variable updates
/// the drafter).
pub fn drafter_from_params(config: &DflashConfig, params: &[(String, Var)], device: &Device) -> Result<DflashDrafter> {
    let tensors: HashMap<String, Tensor> = params.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
    let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, device);
    DflashDrafter::from_var_builder(config.clone(), vb)
}

/// The frozen parts of the target the objective needs.
pub fn frozen_target(target: &Transformer, draft_vocab: Option<&[u32]>) -> Result<FrozenTarget> {
    let weights = target.lm_head_weights()?;
    let device = target.device();
    let (lm_head, target_to_draft) = match draft_vocab {
        None => (weights.dequantize(device)?, None),
        Some(ids) => {
            let rows = crate::speculative::dflash::model::select_rows(&weights, ids, device)?;
            let mut map = vec![u32::MAX; target.config.vocab];
            for (d, &t) in ids.iter().enumerate() {
                map[t as usize] = d as u32;
            }
            (rows.dequantize(device)?, Some(map))
        }
    };
    Ok(FrozenTarget { head: TargetHead::of(target), lm_head: lm_head.to_dtype(DType::F32)?, target_to_draft })
}

/// Where the features of an example come from.
pub enum Features<'a> {
    Online { target: &'a Transformer, layer_ids: Vec<usize> },
    Offline(FeatureCache),
}

impl Features<'_> {
    pub fn get(&mut self, e: &TrainExample, device: &Device) -> Result<Tensor> {
        match self {
            Features::Online { target, layer_ids } => target_features(target, layer_ids, &e.tokens, KvDtype::F16),
            Features::Offline(cache) => cache.read(&e.key, device),
        }
    }
}

/// Fills an offline cache with the features of every example not yet in it, printing the disk
/// size first. `progress(done, total)` is called as it goes.
pub fn fill_feature_cache(
    cache: &mut FeatureCache,
    key: &FeatureKey,
    target: &Transformer,
    examples: &[&TrainExample],
    mut progress: impl FnMut(usize, usize),
) -> Result<()> {
    let todo: Vec<&&TrainExample> = examples.iter().filter(|e| !cache.contains(&e.key)).collect();
    let tokens: u64 = examples.iter().map(|e| e.tokens.len() as u64).sum();
    eprintln!(
        "target features: {} tokens of {} examples take {:.2} GB on disk as f16 ({} to compute)",
        tokens,
        examples.len(),
        FeatureCache::bytes_for(tokens, key) as f64 / 1e9,
        todo.len()
    );
    let mut last_flush = Instant::now();
    for (i, e) in todo.iter().enumerate() {
        let f = target_features(target, &key.layer_ids, &e.tokens, KvDtype::F16)?;
        cache.append(&e.key, &f)?;
        if last_flush.elapsed().as_secs() >= 30 {
            cache.flush_index()?;
            last_flush = Instant::now();
        }
        progress(i + 1, todo.len());
    }
    cache.flush_index()
}

/// Aggregated metrics of some sequences.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Metrics {
    pub loss: f64,
    /// Per block offset k = 1..B−1: fraction of scored rows whose argmax is the label.
    pub accuracy: Vec<Option<f64>>,
    /// Estimated acceptance length: 1 + mean leading hits per block.
    pub tau: f64,
    pub blocks: usize,
    pub scored_rows: usize,
}

#[derive(Default)]
struct Tally {
    weighted_ce: f64,
    weight: f64,
    scored: Vec<usize>,
    hits: Vec<usize>,
    accepted: usize,
    blocks: usize,
}

impl Tally {
    fn add(&mut self, l: &objective::SequenceLoss) {
        if self.scored.is_empty() {
            self.scored = vec![0; l.scored.len()];
            self.hits = vec![0; l.hits.len()];
        }
        self.weighted_ce += l.weighted_hard_ce;
        self.weight += l.weight_sum;
        for k in 0..l.scored.len() {
            self.scored[k] += l.scored[k];
            self.hits[k] += l.hits[k];
        }
        self.accepted += l.accepted.iter().sum::<usize>();
        self.blocks += l.accepted.len();
    }

    fn metrics(&self) -> Metrics {
        Metrics {
            loss: if self.weight > 0.0 { self.weighted_ce / self.weight } else { 0.0 },
            accuracy: self.scored.iter().zip(&self.hits).map(|(&s, &h)| (s > 0).then(|| h as f64 / s as f64)).collect(),
            tau: 1.0 + self.accepted as f64 / self.blocks.max(1) as f64,
            blocks: self.blocks,
            scored_rows: self.scored.iter().sum(),
        }
    }
}

/// Anchors for one sequence at one step: up to `n` distinct candidates, sorted.
fn draw_anchors(e: &TrainExample, n: usize, rng: &mut StdRng) -> Vec<usize> {
    let mut c = e.anchor_candidates();
    c.shuffle(rng);
    c.truncate(n);
    c.sort_unstable();
    c
}

pub(crate) fn step_rng(seed: u64, stream: u64, index: u64) -> StdRng {
    StdRng::seed_from_u64(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03))
}

/// The state a checkpoint holds besides tensors.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointMeta {
    pub step: usize,
    pub total_steps: usize,
    pub settings: TrainSettings,
    pub config: serde_json::Value,
    pub draft_vocab: Option<Vec<u32>>,
    pub data_examples: usize,
    /// Training time so far (seconds, all runs).
    pub train_secs: f64,
    pub history: Vec<LogLine>,
}

/// One line of `train-log.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogLine {
    pub step: usize,
    pub lr: f64,
    pub grad_norm: f64,
    pub train: Metrics,
    pub val: Option<Metrics>,
    /// Scored block rows per second over the steps since the previous line.
    pub rows_per_sec: f64,
    pub tokens_per_sec: f64,
    pub peak_rss_mb: Option<f64>,
}

/// What a finished (or stopped) run reports.
#[derive(Debug, Clone)]
pub struct TrainReport {
    pub steps: usize,
    pub total_steps: usize,
    pub train_examples: usize,
    pub val_examples: usize,
    pub last: Option<LogLine>,
    pub final_val: Option<Metrics>,
    pub drafter_dir: PathBuf,
    pub secs: f64,
    pub rows_per_sec: f64,
    pub peak_rss_mb: Option<f64>,
}

/// Peak resident memory of this process (Linux), in MB.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// How the trainer reports progress.
pub trait TrainObserver {
    fn step(&mut self, _step: usize, _total: usize, _loss: f64, _tau: f64) {}
    fn log(&mut self, _line: &LogLine) {}
}

impl TrainObserver for () {}

/// A training run: examples, target, output directory.
pub struct TrainRun<'a> {
    pub target: &'a Transformer,
    pub tokenizer: &'a Tokenizer,
    pub train: Vec<TrainExample>,
    pub val: Vec<TrainExample>,
    pub settings: TrainSettings,
    pub out: PathBuf,
    pub resume: bool,
    /// Stop after this many steps in this process (the schedule still spans all steps);
    /// None: run to the end.
    pub stop_after: Option<usize>,
    /// Export dtype of the drafter's weights.
    pub export_dtype: DType,
    /// Log (and validate) every this many steps.
    pub log_every: usize,
}

const CHECKPOINT: &str = "checkpoint";

impl TrainRun<'_> {
    pub fn total_steps(&self) -> usize {
        self.settings
            .steps
            .unwrap_or_else(|| {
                ((self.settings.epochs * self.train.len() as f64) / self.settings.batch as f64).ceil() as usize
            })
            .max(1)
    }

    /// Runs (or resumes) training with features from `features`; checkpoints and exports into
    /// `out` as it goes.
    pub fn run(&self, features: &mut Features, observer: &mut dyn TrainObserver) -> Result<TrainReport> {
        let s = &self.settings;
        s.validate()?;
        if self.train.is_empty() {
            bail!("no training examples");
        }
        let device = self.target.device().clone();
        let total = self.total_steps();
        std::fs::create_dir_all(&self.out).with_context(|| format!("cannot create {}", self.out.display()))?;
        let ckpt_dir = self.out.join(CHECKPOINT);

        // Shape, vocabulary and MASK: from the checkpoint when resuming, else from the data.
        let (config, draft_vocab, params, start, mut history, secs_before, moments) = if self.resume {
            let meta: CheckpointMeta = serde_json::from_str(
                &std::fs::read_to_string(ckpt_dir.join("state.json"))
                    .with_context(|| format!("--resume: no checkpoint in {}", ckpt_dir.display()))?,
            )?;
            if serde_json::to_value(&meta.settings)? != serde_json::to_value(s)? {
                bail!("--resume with other settings than the checkpoint's: {:?}", meta.settings);
            }
            if meta.data_examples != self.train.len() + self.val.len() {
                bail!(
                    "--resume: the checkpoint saw {} examples, the data has {}",
                    meta.data_examples,
                    self.train.len() + self.val.len()
                );
            }
            let config = DflashConfig::from_json(&meta.config)?;
            let tensors = candle_core::safetensors::load(ckpt_dir.join("state.safetensors"), &device)?;
            let mut params = Vec::new();
            let mut names: Vec<String> = expected_tensors(&config).into_iter().map(|(n, _)| n).collect();
            names.sort();
            for name in names {
                let t = tensors.get(&name).with_context(|| format!("checkpoint has no `{name}`"))?;
                params.push((name, Var::from_tensor(t)?));
            }
            (config, meta.draft_vocab, params, meta.step, meta.history, meta.train_secs, Some(tensors))
        } else if let Some(dir) = &s.init_from {
            let drafter = DflashDrafter::load(dir, &device)?;
            let mut config = drafter.config.clone();
            config.check_target(&self.target.config).with_context(|| format!("--init-from {}", dir.display()))?;
            if config.block_size != s.block {
                // The weights do not depend on the block size: the same drafter trains (and
                // drafts) on blocks of any length.
                eprintln!(
                    "--init-from {}: block size {} becomes --block {}",
                    dir.display(),
                    config.block_size,
                    s.block
                );
                config.block_size = s.block;
            }
            let vocab = drafter.draft_vocab().map(|v| v.to_vec());
            let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &device)?;
            let mut names: Vec<String> = expected_tensors(&config).into_iter().map(|(n, _)| n).collect();
            names.sort();
            let mut params = Vec::new();
            for name in names {
                let t = tensors.get(&name).with_context(|| format!("--init-from: no `{name}`"))?;
                params.push((name, Var::from_tensor(&t.to_dtype(DType::F32)?)?));
            }
            (config, vocab, params, 0, Vec::new(), 0.0, None)
        } else {
            let mut all: Vec<TrainExample> = self.train.clone();
            all.extend(self.val.iter().cloned());
            let mask = match s.mask_token {
                Some(m) => m,
                None => pick_mask_token(self.tokenizer, self.target.config.vocab, &all)?,
            };
            let config = drafter_config(self.target, s, mask)?;
            let vocab = s.draft_vocab.map(|n| frequent_tokens(&self.train, self.target.config.vocab, n));
            let mut config = config;
            if let Some(v) = &vocab {
                config.draft_vocab_size = Some(v.len());
            }
            let params = init_params(&config, s.seed, &device)?;
            if s.init_from_target {
                init_from_target_layers(&config, &params, self.target)?;
            }
            if config.attention_bias {
                init_relative_position_heads(&config, &params)?;
            }
            (config, vocab, params, 0, Vec::new(), 0.0, None)
        };
        let mut drafter = drafter_from_params(&config, &params, &device)?;
        drafter.set_draft_vocab(draft_vocab.clone())?;
        let frozen = frozen_target(self.target, draft_vocab.as_deref())?;
        let mut opt = AdamW::new(params, s.adam)?;
        if let Some(t) = &moments {
            opt.load_state(t, start)?;
        }
        let objective = ObjectiveSettings { block: s.block, gamma: s.gamma(), distill: s.distill };
        let warmup = ((s.warmup * total as f64).ceil() as usize).max(1);
        let end = self.stop_after.map_or(total, |n| (start + n).min(total));
        let t0 = Instant::now();
        let (mut rows_since, mut tokens_since, mut since) = (0usize, 0usize, Instant::now());
        let (mut rows_all, mut last) = (0usize, None);
        let mut tally = Tally::default();
        for step in start..end {
            let lr = scheduled_lr(s.adam.lr, step, total, warmup);
            let batch = self.batch_indices(step);
            let mut rng = step_rng(s.seed, 1, step as u64);
            let anchors: Vec<Vec<usize>> =
                batch.iter().map(|&i| draw_anchors(&self.train[i], s.anchors, &mut rng)).collect();
            // The batch's total weight first, so each sequence's backward is already scaled.
            let weight: f64 = batch
                .iter()
                .zip(&anchors)
                .map(|(&i, a)| {
                    let e = &self.train[i];
                    scored_rows(&e.tokens, &e.loss_mask, a, s.block, objective.gamma, &frozen)
                        .iter()
                        .map(|r| r.weight as f64)
                        .sum::<f64>()
                })
                .sum();
            let mut grads: Vec<Option<Tensor>> = vec![None; opt.params().len()];
            for (&i, a) in batch.iter().zip(&anchors) {
                let e = &self.train[i];
                let f = features.get(e, &device)?;
                let input = SequenceInput { tokens: &e.tokens, loss_mask: &e.loss_mask, features: &f, anchors: a };
                let l = sequence_loss(&drafter, &frozen, &input, objective)?;
                tally.add(&l);
                rows_since += l.scored.iter().sum::<usize>();
                rows_all += l.scored.iter().sum::<usize>();
                tokens_since += e.tokens.len();
                if weight > 0.0 && l.weight_sum > 0.0 {
                    accumulate_grads(&mut grads, &(l.weighted_ce / weight)?.backward()?, opt.params())?;
                }
            }
            let grads = finish_grads(grads, opt.params())?;
            let grad_norm = opt.step(&grads, lr, s.clip)?;
            let m = tally.metrics();
            observer.step(step + 1, total, m.loss, m.tau);

            let done = step + 1;
            let log_now = done % self.log_every.max(1) == 0 || done == end;
            let ckpt_now = done % s.checkpoint_every == 0 || done == end;
            if log_now || ckpt_now {
                let secs = since.elapsed().as_secs_f64().max(1e-9);
                let val = if ckpt_now || done == end {
                    Some(self.validate(&drafter, &frozen, features, objective)?)
                } else {
                    None
                };
                let line = LogLine {
                    step: done,
                    lr,
                    grad_norm,
                    train: std::mem::take(&mut tally).metrics(),
                    val,
                    rows_per_sec: rows_since as f64 / secs,
                    tokens_per_sec: tokens_since as f64 / secs,
                    peak_rss_mb: peak_rss_mb(),
                };
                observer.log(&line);
                append_log(&self.out, &line)?;
                history.push(line.clone());
                last = Some(line);
                (rows_since, tokens_since, since) = (0, 0, Instant::now());
            }
            if ckpt_now {
                let meta = CheckpointMeta {
                    step: done,
                    total_steps: total,
                    settings: s.clone(),
                    config: config.to_json(self.target.config.vocab, self.target.config.context_len)?,
                    draft_vocab: draft_vocab.clone(),
                    data_examples: self.train.len() + self.val.len(),
                    train_secs: secs_before + t0.elapsed().as_secs_f64(),
                    history: history.clone(),
                };
                save_checkpoint(&ckpt_dir, &opt, &meta)?;
                export(
                    &self.out.join("drafter"),
                    &config,
                    opt.params(),
                    draft_vocab.as_deref(),
                    self.target.config.vocab,
                    self.target.config.context_len,
                    self.export_dtype,
                )?;
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let final_val = last.as_ref().and_then(|l| l.val.clone());
        Ok(TrainReport {
            steps: end,
            total_steps: total,
            train_examples: self.train.len(),
            val_examples: self.val.len(),
            last,
            final_val,
            drafter_dir: self.out.join("drafter"),
            secs,
            rows_per_sec: rows_all as f64 / secs.max(1e-9),
            peak_rss_mb: peak_rss_mb(),
        })
    }

    fn batch_indices(&self, step: usize) -> Vec<usize> {
        batch_indices(self.train.len(), self.settings.batch, self.settings.seed, step)
    }

    /// Metrics on the validation examples with fixed anchors (the same every time).
    fn validate(
        &self,
        drafter: &DflashDrafter,
        frozen: &FrozenTarget,
        features: &mut Features,
        objective: ObjectiveSettings,
    ) -> Result<Metrics> {
        let mut tally = Tally::default();
        for (i, e) in self.val.iter().enumerate() {
            let mut rng = step_rng(self.settings.seed, 3, i as u64);
            let anchors = draw_anchors(e, self.settings.anchors, &mut rng);
            let f = features.get(e, drafter.device())?;
            let input = SequenceInput { tokens: &e.tokens, loss_mask: &e.loss_mask, features: &f, anchors: &anchors };
            let l = sequence_loss(drafter, frozen, &input, objective)?;
            tally.add(&l);
        }
        Ok(tally.metrics())
    }
}

/// Example indices of step `step` (of `n` examples, `b` per step): consecutive slices of
/// per-epoch shuffles.
pub(crate) fn batch_indices(n: usize, b: usize, seed: u64, step: usize) -> Vec<usize> {
    // A step spans at most a few epochs' shuffles; each is made once.
    let mut shuffled: Option<(usize, Vec<usize>)> = None;
    (step * b..(step + 1) * b)
        .map(|global| {
            let (epoch, at) = (global / n, global % n);
            if shuffled.as_ref().is_none_or(|(e, _)| *e != epoch) {
                let mut order: Vec<usize> = (0..n).collect();
                order.shuffle(&mut step_rng(seed, 2, epoch as u64));
                shuffled = Some((epoch, order));
            }
            shuffled.as_ref().expect("set above").1[at]
        })
        .collect()
}

pub(crate) fn append_log(out: &Path, line: &LogLine) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(out.join("train-log.jsonl"))?;
    writeln!(f, "{}", serde_json::to_string(line)?)?;
    Ok(())
}

/// Adds one sequence's gradients into the step's per-parameter sums.
pub(crate) fn accumulate_grads(
    sums: &mut [Option<Tensor>],
    g: &candle_core::backprop::GradStore,
    params: &[(String, Var)],
) -> Result<()> {
    for (slot, (_, p)) in sums.iter_mut().zip(params) {
        if let Some(gp) = g.get(p.as_tensor()) {
            *slot = Some(match slot.take() {
                Some(acc) => (acc + gp)?,
                None => gp.clone(),
            });
        }
    }
    Ok(())
}

/// The step's gradients, zero for parameters no sequence reached.
pub(crate) fn finish_grads(sums: Vec<Option<Tensor>>, params: &[(String, Var)]) -> Result<Vec<Tensor>> {
    Ok(sums
        .into_iter()
        .zip(params)
        .map(|(g, (_, p))| g.map_or_else(|| p.zeros_like(), Ok))
        .collect::<candle_core::Result<_>>()?)
}

/// Writes the optimiser's parameters and moments and `meta` (the trainer's own record).
pub(crate) fn save_checkpoint<M: Serialize>(dir: &Path, opt: &AdamW, meta: &M) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut tensors = opt.state();
    for (name, p) in opt.params() {
        tensors.insert(name.clone(), p.as_tensor().clone());
    }
    // Written to temporary names and renamed: a run killed mid-write keeps the previous one.
    let (st_tmp, json_tmp) = (dir.join("state.safetensors.tmp"), dir.join("state.json.tmp"));
    candle_core::safetensors::save(&tensors, &st_tmp)?;
    std::fs::write(&json_tmp, serde_json::to_string_pretty(meta)?)?;
    std::fs::rename(&st_tmp, dir.join("state.safetensors"))?;
    std::fs::rename(&json_tmp, dir.join("state.json"))?;
    Ok(())
}

/// Writes a drafter in the z-lab layout: `config.json` and `model.safetensors` (weights in
/// `dtype`; with a reduced vocabulary also `d2t`, the target id of each drafter token).
pub fn export(
    dir: &Path,
    config: &DflashConfig,
    params: &[(String, Var)],
    draft_vocab: Option<&[u32]>,
    target_vocab: usize,
    max_positions: usize,
    dtype: DType,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (name, p) in params {
        tensors.insert(name.clone(), p.as_tensor().to_dtype(dtype)?);
    }
    if let Some(ids) = draft_vocab {
        let ids: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        let n = ids.len();
        tensors.insert("d2t".into(), Tensor::from_vec(ids, n, &Device::Cpu)?);
    }
    let mut json = config.to_json(target_vocab, max_positions)?;
    json["torch_dtype"] = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
    .into();
    let tmp = dir.join("model.safetensors.tmp");
    candle_core::safetensors::save(&tensors, &tmp)?;
    // The writer creates owner-only files; an exported drafter is meant to be shared.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))?;
    }
    std::fs::rename(&tmp, dir.join("model.safetensors"))?;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&json)? + "\n")?;
    Ok(())
}
