//! `specula train …`: training drafters. `train data` makes the training data, `train dflash`
//! and `train eagle3` train a drafter on it.

use crate::train::data::{self, DataSettings, GenSettings, PromptSource};
use anyhow::Result;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct TrainArgs {
    #[command(subcommand)]
    command: TrainCommand,
}

#[derive(clap::Subcommand)]
enum TrainCommand {
    /// Let the target answer training prompts (batched, resumable) and write token ids + loss
    /// masks as JSON-line shards. Evaluation sets are refused.
    Data(DataArgs),
    /// Train a DFlash drafter for a target on data from `train data`; checkpoints, resumes and
    /// exports a `--drafter dflash:DIR` directory (OUT/drafter).
    Dflash(Box<DflashArgs>),
    /// Train an EAGLE-3 drafter (training-time test) on data from `train data`; checkpoints,
    /// resumes and exports a `--drafter eagle3:DIR` directory (OUT/drafter) in the layout vLLM,
    /// SGLang and SpecForge load.
    Eagle3(Box<Eagle3Args>),
}

#[derive(clap::Args)]
pub struct Eagle3Args {
    /// Target model: key or path (the one the data was made with).
    #[arg(long)]
    target: String,
    /// Training data directories (from `specula train data`), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    data: Vec<PathBuf>,
    /// Take the held-out examples from these directories instead (the same prompts' examples
    /// in --data are then left out of training): to validate drafters trained on other answers
    /// (`train data --responses dataset`) on the target's own.
    #[arg(long, value_delimiter = ',')]
    val_data: Vec<PathBuf>,
    /// Output directory: OUT/drafter (the exported drafter), OUT/checkpoint, OUT/train-log.jsonl.
    #[arg(long)]
    out: PathBuf,
    /// Unrolled training-time-test steps (step j weighs 0.8^j).
    #[arg(long, default_value_t = 7)]
    ttt_steps: usize,
    /// The three fused target layers: 0-based ids of the layers whose outputs are read
    /// (default: 1, N/2 − 1, N − 4).
    #[arg(long, value_delimiter = ',')]
    taps: Option<Vec<usize>>,
    /// Draft vocabulary: the N most frequent response tokens (default: the target's).
    #[arg(long)]
    draft_vocab: Option<usize>,
    /// MLP width (default: the target's).
    #[arg(long)]
    ffn: Option<usize>,
    /// Peak learning rate (AdamW, β 0.9/0.999).
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Fraction of steps warming up.
    #[arg(long, default_value_t = 0.04)]
    warmup: f64,
    /// Gradient clipping (global norm).
    #[arg(long, default_value_t = 0.5)]
    clip: f64,
    /// Optimiser steps (default: --epochs over the training split).
    #[arg(long)]
    steps: Option<usize>,
    #[arg(long, default_value_t = 1.0)]
    epochs: f64,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Examples are cut to this many tokens.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
    /// Examples held out for validation.
    #[arg(long, default_value_t = 32)]
    val_examples: usize,
    /// Checkpoint, validate and export every N steps.
    #[arg(long, default_value_t = 200)]
    checkpoint_every: usize,
    /// Log training metrics every N steps.
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// Target features: `online` (recomputed each use) or `offline` (cached once in f16).
    #[arg(long, default_value = "offline")]
    features: String,
    /// Where offline features are cached (default: OUT/features).
    #[arg(long)]
    features_dir: Option<PathBuf>,
    /// Continue from OUT/checkpoint (same settings and data).
    #[arg(long)]
    resume: bool,
    /// Start from an exported drafter directory's weights (its shape, taps and draft
    /// vocabulary) with a new schedule instead of a fresh initialisation.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Stop after this many steps in this run (the schedule still spans every step).
    #[arg(long)]
    stop_after: Option<usize>,
    /// Exported weight type: f32, f16 or bf16.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// Target weight format in memory (default: measured best).
    #[arg(long)]
    weights: Option<String>,
}

