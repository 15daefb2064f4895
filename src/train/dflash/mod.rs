//! `specula train dflash`: trains a DFlash drafter for a target on data made by
//! `specula train data` (docs/training.md).
//!
//! - [`objective`]: the loss of one sequence (anchors, block mask, decayed cross-entropy),
//!   computed with the drafter's serving forward.
//! - this file: settings, the drafter's initialisation, the run loop as named steps (where a
//!   run starts: fresh, `--init-from` or `--resume`; a training step; validation with the
//!   serving walk; saving), and export in the z-lab layout. The optimiser, checkpoints,
//!   features, the held-out split and the progress tallies are the kit in [`super`].
//!
//! Determinism: parameters are initialised from `seed`; the examples of each epoch are
//! shuffled by `(seed, epoch)`, and the anchors of step `s` are drawn from `(seed, s)`, so a
//! run resumed from a checkpoint at step `s` continues exactly as the uninterrupted run.

pub mod objective;

use super::checkpoint::{self, CheckpointMeta};
use super::examples::{batch_indices, standard_normal, step_rng, TrainExample};
use super::features::Features;
use super::optim::{AdamW, AdamWSettings, LrSchedule};
use super::progress::{append_log, peak_rss_mb, LogLine, Metrics, StepProgress, Tally, TrainObserver, TrainReport};
use super::validation::{simulate_verify_steps, RecordedRun, TrainingRecord};
use super::vocab::{frequent_tokens, Coverage};
use crate::model::Transformer;
use crate::speculative::dflash::{default_target_layer_ids, expected_tensors, DflashConfig, DflashDrafter, TargetHead};
use crate::speculative::nn::RopeTable;
use crate::tokenize::{TokenKind, Tokenizer};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use objective::{scored_rows, sequence_loss, FrozenTarget, ObjectiveSettings, PositionWeights, SequenceInput};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

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
    /// Loss decay γ; None: 2 (measured: see docs/training.md, "Why this recipe").
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
    /// Reduced drafter vocabulary: the N most frequent response tokens of the run's data,
    /// picked at the start of every run (with `init_from`: only when given; else the
    /// drafter's own is kept). None, or N at least the target's vocabulary: the target's.
    pub draft_vocab: Option<usize>,
    /// With `init_from`: keep the drafter's own vocabulary instead (its coverage of the data is
    /// printed, with a warning when re-picking would cover more).
    #[serde(default)]
    pub keep_draft_vocab: bool,
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
    /// Drafted tokens per verify step in the serving-shaped validation estimate (the `max` a
    /// drafter is served with).
    #[serde(default = "default_serving_draft_len")]
    pub serving_draft_len: usize,
    /// Per-offset loss weights (offset 1 first; past the list: 0) instead of γ's decay.
    #[serde(default)]
    pub position_weights: Option<Vec<f64>>,
}

fn default_serving_draft_len() -> usize {
    7
}

