//! `specula train eagle3`: trains an EAGLE-3 drafter on the same data directories and feature
//! cache as the DFlash trainer, with training-time test ([`objective`]), AdamW with warm-up and
//! cosine decay, clipping, validation, checkpoints with exact resume, and export in the layout
//! vLLM, SGLang and SpecForge load.

pub mod objective;

use super::checkpoint::{self, CheckpointMeta};
use super::examples::{batch_indices, standard_normal, step_rng, TrainExample};
use super::features::Features;
use super::optim::{accumulate_grads, finish_grads, AdamW, AdamWSettings, LrSchedule};
use super::progress::{append_log, peak_rss_mb, LogLine, Metrics, StepProgress, Tally, TrainObserver, TrainReport};
use super::validation::{simulate_verify_steps, RecordedRun, TrainingRecord};
use super::vocab::{frequent_tokens, shared_rows, Coverage};
use crate::model::Transformer;
use crate::speculative::dflash::{model::select_rows, TargetHead};
use crate::speculative::eagle3::{model, Eagle3Config, Eagle3Drafter};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use objective::{scored, sequence_loss, FrozenTarget, SequenceInput};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Everything that shapes an EAGLE-3 run (saved in checkpoints; `--resume` needs the same).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Eagle3TrainSettings {
    /// Unrolled training-time-test steps.
    pub ttt_steps: usize,
    /// The three fused target layers (default: SpecForge's `[1, N/2 − 1, N − 4]`).
    pub taps: Option<Vec<usize>>,
    /// Draft vocabulary: the N most frequent response tokens of the run's data, picked at the
    /// start of every run (default: the target's). With `init_from`, the rows of tokens the
    /// drafter's vocabulary shares are carried over and new ones start as the target's LM-head
    /// rows.
    pub draft_vocab: Option<usize>,
    /// With `init_from`: keep the drafter's own vocabulary instead.
    #[serde(default)]
    pub keep_draft_vocab: bool,
    /// MLP width (default: the target's). A narrower MLP keeps the drafter of a larger target
    /// small enough to train and ship on a CPU.
    #[serde(default)]
    pub ffn: Option<usize>,
    pub adam: AdamWSettings,
    pub warmup: f64,
    pub clip: f64,
    pub steps: Option<usize>,
    pub epochs: f64,
    pub batch: usize,
    pub seed: u64,
    pub max_tokens: usize,
    pub val_examples: usize,
    pub checkpoint_every: usize,
    /// Start from an exported drafter's weights, shape, taps and draft vocabulary instead of a
    /// fresh initialisation (a new schedule, fresh optimiser moments).
    #[serde(default)]
    pub init_from: Option<PathBuf>,
}

impl Default for Eagle3TrainSettings {
    fn default() -> Self {
        Self {
            ttt_steps: 7,
            taps: None,
            draft_vocab: None,
            keep_draft_vocab: false,
            ffn: None,
            adam: AdamWSettings { lr: 1e-4, ..Default::default() },
            warmup: 0.04,
            clip: 0.5,
            steps: None,
            epochs: 1.0,
            batch: 8,
            seed: 0,
            max_tokens: 1024,
            val_examples: 32,
            checkpoint_every: 200,
            init_from: None,
        }
    }
}

impl Eagle3TrainSettings {
    pub fn validate(&self) -> Result<()> {
        if !(1..=32).contains(&self.ttt_steps) {
            bail!("--ttt-steps must be 1..=32, got {}", self.ttt_steps);
        }
        if self.batch == 0 || self.checkpoint_every == 0 || self.max_tokens < 4 {
            bail!("--batch and --checkpoint-every must be positive and --max-tokens at least 4");
        }
        if !(self.adam.lr > 0.0 && self.clip > 0.0 && (0.0..1.0).contains(&self.warmup) && self.epochs > 0.0) {
            bail!("--lr, --clip and --epochs must be positive and --warmup in [0, 1)");
        }
        if let Some(t) = &self.taps {
            if t.len() != 3 {
                bail!("EAGLE-3 fuses three target layers, --taps gives {}", t.len());
            }
        }
        if self.draft_vocab == Some(0) {
            bail!("--draft-vocab must be positive");
        }
        if self.ffn == Some(0) {
            bail!("--ffn must be positive");
        }
        Ok(())
    }