#[derive(clap::Args)]
pub struct DflashArgs {
    /// Target model: key or path (the one the data was made with).
    #[arg(long)]
    target: String,
    /// Training data directories (from `specula train data`), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    data: Vec<PathBuf>,
    /// Take the held-out examples from these directories instead (the same prompts' examples
    /// in --data are then left out of training): to validate drafters trained on other answers
    /// (`train data --responses dataset`) on the target's own.
    #[arg(long, value_delimiter = ',')]
    val_data: Vec<PathBuf>,
    /// Output directory: OUT/drafter (the exported drafter), OUT/checkpoint, OUT/train-log.jsonl.
    #[arg(long)]
    out: PathBuf,
    /// Drafter decoder layers.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Query heads (default: the target's).
    #[arg(long)]
    heads: Option<usize>,
    /// Key/value heads (default: the target's).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Head width (default: the target's).
    #[arg(long)]
    head_dim: Option<usize>,
    /// MLP width (default: the target's).
    #[arg(long)]
    ffn: Option<usize>,
    /// Block size B (the anchor + B − 1 masks).
    #[arg(long, default_value_t = 16)]
    block: usize,
    /// Tapped target layers, comma-separated 0-based ids (default: --n-taps spread from the
    /// second layer to the third-from-last).
    #[arg(long, value_delimiter = ',')]
    taps: Option<Vec<usize>>,
    #[arg(long, default_value_t = 5)]
    n_taps: usize,
    /// Anchors per sequence and step.
    #[arg(long, default_value_t = 64)]
    anchors: usize,
    /// Loss decay γ (default: 7 for B = 16, 5 for 10, 4 for 8).
    #[arg(long)]
    gamma: Option<f64>,
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 6e-4)]
    lr: f64,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Fraction of steps warming up.
    #[arg(long, default_value_t = 0.04)]
    warmup: f64,
    /// Gradient clipping (global norm).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Optimiser steps (default: --epochs over the training split).
    #[arg(long)]
    steps: Option<usize>,
    #[arg(long, default_value_t = 1.0)]
    epochs: f64,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Examples are cut to this many tokens.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
    /// Reduced drafter vocabulary: the N most frequent response tokens (default: the target's).
    #[arg(long)]
    draft_vocab: Option<usize>,
    /// MASK token id (default: an unused control token of the target).
    #[arg(long)]
    mask_token: Option<u32>,
    /// Examples held out for validation.
    #[arg(long, default_value_t = 32)]
    val_examples: usize,
    /// Checkpoint, validate and export every N steps.
    #[arg(long, default_value_t = 200)]
    checkpoint_every: usize,
    /// Log training metrics every N steps.
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// Target features: `online` (recomputed each use) or `offline` (cached once in f16).
    #[arg(long, default_value = "offline")]
    features: String,
    /// Where offline features are cached (default: OUT/features).
    #[arg(long)]
    features_dir: Option<PathBuf>,
    /// Initialise drafter layer i from target layer i (same head and MLP shapes) instead of
    /// random weights.
    #[arg(long)]
    init_from_target: bool,
    /// Give the drafter attention biases, the q/k ones starting as relative-position heads
    /// (head h looks 1 + h/2 positions back): it learns where the anchor's token is in far
    /// fewer steps.
    #[arg(long)]
    attention_bias: bool,
    /// Distil: score each block row by soft cross-entropy against the target's distribution
    /// over the drafter's vocabulary instead of its greedy token (the features then include
    /// the target's last layer).
    #[arg(long)]
    distill: bool,
    /// Continue from OUT/checkpoint (same settings and data).
    #[arg(long)]
    resume: bool,
    /// Start from an exported drafter directory's weights (its shape, MASK and vocabulary)
    /// instead of a fresh initialisation; --block may differ from its block size.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Stop after this many steps in this run (the schedule still spans every step).
    #[arg(long)]
    stop_after: Option<usize>,
    /// Exported weight type: f32, f16 or bf16.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// Target weight format in memory (default: measured best).
    #[arg(long)]
    weights: Option<String>,
}