impl Default for TrainSettings {
    /// The recipe the shipped drafters were trained with (docs/training.md, "Why this
    /// recipe"): two layers of the target's shape with relative-position heads, blocks of 8
    /// (what serving drafts at 7 tokens per step), γ 2, 2 sequences × 48 anchors per step,
    /// learning rate 1e-3, and a 16,384-token draft vocabulary.
    fn default() -> Self {
        Self {
            layers: 2,
            heads: None,
            kv_heads: None,
            head_dim: None,
            ffn: None,
            block: 8,
            taps: None,
            n_taps: 5,
            anchors: 48,
            gamma: None,
            adam: AdamWSettings { lr: 1e-3, ..AdamWSettings::default() },
            warmup: 0.04,
            clip: 1.0,
            steps: None,
            epochs: 1.0,
            batch: 2,
            seed: 0,
            max_tokens: 1024,
            draft_vocab: Some(16384),
            keep_draft_vocab: false,
            mask_token: None,
            val_examples: 64,
            checkpoint_every: 200,
            init_from_target: false,
            init_from: None,
            attention_bias: true,
            distill: false,
            serving_draft_len: 7,
            position_weights: None,
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
        self.gamma.unwrap_or(2.0)
    }

    /// How the loss weighs block offsets: the given table, else γ's decay.
    pub fn position_weights(&self) -> Result<PositionWeights> {
        match &self.position_weights {
            Some(w) => PositionWeights::table(w),
            None => Ok(PositionWeights::Decay { gamma: self.gamma() }),
        }
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
        self.position_weights()?;
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
        if !(1..=64).contains(&self.serving_draft_len) {
            bail!("--serving-draft-len must be 1..=64");
        }
        Ok(())
    }
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
    let device = params.first().context("a drafter without parameters")?.1.device().clone();
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

/// A training run: examples, target, output directory.
pub struct TrainRun<'a> {
    pub target: &'a Transformer,
    pub tokenizer: &'a Tokenizer,
    pub train: Vec<TrainExample>,
    pub val: Vec<TrainExample>,
    pub settings: TrainSettings,
    pub out: PathBuf,
    /// Continue from `OUT/checkpoint`: exactly, or extended to more steps or more data.
    pub resume: bool,
    /// Stop after this many steps in this process (the schedule still spans all steps);
    /// None: run to the end.
    pub stop_after: Option<usize>,
    /// Export dtype of the drafter's weights.
    pub export_dtype: DType,
    /// Log every this many steps.
    pub log_every: usize,
    /// The data directories, by name (recorded with the drafter).
    pub data: Vec<String>,
    /// Seconds spent caching target features for this run (recorded with the drafter).
    pub feature_secs: f64,
}

const CHECKPOINT: &str = "checkpoint";

/// Where a run starts: a fresh drafter, an exported one, or a checkpoint.
struct Start {
    config: DflashConfig,
    draft_vocab: Option<Vec<u32>>,
    params: Vec<(String, Var)>,
    step: usize,
    history: Vec<LogLine>,
    secs_before: f64,
    moments: Option<HashMap<String, Tensor>>,
    schedule: LrSchedule,
    /// The record of the drafter started from (`--init-from`, or the one this directory's
    /// run started from when resuming), and this directory's feature seconds so far.
    base_record: Option<TrainingRecord>,
    own_feature_secs: f64,
}

/// The state the loop carries between steps.
struct Live {
    config: DflashConfig,
    draft_vocab: Option<Vec<u32>>,
    drafter: DflashDrafter,
    frozen: FrozenTarget,
    opt: AdamW,
    schedule: LrSchedule,
    history: Vec<LogLine>,
    base_record: Option<TrainingRecord>,
    own_feature_secs: f64,
    secs_before: f64,
    objective: ObjectiveSettings,
}

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
        std::fs::create_dir_all(&self.out).with_context(|| format!("cannot create {}", self.out.display()))?;
        let start = self.start()?;
        let begin = start.step;
        let mut live = self.go_live(start)?;
        let total = live.schedule.total;
        let end = self.stop_after.map_or(total, |n| (begin + n).min(total));
        let t0 = Instant::now();
        let mut window = Window::new();
        let (mut rows_all, mut last, mut last_tau) = (0usize, None, None);
        let mut tally = Tally::default();
        for step in begin..end {
            let lr = live.schedule.lr(step);
            let (grad_norm, rows, tokens) = self.train_step(&mut live, features, step, lr, &mut tally)?;
            window.add(rows, tokens);
            rows_all += rows;
            let done = step + 1;
            observer.step(StepProgress {
                step: done,
                total,
                loss: tally.metrics().loss,
                rows_per_sec: window.rows_per_sec(),
                tau: last_tau,
            });
            let ckpt_now = done % s.checkpoint_every == 0 || done == end;
            if done % self.log_every.max(1) == 0 || ckpt_now {
                let val = if ckpt_now { Some(self.validate(&live, features)?) } else { None };
                last_tau = val.as_ref().map(|v| v.serving_tau.unwrap_or(v.tau)).or(last_tau);
                let line = LogLine {
                    step: done,
                    lr,
                    grad_norm,
                    train: std::mem::take(&mut tally).metrics(),
                    val,
                    rows_per_sec: window.rows_per_sec(),
                    tokens_per_sec: window.tokens_per_sec(),
                    peak_rss_mb: peak_rss_mb(),
                };
                observer.log(&line);
                append_log(&self.out, &line)?;
                live.history.push(line.clone());
                last = Some(line);
                window = Window::new();
            }
            if ckpt_now {
                self.save(&live, done, live.secs_before + t0.elapsed().as_secs_f64())?;
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        Ok(TrainReport {
            steps: end,
            total_steps: total,
            train_examples: self.train.len(),
            val_examples: self.val.len(),
            final_val: last.as_ref().and_then(|l| l.val.clone()),
            last,
            drafter_dir: self.out.join("drafter"),
            secs,
            total_secs: live.secs_before + secs,
            rows_per_sec: rows_all as f64 / secs.max(1e-9),
            peak_rss_mb: peak_rss_mb(),
        })
    }

    /// Shape, vocabulary, weights and schedule: from the checkpoint when resuming, from an
    /// exported drafter with `--init-from`, else fresh from the data.
    fn start(&self) -> Result<Start> {
        if self.resume {
            self.start_from_checkpoint()
        } else if let Some(dir) = &self.settings.init_from {
            self.start_from_drafter(dir)
        } else {
            self.start_fresh()
        }
    }

    fn fresh_schedule(&self) -> LrSchedule {
        LrSchedule::for_run(self.settings.adam.lr, self.settings.warmup, self.total_steps())
    }

    fn start_from_checkpoint(&self) -> Result<Start> {
        let s = &self.settings;
        let device = self.target.device().clone();
        let ckpt = checkpoint::load::<TrainSettings>(&self.out.join(CHECKPOINT), &device)?;
        let meta = &ckpt.meta;
        let schedule = checkpoint::resumed_schedule(
            meta,
            s,
            |old, total| LrSchedule::for_run(old.adam.lr, old.warmup, total),
            self.total_steps(),
            self.train.len() + self.val.len(),
        )?;
        let (base_record, own_feature_secs) = TrainingRecord::without_last_run(&self.out.join("drafter"))?;
        let config = DflashConfig::from_json(&meta.config)?;
        let names = expected_tensors(&config).into_iter().map(|(n, _)| n).collect();
        let params = ckpt.params(names)?;
        if let Some(v) = &meta.draft_vocab {
            eprintln!(
                "draft vocabulary: {} tokens (the checkpoint's) cover {}",
                v.len(),
                self.coverage(Some(v)).describe()
            );
        }
        Ok(Start {
            config,
            draft_vocab: meta.draft_vocab.clone(),
            params,
            step: meta.step,
            history: meta.history.clone(),
            secs_before: meta.train_secs,
            base_record,
            own_feature_secs,
            moments: Some(ckpt.tensors),
            schedule,
        })
    }

    fn start_from_drafter(&self, dir: &Path) -> Result<Start> {
        let s = &self.settings;
        let device = self.target.device().clone();
        let (record, warning) = TrainingRecord::check_init_from(dir)?;
        if let Some(w) = warning {
            eprintln!("warning: {w}");
        }
        let drafter = DflashDrafter::load(dir, &device)?;
        let mut config = drafter.config.clone();
        config.check_target(&self.target.config).with_context(|| format!("--init-from {}", dir.display()))?;
        if config.layout == crate::speculative::dflash::DflashLayout::Speculators {
            // Its sliding layers measure their window from the block's anchor, which this
            // trainer's export (the z-lab layout) cannot say.
            bail!(
                "--init-from {}: a drafter in speculators' layout is served as it is; train it further with speculators",
                dir.display()
            );
        }
        if config.block_size != s.block {
            // The weights do not depend on the block size: the same drafter trains (and
            // drafts) on blocks of any length.
            eprintln!("--init-from {}: block size {} becomes --block {}", dir.display(), config.block_size, s.block);
            config.block_size = s.block;
        }
        // The drafter's weights do not depend on its vocabulary either (its output rows are
        // the target's LM-head rows), so a new one carries every weight over.
        let theirs = drafter.draft_vocab().map(|v| v.to_vec());
        let vocab = match (s.keep_draft_vocab, s.draft_vocab) {
            (false, None) => None,
            (false, Some(n)) if n >= self.target.config.vocab => None,
            (false, Some(n)) => {
                let picked = self.pick_vocab(n);
                eprintln!(
                    "draft vocabulary re-picked from this run's data: {} tokens cover {} (the drafter's {} covered {})",
                    picked.len(),
                    self.coverage(Some(&picked)).describe(),
                    theirs.as_ref().map_or(self.target.config.vocab, |v| v.len()),
                    self.coverage(theirs.as_deref()).describe()
                );
                Some(picked)
            }
            (true, _) => {
                let kept = self.coverage(theirs.as_deref());
                eprintln!(
                    "draft vocabulary: the drafter's own ({} tokens) covers {}",
                    theirs.as_ref().map_or(0, |v| v.len()),
                    kept.describe()
                );
                if let Some(v) = &theirs {
                    let repicked = self.coverage(Some(&self.pick_vocab(v.len())));
                    if repicked.total() > kept.total() + 0.005 {
                        eprintln!(
                            "warning: re-picked from this run's data, {} tokens would cover {}: give --draft-vocab {} instead of keep",
                            v.len(),
                            repicked.describe(),
                            v.len()
                        );
                    }
                }
                theirs
            }
        };
        config.draft_vocab_size = vocab.as_ref().map(|v| v.len());
        // Only the trainable tensors are read (a file may hold others, such as a bool `t2d`).
        // SAFETY: the file is mapped read-only and not modified while the mapping lives.
        let file = unsafe { candle_core::safetensors::MmapedSafetensors::new(dir.join("model.safetensors"))? };
        let mut names: Vec<String> = expected_tensors(&config).into_iter().map(|(n, _)| n).collect();
        names.sort();
        let mut params = Vec::new();
        for name in names {
            let t = file.load(&name, &device).with_context(|| format!("--init-from: no `{name}`"))?;
            params.push((name, Var::from_tensor(&t.to_dtype(DType::F32)?)?));
        }
        let secs_before = record.as_ref().map_or(0.0, |r| r.train_secs);
        Ok(Start {
            config,
            draft_vocab: vocab,
            params,
            step: 0,
            history: Vec::new(),
            secs_before,
            moments: None,
            schedule: self.fresh_schedule(),
            base_record: record,
            own_feature_secs: 0.0,
        })
    }

    fn start_fresh(&self) -> Result<Start> {
        let s = &self.settings;
        let device = self.target.device().clone();
        let mut all: Vec<TrainExample> = self.train.clone();
        all.extend(self.val.iter().cloned());
        let mask = match s.mask_token {
            Some(m) => m,
            None => pick_mask_token(self.tokenizer, self.target.config.vocab, &all)?,
        };
        let mut config = drafter_config(self.target, s, mask)?;
        let vocab = s.draft_vocab.filter(|&n| n < self.target.config.vocab).map(|n| self.pick_vocab(n));
        config.draft_vocab_size = vocab.as_ref().map(|v| v.len());
        if let Some(v) = &vocab {
            eprintln!("draft vocabulary: {} tokens cover {}", v.len(), self.coverage(Some(v)).describe());
        }
        let params = init_params(&config, s.seed, &device)?;
        if s.init_from_target {
            init_from_target_layers(&config, &params, self.target)?;
        }
        if config.attention_bias {
            init_relative_position_heads(&config, &params)?;
        }
        Ok(Start {
            config,
            draft_vocab: vocab,
            params,
            step: 0,
            history: Vec::new(),
            secs_before: 0.0,
            moments: None,
            schedule: self.fresh_schedule(),
            base_record: None,
            own_feature_secs: 0.0,
        })
    }

    /// The `n` most frequent response tokens of the training examples.
    fn pick_vocab(&self, n: usize) -> Vec<u32> {
        frequent_tokens(&self.train, self.target.config.vocab, n)
    }

    /// How much of the training and validation answers `vocab` covers.
    fn coverage(&self, vocab: Option<&[u32]>) -> Coverage {
        Coverage::of(self.train.iter().chain(&self.val), vocab, self.target.config.vocab)
    }

    fn go_live(&self, start: Start) -> Result<Live> {
        let s = &self.settings;
        let device = self.target.device().clone();
        let mut drafter = drafter_from_params(&start.config, &start.params, &device)?;
        drafter.set_draft_vocab(start.draft_vocab.clone())?;
        let frozen = frozen_target(self.target, start.draft_vocab.as_deref())?;
        let mut opt = AdamW::new(start.params, s.adam)?;
        if let Some(t) = &start.moments {
            opt.load_state(t, start.step)?;
        }
        Ok(Live {
            config: start.config,
            draft_vocab: start.draft_vocab,
            drafter,
            frozen,
            opt,
            schedule: start.schedule,
            history: start.history,
            base_record: start.base_record,
            own_feature_secs: start.own_feature_secs + self.feature_secs,
            secs_before: start.secs_before,
            objective: ObjectiveSettings { block: s.block, weights: s.position_weights()?, distill: s.distill },
        })
    }

    /// One optimiser step; returns the gradient norm, the scored rows and the tokens read.
    fn train_step(
        &self,
        live: &mut Live,
        features: &mut Features,
        step: usize,
        lr: f64,
        tally: &mut Tally,
    ) -> Result<(f64, usize, usize)> {
        let s = &self.settings;
        let device = self.target.device().clone();
        let batch = batch_indices(self.train.len(), s.batch, s.seed, step);
        let mut rng = step_rng(s.seed, 1, step as u64);
        let anchors: Vec<Vec<usize>> =
            batch.iter().map(|&i| draw_anchors(&self.train[i], s.anchors, &mut rng)).collect();
        // The batch's total weight first, so each sequence's backward is already scaled.
        let weight: f64 = batch
            .iter()
            .zip(&anchors)
            .map(|(&i, a)| {
                let e = &self.train[i];
                scored_rows(&e.tokens, &e.loss_mask, a, s.block, live.objective.weights, &live.frozen)
                    .iter()
                    .map(|r| r.weight as f64)
                    .sum::<f64>()
            })
            .sum();
        let mut grads: Vec<Option<Tensor>> = vec![None; live.opt.params().len()];
        let (mut rows, mut tokens) = (0, 0);
        for (&i, a) in batch.iter().zip(&anchors) {
            let e = &self.train[i];
            let f = features.get(e, &device)?;
            let input = SequenceInput { tokens: &e.tokens, loss_mask: &e.loss_mask, features: &f, anchors: a };
            let l = sequence_loss(&live.drafter, &live.frozen, &input, live.objective)?;
            tally.add(l.weighted_hard_ce, l.weight_sum, &l.scored, &l.hits, &l.accepted);
            rows += l.scored.iter().sum::<usize>();
            tokens += e.tokens.len();
            if weight > 0.0 && l.weight_sum > 0.0 {
                super::optim::accumulate_grads(&mut grads, &(l.weighted_ce / weight)?.backward()?, live.opt.params())?;
            }
        }
        let grads = super::optim::finish_grads(grads, live.opt.params())?;
        Ok((live.opt.step(&grads, lr, s.clip)?, rows, tokens))
    }

    /// Metrics on the held-out examples ([`evaluate`]).
    fn validate(&self, live: &Live, features: &mut Features) -> Result<Metrics> {
        let s = &self.settings;
        let anchors = AnchorDraw { per_sequence: s.anchors, seed: s.seed };
        evaluate(&live.drafter, &live.frozen, &self.val, features, live.objective, anchors, s.serving_draft_len)
    }

    /// Writes the checkpoint, the exported drafter and its training record.
    fn save(&self, live: &Live, done: usize, train_secs: f64) -> Result<()> {
        let meta = CheckpointMeta {
            step: done,
            total_steps: live.schedule.total,
            settings: self.settings.clone(),
            config: live.config.to_json(self.target.config.vocab, self.target.config.context_len)?,
            draft_vocab: live.draft_vocab.clone(),
            data_examples: self.train.len() + self.val.len(),
            train_secs,
            history: live.history.clone(),
            schedule: Some(live.schedule),
            data: self.data.clone(),
        };
        checkpoint::save(&self.out.join(CHECKPOINT), &live.opt, &meta)?;
        let dir = self.out.join("drafter");
        export(
            &dir,
            &live.config,
            live.opt.params(),
            live.draft_vocab.as_deref(),
            self.target.config.vocab,
            self.target.config.context_len,
            self.export_dtype,
        )?;
        self.record(live, done, train_secs).write(&dir)
    }

    /// The drafter's training record: the one it was started from, plus this run.
    fn record(&self, live: &Live, done: usize, train_secs: f64) -> TrainingRecord {
        let run = RecordedRun {
            data: self.data.clone(),
            train_examples: self.train.len(),
            steps: done,
            feature_secs: live.own_feature_secs,
        };
        TrainingRecord::extended(live.base_record.as_ref(), run, train_secs)
    }
}

/// Rows and tokens since the last log line, for the rates shown.
struct Window {
    since: Instant,
    rows: usize,
    tokens: usize,
}

impl Window {
    fn new() -> Self {
        Self { since: Instant::now(), rows: 0, tokens: 0 }
    }