    /// Refuses to train the drafter `config` from `dir` further with another shape or other
    /// taps than its own: a setting that would be dropped is an error.
    pub fn check_init_from(&self, dir: &Path, config: &Eagle3Config, n_layers: usize) -> Result<()> {
        if self.ffn.is_some_and(|f| f != config.ffn) {
            bail!(
                "--init-from {}: the drafter's MLP is {} wide; leave out --ffn or give that",
                dir.display(),
                config.ffn
            );
        }
        let (theirs, ours) = (
            config.tap_layers(n_layers),
            self.taps.clone().unwrap_or_else(|| crate::speculative::eagle3::default_aux_layer_ids(n_layers)),
        );
        if theirs != ours {
            bail!("--init-from {}: the drafter fuses layers {theirs:?}, the run taps {ours:?}", dir.display());
        }
        Ok(())
    }

    /// The fused target layers for `target`.
    pub fn tap_layers(&self, target: &Transformer) -> Vec<usize> {
        self.taps.clone().unwrap_or_else(|| crate::speculative::eagle3::default_aux_layer_ids(target.config.n_layers))
    }

    /// The layers the feature cache must hold: the fused three, then the target's last layer
    /// (the soft targets).
    pub fn feature_layers(&self, target: &Transformer) -> Vec<usize> {
        let mut l = self.tap_layers(target);
        l.push(target.config.n_layers - 1);
        l
    }
}

/// The drafter's shape for `target`: the target's width and heads, its MLP unless `--ffn`
/// narrows it, one layer.
pub fn drafter_config(target: &Transformer, settings: &Eagle3TrainSettings, draft_vocab: usize) -> Eagle3Config {
    let c = &target.config;
    Eagle3Config {
        hidden: c.hidden,
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        ffn: settings.ffn.unwrap_or(c.ffn),
        rms_eps: c.rms_eps,
        rope_theta: c.rope_theta as f64,
        vocab: c.vocab,
        draft_vocab,
        target_hidden: c.hidden,
        aux_layer_ids: Some(settings.tap_layers(target)),
        norm_before_residual: false,
        norm_before_fc: false,
        fc_norm: false,
        norm_output: false,
        window: None,
        own_embedding: false,
    }
}

/// Fresh trainable weights, as SpecForge starts them: matrices N(0, 0.02), norms 1.
pub fn init_params(config: &Eagle3Config, seed: u64, device: &Device) -> Result<Vec<(String, Var)>> {
    let mut rng = step_rng(seed, 4, 0);
    let mut params = Vec::new();
    let mut names = model::expected_tensors(config);
    names.sort();
    for (name, shape) in names {
        let t = if shape.len() == 1 {
            Tensor::ones(shape, DType::F32, device)?
        } else {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n).map(|_| 0.02 * standard_normal(&mut rng)).collect();
            Tensor::from_vec(v, shape, device)?
        };
        params.push((name, Var::from_tensor(&t)?));
    }
    Ok(params)
}

/// Trainable weights by tensor name.
pub type NamedVars = Vec<(String, Var)>;

/// An exported drafter's shape, draft vocabulary and weights as trainable f32 variables (for
/// `--init-from`). The drafter must embed with its target's embedding, as trained ones do.
pub fn load_params(dir: &Path, device: &Device) -> Result<(Eagle3Config, Vec<u32>, NamedVars)> {
    let c = model::read_checkpoint(dir, device).with_context(|| format!("--init-from {}", dir.display()))?;
    if c.embed.is_some() {
        bail!("--init-from {}: the drafter has its own embed_tokens; training uses the target's", dir.display());
    }
    if c.config.uses_speculators_options() {
        bail!(
            "--init-from {}: the drafter uses speculators options (norm_before_fc, fc_norm, norm_output, a sliding window or a trained embedding) the trainer does not train or export",
            dir.display()
        );
    }
    let mut params =
        c.tensors.into_iter().map(|(name, t)| Ok((name, Var::from_tensor(&t)?))).collect::<Result<NamedVars>>()?;
    // The order every run keeps its variables in (checkpoints and optimiser state follow it).
    params.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((c.config, c.draft_to_target, params))
}