#[derive(clap::Args)]
pub struct DataArgs {
    /// Target model: key (see `specula fetch --list`) or path to a GGUF file.
    #[arg(long)]
    target: String,
    /// Prompt sets, comma-separated (sharegpt, fastchat-dummy, codeio, codeio-completion, reasoning-gym-math);
    /// evaluation sets are refused.
    #[arg(long, value_delimiter = ',')]
    prompts: Vec<String>,
    /// A local file in a set's format, KEY=PATH (e.g. fastchat-dummy=chats.json); repeatable.
    #[arg(long)]
    prompts_file: Vec<String>,
    /// Prompts skipped at the start of each set before --limit counts (--skip 4000 --limit 2000:
    /// the 2,000 after the first 4,000, for more data from prompts not used yet).
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Prompts per set at most (default: all).
    #[arg(long)]
    limit: Option<usize>,
    /// Response tokens per prompt at most (generation also stops at end of sequence).
    #[arg(long, default_value_t = 512)]
    max_new_tokens: usize,
    /// Output directory (shards + meta.json); rerunning resumes it.
    #[arg(long)]
    out: PathBuf,
    /// Requests decoding together.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Seed for sampling (each example derives its own from this and its set + id).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Chat template variables for the chat prompt sets, as a JSON object, e.g.
    /// '{"enable_thinking": false}' (Qwen3 answers without thinking, as the published DFlash
    /// drafters were trained); recorded in meta.json and required to match on resume.
    #[arg(long)]
    chat_template_kwargs: Option<String>,
    /// Examples per shard file.
    #[arg(long, default_value_t = 1000)]
    shard_size: usize,
    /// KV cache capacity in tokens, shared by the batch.
    #[arg(long, default_value_t = 16384)]
    kv_tokens: usize,
    /// Skip prompts longer than this many tokens (chat template included).
    #[arg(long)]
    max_prompt_tokens: Option<usize>,
    /// Whose answers to store: `target` (the target generates them: what a drafter must
    /// predict) or `dataset` (the prompt set's own answers, cut at --max-new-tokens: no
    /// generation; prompts without an answer are skipped).
    #[arg(long, default_value = "target")]
    responses: String,
    /// Weight format in memory: native, q8_0, q4_0, f16, f32 (default: measured best).
    #[arg(long)]
    weights: Option<String>,
}

pub fn run(args: TrainArgs) -> Result<()> {
    match args.command {
        TrainCommand::Data(a) => run_data(a),
        TrainCommand::Dflash(a) => run_dflash(*a),
        TrainCommand::Eagle3(a) => run_eagle3(*a),
    }
}

fn run_data(args: DataArgs) -> Result<()> {
    let mut sources: Vec<PromptSource> =
        args.prompts.iter().filter(|s| !s.is_empty()).map(|s| PromptSource::Set(s.clone())).collect();
    for spec in &args.prompts_file {
        sources.push(PromptSource::parse_file(spec)?);
    }
    let settings = DataSettings {
        sources,
        skip: args.skip,
        limit: args.limit,
        gen: GenSettings {
            max_new_tokens: args.max_new_tokens,
            temperature: args.temperature,
            seed: args.seed,
            chat_template_kwargs: match &args.chat_template_kwargs {
                Some(text) => crate::tokenize::parse_template_kwargs(text)?,
                None => Default::default(),
            },
            responses: data::ResponseSource::parse(&args.responses)?,
        },
        out: args.out.clone(),
        batch: args.batch,
        shard_size: args.shard_size,
        kv_tokens: args.kv_tokens,
        max_prompt_tokens: args.max_prompt_tokens,
    };
    settings.validate()?;
    // Refuse evaluation and unknown sets before loading a model.
    for s in &settings.sources {
        data::check_training_set(s.key())?;
    }
    let path = crate::fetch::resolve_model(&args.target, true)?;
    let weights = args.weights.as_deref().map(crate::model::WeightFormat::parse).transpose()?;
    let target = crate::engine::LoadedModel::load(&path, weights, &candle_core::Device::Cpu)?;
    eprintln!("target {} ({} tokens in the vocabulary)", path.display(), target.tokenizer.vocab_size());
    let mut last_print = Instant::now();
    let summary = data::generate_data(&target, &settings, &mut |p| {
        if p.done == p.total || last_print.elapsed().as_secs_f64() >= 2.0 {
            last_print = Instant::now();
            eprintln!("{}/{} examples, {:.1} tokens/s, {:.0}s", p.done, p.total, p.tokens_per_sec, p.secs);
        }
    })?;
    if summary.dropped_partial_line {
        eprintln!("dropped a cut-off last line left by an interrupted run");
    }
    if !summary.skipped.is_empty() {
        eprintln!(
            "skipped {} prompt(s) too long for the context, the KV cache or --max-prompt-tokens{}",
            summary.skipped.len(),
            if args.responses == "dataset" { ", or without an answer of their own" } else { "" }
        );
    }
    println!(
        "{} prompts: {} already written, {} written now ({} response tokens in {:.1}s, {:.1} tokens/s at batch {}); {} examples in {}",
        summary.prompts,
        summary.already,
        summary.written,
        summary.run.response_tokens,
        summary.run.secs,
        summary.run.tokens_per_sec,
        summary.run.batch,
        summary.meta.examples,
        args.out.display()
    );
    Ok(())
}