    fn add(&mut self, rows: usize, tokens: usize) {
        self.rows += rows;
        self.tokens += tokens;
    }

    fn rows_per_sec(&self) -> f64 {
        self.rows as f64 / self.since.elapsed().as_secs_f64().max(1e-9)
    }

    fn tokens_per_sec(&self) -> f64 {
        self.tokens as f64 / self.since.elapsed().as_secs_f64().max(1e-9)
    }
}

/// How [`evaluate`] draws the anchors of its objective estimate: `per_sequence` anchors of
/// example i from the stream `(seed, 3, i)`, the same every time.
#[derive(Debug, Clone, Copy)]
pub struct AnchorDraw {
    pub per_sequence: usize,
    pub seed: u64,
}

/// A drafter's metrics on `examples`: the objective at fixed anchors (loss, accuracy per
/// position, the anchor estimate of τ), and τ from greedy verify steps simulated at `k`
/// drafted tokens per step ([`serving_walk`]), the estimate to trust.
pub fn evaluate(
    drafter: &DflashDrafter,
    frozen: &FrozenTarget,
    examples: &[TrainExample],
    features: &mut Features,
    objective: ObjectiveSettings,
    anchors: AnchorDraw,
    k: usize,
) -> Result<Metrics> {
    let mut tally = Tally::default();
    let walk = ObjectiveSettings { block: k + 1, ..objective };
    for (i, e) in examples.iter().enumerate() {
        let mut rng = step_rng(anchors.seed, 3, i as u64);
        let drawn = draw_anchors(e, anchors.per_sequence, &mut rng);
        let f = features.get(e, drafter.device())?;
        let input = SequenceInput { tokens: &e.tokens, loss_mask: &e.loss_mask, features: &f, anchors: &drawn };
        let l = sequence_loss(drafter, frozen, &input, objective)?;
        tally.add(l.weighted_hard_ce, l.weight_sum, &l.scored, &l.hits, &l.accepted);
        let (committed, steps) = serving_walk(drafter, frozen, e, &f, walk)?;
        tally.add_serving_walk(committed, steps);
    }
    let mut m = tally.metrics();
    m.serving_draft_len = m.serving_tau.map(|_| k);
    Ok(m)
}

/// Greedy serving simulated over one held-out answer (see [`simulate_verify_steps`]): the
/// drafter's blocks from every response position, in chunks, give the leading hits at each
/// anchor. Returns (committed tokens, verify steps).
pub fn serving_walk(
    drafter: &DflashDrafter,
    frozen: &FrozenTarget,
    e: &TrainExample,
    features: &Tensor,
    walk: ObjectiveSettings,
) -> Result<(usize, usize)> {
    const CHUNK: usize = 128;
    let Some(first) = e.first_response() else { return Ok((0, 0)) };
    let anchors = e.anchor_candidates();
    let mut accepted = vec![0usize; e.tokens.len()];
    for chunk in anchors.chunks(CHUNK) {
        let input = SequenceInput { tokens: &e.tokens, loss_mask: &e.loss_mask, features, anchors: chunk };
        let l = sequence_loss(drafter, frozen, &input, ObjectiveSettings { distill: false, ..walk })?;
        for (&p, &a) in chunk.iter().zip(&l.accepted) {
            accepted[p] = a;
        }
    }
    Ok(simulate_verify_steps(first, e.tokens.len(), |p| accepted[p]))
}

/// Anchors for one sequence at one step: up to `n` distinct candidates, sorted.
fn draw_anchors(e: &TrainExample, n: usize, rng: &mut StdRng) -> Vec<usize> {
    let mut c = e.anchor_candidates();
    c.shuffle(rng);
    c.truncate(n);
    c.sort_unstable();
    c
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
        let device = params.first().context("a drafter without parameters")?.1.device();
        tensors.insert("d2t".into(), Tensor::from_vec(ids, n, device)?);
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
    checkpoint::publish(&tmp, &dir.join("model.safetensors"))?;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&json)? + "\n")?;
    Ok(())
}