/// A drafter whose weights are the trainable variables.
pub fn drafter_from_params(
    config: &Eagle3Config,
    params: &[(String, Var)],
    draft_vocab: &[u32],
    device: &Device,
) -> Result<Eagle3Drafter> {
    let map: HashMap<&str, &Var> = params.iter().map(|(n, v)| (n.as_str(), v)).collect();
    Eagle3Drafter::from_tensors(
        config.clone(),
        draft_vocab.to_vec(),
        |name, _| Ok(map.get(name).with_context(|| format!("no parameter `{name}`"))?.as_tensor().clone()),
        device,
    )
}

/// The frozen parts of the target the objective needs.
pub fn frozen_target(target: &Transformer, draft_vocab: &[u32]) -> Result<FrozenTarget> {
    let device = target.device();
    let rows = select_rows(&*target.lm_head_weights()?, draft_vocab, device)?;
    let mut map = vec![u32::MAX; target.config.vocab];
    for (d, &t) in draft_vocab.iter().enumerate() {
        map[t as usize] = d as u32;
    }
    Ok(FrozenTarget {
        head: TargetHead::of(target),
        lm_head: rows.dequantize(device)?.to_dtype(DType::F32)?,
        target_to_draft: map,
    })
}

/// Writes a drafter in the published layout: `config.json` and `model.safetensors` (weights in
/// `dtype`, `d2t` offsets as i64 and the `t2d` membership mask as bool, no embedding: it uses
/// the target's).
pub fn export(
    dir: &Path,
    config: &Eagle3Config,
    params: &[(String, Var)],
    draft_vocab: &[u32],
    dtype: DType,
) -> Result<()> {
    use safetensors::tensor::{Dtype, TensorView};
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut blobs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, p) in params {
        let t = p.as_tensor().to_dtype(dtype)?;
        let (st_dtype, bytes) = match dtype {
            DType::F16 => {
                (Dtype::F16, t.flatten_all()?.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            DType::BF16 => {
                (Dtype::BF16, t.flatten_all()?.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            _ => (Dtype::F32, t.flatten_all()?.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
        };
        blobs.push((name.clone(), st_dtype, t.dims().to_vec(), bytes));
    }
    let d2t: Vec<u8> = model::d2t_offsets(draft_vocab).iter().flat_map(|x| x.to_le_bytes()).collect();
    blobs.push(("d2t".into(), Dtype::I64, vec![draft_vocab.len()], d2t));
    let mut t2d = vec![0u8; config.vocab];
    for &t in draft_vocab {
        t2d[t as usize] = 1;
    }
    blobs.push(("t2d".into(), Dtype::BOOL, vec![config.vocab], t2d));
    let views: Vec<(String, TensorView)> = blobs
        .iter()
        .map(|(n, d, s, b)| Ok((n.clone(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    let tmp = dir.join("model.safetensors.tmp");
    safetensors::serialize_to_file(views, None, &tmp)?;
    // The writer creates owner-only files; an exported drafter is meant to be shared.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))?;
    }
    std::fs::rename(&tmp, dir.join("model.safetensors"))?;
    let mut json = config.to_json();
    json["torch_dtype"] = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
    .into();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&json)? + "\n")?;
    Ok(())
}

/// A training run.
pub struct Eagle3Run<'a> {
    pub target: &'a Transformer,
    pub train: Vec<TrainExample>,
    pub val: Vec<TrainExample>,
    pub settings: Eagle3TrainSettings,
    pub out: PathBuf,
    /// Continue from `OUT/checkpoint`: exactly, or extended to more steps or more data.
    pub resume: bool,
    /// Stop after this many steps in this process (the schedule still spans all steps).
    pub stop_after: Option<usize>,
    pub export_dtype: DType,
    pub log_every: usize,
    /// The data directories, by name (recorded with the drafter).
    pub data: Vec<String>,
    /// Seconds spent caching target features for this run.
    pub feature_secs: f64,
}

const CHECKPOINT: &str = "checkpoint";

/// Where a run starts: a fresh drafter, an exported one, or a checkpoint.
struct Start {
    config: Eagle3Config,
    draft_vocab: Vec<u32>,
    params: NamedVars,
    step: usize,
    history: Vec<LogLine>,
    secs_before: f64,
    moments: Option<HashMap<String, Tensor>>,
    schedule: LrSchedule,
    base_record: Option<TrainingRecord>,
    own_feature_secs: f64,
}

impl Eagle3Run<'_> {
    pub fn total_steps(&self) -> usize {
        let s = &self.settings;
        s.steps.unwrap_or_else(|| ((s.epochs * self.train.len() as f64) / s.batch as f64).ceil() as usize).max(1)
    }

    pub fn run(&self, features: &mut Features, observer: &mut dyn TrainObserver) -> Result<TrainReport> {
        let s = &self.settings;
        s.validate()?;
        if self.train.is_empty() {
            bail!("no training examples");
        }
        let device = self.target.device().clone();
        std::fs::create_dir_all(&self.out).with_context(|| format!("cannot create {}", self.out.display()))?;
        let start = self.start()?;
        start.config.check_target(&self.target.config)?;
        let (config, draft_vocab, schedule, begin) = (start.config, start.draft_vocab, start.schedule, start.step);
        let (mut history, secs_before) = (start.history, start.secs_before);
        let frozen = frozen_target(self.target, &draft_vocab)?;
        let mut opt = AdamW::new(start.params, s.adam)?;
        if let Some(t) = &start.moments {
            opt.load_state(t, begin)?;
        }
        let own_feature_secs = start.own_feature_secs + self.feature_secs;
        let total = schedule.total;
        let end = self.stop_after.map_or(total, |n| (begin + n).min(total));
        let t0 = Instant::now();
        let (mut rows_since, mut tokens_since, mut since) = (0usize, 0usize, Instant::now());
        let (mut rows_all, mut last, mut last_tau) = (0usize, None, None);
        let mut tally = Tally::default();
        for step in begin..end {
            let lr = schedule.lr(step);
            let (grad_norm, rows, tokens) =
                self.train_step(step, lr, &config, &draft_vocab, &frozen, &mut opt, features, &mut tally, &device)?;
            rows_since += rows;
            rows_all += rows;
            tokens_since += tokens;
            let done = step + 1;
            let secs = since.elapsed().as_secs_f64().max(1e-9);
            observer.step(StepProgress {
                step: done,
                total,
                loss: tally.metrics().loss,
                rows_per_sec: rows_since as f64 / secs,
                tau: last_tau,
            });
            let ckpt_now = done % s.checkpoint_every == 0 || done == end;
            if done % self.log_every.max(1) == 0 || ckpt_now {
                let val =
                    if ckpt_now { Some(self.validate(&config, &opt, &draft_vocab, &frozen, features)?) } else { None };
                last_tau = val.as_ref().map(|v| v.serving_tau.unwrap_or(v.tau)).or(last_tau);
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
                let train_secs = secs_before + t0.elapsed().as_secs_f64();
                let meta = CheckpointMeta {
                    step: done,
                    total_steps: total,
                    settings: s.clone(),
                    config: config.to_json(),
                    draft_vocab: Some(draft_vocab.clone()),
                    data_examples: self.train.len() + self.val.len(),
                    train_secs,
                    history: history.clone(),
                    schedule: Some(schedule),
                    data: self.data.clone(),
                };
                checkpoint::save(&self.out.join(CHECKPOINT), &opt, &meta)?;
                let dir = self.out.join("drafter");
                export(&dir, &config, opt.params(), &draft_vocab, self.export_dtype)?;
                let run = RecordedRun {
                    data: self.data.clone(),
                    train_examples: self.train.len(),
                    steps: done,
                    feature_secs: own_feature_secs,
                };
                TrainingRecord::extended(start.base_record.as_ref(), run, train_secs).write(&dir)?;
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
            total_secs: secs_before + secs,
            rows_per_sec: rows_all as f64 / secs.max(1e-9),
            peak_rss_mb: peak_rss_mb(),
        })
    }

    fn fresh_schedule(&self) -> LrSchedule {
        LrSchedule::for_run(self.settings.adam.lr, self.settings.warmup, self.total_steps())
    }

    fn start(&self) -> Result<Start> {
        let s = &self.settings;
        let device = self.target.device().clone();
        let vocab = self.target.config.vocab;
        if self.resume {
            let ckpt = checkpoint::load::<Eagle3TrainSettings>(&self.out.join(CHECKPOINT), &device)?;
            let meta = &ckpt.meta;
            let schedule = checkpoint::resumed_schedule(
                meta,
                s,
                |old, total| LrSchedule::for_run(old.adam.lr, old.warmup, total),
                self.total_steps(),
                self.train.len() + self.val.len(),
            )?;
            let config = Eagle3Config::from_json(&meta.config)?;
            let params = ckpt.params(model::expected_tensors(&config).into_iter().map(|(n, _)| n).collect())?;
            let draft_vocab = meta.draft_vocab.clone().context("the checkpoint has no draft vocabulary")?;
            let (base_record, own_feature_secs) = TrainingRecord::without_last_run(&self.out.join("drafter"))?;
            return Ok(Start {
                config,
                draft_vocab,
                params,
                step: meta.step,
                history: meta.history.clone(),
                secs_before: meta.train_secs,
                moments: Some(ckpt.tensors.clone()),
                schedule,
                base_record,
                own_feature_secs,
            });
        }
        if let Some(dir) = &s.init_from {
            let (record, warning) = TrainingRecord::check_init_from(dir)?;
            if let Some(w) = warning {
                eprintln!("warning: {w}");
            }
            let (mut config, theirs, mut params) = load_params(dir, &device)?;
            s.check_init_from(dir, &config, self.target.config.n_layers)?;
            let draft_vocab = match (s.keep_draft_vocab, s.draft_vocab) {
                (true, _) => {
                    eprintln!(
                        "draft vocabulary: the drafter's own ({} tokens) covers {}",
                        theirs.len(),
                        self.coverage(&theirs).describe()
                    );
                    theirs
                }
                (false, n) => {
                    let picked = frequent_tokens(&self.train, vocab, n.unwrap_or(vocab).min(vocab));
                    eprintln!(
                        "draft vocabulary re-picked from this run's data: {} tokens cover {} (the drafter's {} covered {})",
                        picked.len(),
                        self.coverage(&picked).describe(),
                        theirs.len(),
                        self.coverage(&theirs).describe()
                    );
                    carry_lm_head_rows(&mut params, &theirs, &picked, self.target)?;
                    config.draft_vocab = picked.len();
                    picked
                }
            };
            let secs_before = record.as_ref().map_or(0.0, |r| r.train_secs);
            return Ok(Start {
                config,
                draft_vocab,
                params,
                step: 0,
                history: Vec::new(),
                secs_before,
                moments: None,
                schedule: self.fresh_schedule(),
                base_record: record,
                own_feature_secs: 0.0,
            });
        }
        let n = s.draft_vocab.unwrap_or(vocab).min(vocab);
        let draft_vocab = frequent_tokens(&self.train, vocab, n);
        eprintln!("draft vocabulary: {} tokens cover {}", draft_vocab.len(), self.coverage(&draft_vocab).describe());
        let config = drafter_config(self.target, s, draft_vocab.len());
        let params = init_params(&config, s.seed, &device)?;
        Ok(Start {
            config,
            draft_vocab,
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

    fn coverage(&self, vocab: &[u32]) -> Coverage {
        Coverage::of(self.train.iter().chain(&self.val), Some(vocab), self.target.config.vocab)
    }

    /// One optimiser step; returns the gradient norm, the scored rows and the tokens read.
    #[allow(clippy::too_many_arguments)]
    fn train_step(
        &self,
        step: usize,
        lr: f64,
        config: &Eagle3Config,
        draft_vocab: &[u32],
        frozen: &FrozenTarget,
        opt: &mut AdamW,
        features: &mut Features,
        tally: &mut Tally,
        device: &Device,
    ) -> Result<(f64, usize, usize)> {
        let s = &self.settings;
        let batch = batch_indices(self.train.len(), s.batch, s.seed, step);
        // Each step's loss is a mean over its scored rows in the batch.
        let mut norms = vec![0.0f64; s.ttt_steps];
        for &i in &batch {
            let e = &self.train[i];
            for (j, v) in scored(&e.tokens, &e.loss_mask, frozen, s.ttt_steps).iter().enumerate() {
                norms[j] += v.iter().filter(|&&x| x).count() as f64;
            }
        }
        let drafter = drafter_from_params(config, opt.params(), draft_vocab, device)?;
        let mut grads: Vec<Option<Tensor>> = vec![None; opt.params().len()];
        let (mut rows, mut tokens) = (0, 0);
        for &i in &batch {
            let e = &self.train[i];
            let f = features.get(e, device)?;
            let input = SequenceInput { tokens: &e.tokens, loss_mask: &e.loss_mask, features: &f };
            let l = sequence_loss(&drafter, frozen, &input, &norms)?;
            tally.add(l.ce_sum, l.ce_terms as f64, &l.scored, &l.hits, &l.accepted);
            rows += l.ce_terms;
            tokens += e.tokens.len();
            if l.ce_terms > 0 {
                accumulate_grads(&mut grads, &l.weighted_ce.backward()?, opt.params())?;
            }
        }
        let grads = finish_grads(grads, opt.params())?;
        Ok((opt.step(&grads, lr, s.clip)?, rows, tokens))
    }

    /// Metrics on the validation examples ([`evaluate`]).
    fn validate(
        &self,
        config: &Eagle3Config,
        opt: &AdamW,
        draft_vocab: &[u32],
        frozen: &FrozenTarget,
        features: &mut Features,
    ) -> Result<Metrics> {
        let drafter = drafter_from_params(config, opt.params(), draft_vocab, self.target.device())?;
        evaluate(&drafter, frozen, &self.val, features, self.settings.ttt_steps)
    }
}

/// A drafter's metrics on `examples` (no randomness: the same every time): the objective over
/// `steps` unrolled steps, and τ from greedy verify steps simulated at `steps` drafted tokens
/// per step: a draft from the last committed position p is the chain of row p − 1.
pub fn evaluate(
    drafter: &Eagle3Drafter,
    frozen: &FrozenTarget,
    examples: &[TrainExample],
    features: &mut Features,
    steps: usize,
) -> Result<Metrics> {
    let mut norms = vec![0.0f64; steps];
    for e in examples {
        for (j, v) in scored(&e.tokens, &e.loss_mask, frozen, steps).iter().enumerate() {
            norms[j] += v.iter().filter(|&&x| x).count() as f64;
        }
    }
    let mut tally = Tally::default();
    for e in examples {
        let f = features.get(e, drafter.device())?;
        let input = SequenceInput { tokens: &e.tokens, loss_mask: &e.loss_mask, features: &f };
        let l = sequence_loss(drafter, frozen, &input, &norms)?;
        tally.add(l.ce_sum, l.ce_terms as f64, &l.scored, &l.hits, &l.accepted);
        let mut by_row = vec![0usize; e.tokens.len()];
        for (&t, &a) in l.accepted_rows.iter().zip(&l.accepted) {
            by_row[t] = a;
        }
        if let Some(first) = e.first_response() {
            let (committed, verify_steps) =
                simulate_verify_steps(first, e.tokens.len(), |p| if p == 0 { 0 } else { by_row[p - 1] });
            tally.add_serving_walk(committed, verify_steps);
        }
    }
    let mut m = tally.metrics();
    m.serving_draft_len = m.serving_tau.map(|_| steps);
    Ok(m)
}

/// Rebuilds the drafter's `lm_head.weight` for a new vocabulary: rows of tokens both
/// vocabularies hold are carried over, new tokens start as the target's LM-head rows.
fn carry_lm_head_rows(params: &mut NamedVars, old: &[u32], new: &[u32], target: &Transformer) -> Result<()> {
    let Some(slot) = params.iter_mut().find(|(n, _)| n == "lm_head.weight") else {
        bail!("the drafter has no lm_head.weight");
    };
    let device = slot.1.device().clone();
    let theirs = slot.1.as_tensor();
    let fresh = select_rows(&*target.lm_head_weights()?, new, &device)?.dequantize(&device)?.to_dtype(DType::F32)?;
    let rows: Vec<Tensor> = shared_rows(old, new)
        .iter()
        .enumerate()
        .map(|(i, at)| match at {
            Some(r) => theirs.get(*r),
            None => fresh.get(i),
        })
        .collect::<candle_core::Result<_>>()?;
    slot.1 = Var::from_tensor(&Tensor::stack(&rows, 0)?)?;
    Ok(())
}