fn run_dflash(args: DflashArgs) -> Result<()> {
    use crate::train::dflash::{self as td, TrainRun, TrainSettings};
    let settings = TrainSettings {
        layers: args.layers,
        heads: args.heads,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        ffn: args.ffn,
        block: args.block,
        taps: args.taps.clone(),
        n_taps: args.n_taps,
        anchors: args.anchors,
        gamma: args.gamma,
        adam: td::optim::AdamWSettings { lr: args.lr, weight_decay: args.weight_decay, ..Default::default() },
        warmup: args.warmup,
        clip: args.clip,
        steps: args.steps,
        epochs: args.epochs,
        batch: args.batch,
        seed: args.seed,
        max_tokens: args.max_tokens,
        draft_vocab: args.draft_vocab,
        mask_token: args.mask_token,
        val_examples: args.val_examples,
        checkpoint_every: args.checkpoint_every,
        init_from: args.init_from.clone(),
        init_from_target: args.init_from_target,
        attention_bias: args.attention_bias,
        distill: args.distill,
    };
    settings.validate()?;
    let export_dtype = export_dtype(&args.dtype)?;
    let target = load_target(&args.target, args.weights.as_deref())?;
    let (train, val) = split_examples(&target, &args.data, &args.val_data, settings.max_tokens, settings.val_examples)?;
    eprintln!("{} training examples, {} held out", train.len(), val.len());
    let run = TrainRun {
        target: &target.model,
        tokenizer: &target.tokenizer,
        train,
        val,
        settings,
        out: args.out.clone(),
        resume: args.resume,
        stop_after: args.stop_after,
        export_dtype,
        log_every: args.log_every,
    };
    // The tapped layers, before the drafter exists: from the settings or the drafter started from.
    let taps = match (&run.settings.taps, &run.settings.init_from) {
        (Some(t), _) => t.clone(),
        // A drafter trained further keeps its own taps.
        (None, Some(dir)) => {
            crate::speculative::dflash::DflashConfig::from_file(&dir.join("config.json"))?.target_layer_ids
        }
        (None, None) => {
            crate::speculative::dflash::default_target_layer_ids(target.model.config.n_layers, run.settings.n_taps)
        }
    };
    let layer_ids = run.settings.feature_layers(&taps, target.model.config.n_layers);
    let all: Vec<&td::TrainExample> = run.train.iter().chain(&run.val).collect();
    let mut features = open_features(
        &args.features,
        args.features_dir.as_deref(),
        &args.out,
        &target,
        layer_ids,
        run.settings.max_tokens,
        &all,
    )?;
    run.settings.validate()?;
    let mut observer = ProgressObserver::new();
    let report = run.run(&mut features, &mut observer)?;
    observer.bar.finish_and_clear();
    print_report(&report, "scored block rows");
    Ok(())
}

/// The one-line summary of a finished (or stopped) training run.
fn print_report(report: &crate::train::dflash::TrainReport, rows: &str) {
    let val = report.final_val.as_ref();
    println!(
        "{} of {} steps ({} train / {} validation examples) in {:.0}s, {:.0} {rows}/s, peak memory {:.0} MB; validation loss {}, τ ≈ {}; drafter in {}",
        report.steps,
        report.total_steps,
        report.train_examples,
        report.val_examples,
        report.secs,
        report.rows_per_sec,
        report.peak_rss_mb.unwrap_or(f64::NAN),
        val.map_or("-".into(), |v| format!("{:.4}", v.loss)),
        val.map_or("-".into(), |v| format!("{:.2}", v.tau)),
        report.drafter_dir.display()
    );
}

/// The target model a trainer runs against.
fn load_target(key: &str, weights: Option<&str>) -> Result<crate::engine::LoadedModel> {
    let path = crate::fetch::resolve_model(key, true)?;
    let weights = weights.map(crate::model::WeightFormat::parse).transpose()?;
    crate::engine::LoadedModel::load(&path, weights, &candle_core::Device::Cpu)
}

/// The examples of every data directory, after checking each was made with `target` and holds
/// no evaluation prompt.
fn load_examples(
    target: &crate::engine::LoadedModel,
    dirs: &[PathBuf],
    max_tokens: usize,
) -> Result<Vec<crate::train::dflash::TrainExample>> {
    use anyhow::{bail, Context};
    let id = data::TargetId::of(target);
    let mut examples = Vec::new();
    for dir in dirs {
        let meta: data::Meta = serde_json::from_str(
            &std::fs::read_to_string(dir.join("meta.json"))
                .with_context(|| format!("{} is not a training data directory (no meta.json)", dir.display()))?,
        )
        .with_context(|| format!("{}/meta.json", dir.display()))?;
        if !meta.target.same_model(&id) {
            bail!("{} was made with {} , not {}", dir.display(), meta.target.file_name, id.file_name);
        }
        // Refuses a directory holding any evaluation prompt.
        data::check_no_eval_prompts(dir)?;
        examples.extend(crate::train::dflash::load_examples(dir, max_tokens)?);
    }
    Ok(examples)
}

/// Training and validation examples: a split of `data` by [`crate::train::dflash::split_validation`],
/// or, with `val_data`, that split of `val_data`'s examples held out and every example of `data`
/// for the same prompts left out of training.
fn split_examples(
    target: &crate::engine::LoadedModel,
    data: &[PathBuf],
    val_data: &[PathBuf],
    max_tokens: usize,
    val_examples: usize,
) -> Result<(Vec<crate::train::dflash::TrainExample>, Vec<crate::train::dflash::TrainExample>)> {
    use crate::train::dflash::{split_validation, split_validation_from};
    let examples = load_examples(target, data, max_tokens)?;
    if val_data.is_empty() {
        return Ok(split_validation(examples, val_examples));
    }
    split_validation_from(examples, load_examples(target, val_data, max_tokens)?, val_examples)
}

/// Target features of `layer_ids` for the examples: recomputed on use (`online`), or cached
/// once in f16 (`offline`, in `dir` or OUT/features), the disk size printed first.
fn open_features<'a>(
    mode: &str,
    dir: Option<&std::path::Path>,
    out: &std::path::Path,
    target: &'a crate::engine::LoadedModel,
    layer_ids: Vec<usize>,
    max_tokens: usize,
    examples: &[&crate::train::dflash::TrainExample],
) -> Result<crate::train::dflash::Features<'a>> {
    use crate::train::dflash::{self as td, Features};
    Ok(match mode {
        "online" => Features::Online { target: &target.model, layer_ids },
        "offline" => {
            let dir = dir.map(|d| d.to_path_buf()).unwrap_or_else(|| out.join("features"));
            let key = crate::train::features::FeatureKey {
                target: data::TargetId::of(target).file_name.clone(),
                layer_ids: layer_ids.clone(),
                hidden: target.model.config.hidden,
                max_tokens,
            };
            let mut cache = crate::train::features::FeatureCache::open(&dir, key.clone())?;
            let t0 = Instant::now();
            let mut last = Instant::now();
            td::fill_feature_cache(&mut cache, &key, &target.model, examples, |done, total| {
                if done == total || last.elapsed().as_secs_f64() >= 5.0 {
                    last = Instant::now();
                    eprintln!("features {done}/{total} examples, {:.0}s", t0.elapsed().as_secs_f64());
                }
            })?;
            Features::Offline(cache)
        }
        other => anyhow::bail!("--features {other}: expected online or offline"),
    })
}

fn export_dtype(name: &str) -> Result<candle_core::DType> {
    Ok(match name {
        "f32" => candle_core::DType::F32,
        "f16" => candle_core::DType::F16,
        "bf16" => candle_core::DType::BF16,
        other => anyhow::bail!("--dtype {other}: expected f32, f16 or bf16"),
    })
}

fn run_eagle3(args: Eagle3Args) -> Result<()> {
    use crate::train::dflash::{self as td, optim::AdamWSettings};
    use crate::train::eagle3::{Eagle3Run, Eagle3TrainSettings};
    let mut settings = Eagle3TrainSettings {
        ttt_steps: args.ttt_steps,
        taps: args.taps.clone(),
        draft_vocab: args.draft_vocab,
        ffn: args.ffn,
        adam: AdamWSettings { lr: args.lr, weight_decay: args.weight_decay, ..Default::default() },
        warmup: args.warmup,
        clip: args.clip,
        steps: args.steps,
        epochs: args.epochs,
        batch: args.batch,
        seed: args.seed,
        max_tokens: args.max_tokens,
        val_examples: args.val_examples,
        checkpoint_every: args.checkpoint_every,
        init_from: args.init_from.clone(),
    };
    settings.validate()?;
    let dtype = export_dtype(&args.dtype)?;
    let target = load_target(&args.target, args.weights.as_deref())?;
    if let Some(dir) = &args.init_from {
        // A drafter trained further keeps its own taps (the feature cache must hold them); a
        // shape it does not have is refused here, before features are computed.
        let c = crate::speculative::eagle3::Eagle3Config::from_file(&dir.join("config.json"))?;
        if settings.taps.is_none() {
            settings.taps = c.aux_layer_ids.clone();
        }
        settings.check_init_from(dir, &c, target.model.config.n_layers)?;
    }
    let (train, val) = split_examples(&target, &args.data, &args.val_data, settings.max_tokens, settings.val_examples)?;
    eprintln!("{} training examples, {} held out", train.len(), val.len());
    let layer_ids = settings.feature_layers(&target.model);
    let run = Eagle3Run {
        target: &target.model,
        train,
        val,
        settings,
        out: args.out.clone(),
        resume: args.resume,
        stop_after: args.stop_after,
        export_dtype: dtype,
        log_every: args.log_every,
    };
    let all: Vec<&td::TrainExample> = run.train.iter().chain(&run.val).collect();
    let mut features = open_features(
        &args.features,
        args.features_dir.as_deref(),
        &args.out,
        &target,
        layer_ids,
        run.settings.max_tokens,
        &all,
    )?;
    let mut observer = ProgressObserver::new();
    let report = run.run(&mut features, &mut observer)?;
    observer.bar.finish_and_clear();
    print_report(&report, "scored rows");
    Ok(())
}

struct ProgressObserver {
    bar: indicatif::ProgressBar,
}

impl ProgressObserver {
    fn new() -> Self {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps {elapsed}<{eta} {msg}")
                .expect("valid template"),
        );
        Self { bar }
    }
}

impl crate::train::dflash::TrainObserver for ProgressObserver {
    fn step(&mut self, step: usize, total: usize, loss: f64, tau: f64) {
        self.bar.set_length(total as u64);
        self.bar.set_position(step as u64);
        self.bar.set_message(format!("loss {loss:.3} τ≈{tau:.2}"));
    }

    fn log(&mut self, line: &crate::train::dflash::LogLine) {
        let acc: Vec<String> =
            line.train.accuracy.iter().take(4).map(|a| a.map_or("-".into(), |a| format!("{:.2}", a))).collect();
        let val = line.val.as_ref().map_or(String::new(), |v| format!(" | val loss {:.3} τ≈{:.2}", v.loss, v.tau));
        let text = format!(
            "step {} lr {:.2e} loss {:.3} acc@1..4 [{}] τ≈{:.2} |g| {:.2} {:.0} rows/s{}",
            line.step,
            line.lr,
            line.train.loss,
            acc.join(" "),
            line.train.tau,
            line.grad_norm,
            line.rows_per_sec,
            val
        );
        // Without a terminal the bar draws nothing, and neither would its println.
        if self.bar.is_hidden() {
            eprintln!("{text}");
        } else {
            self.bar.println(text);
        }
    }
}
