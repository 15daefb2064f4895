//! `specula train …`: training drafters. `train data` makes the training data, `train dflash`
//! and `train eagle3` train a drafter on it.

use crate::train::data::{self, DataSettings, GenSettings, PromptSource};
use crate::train::examples::TrainExample;
use crate::train::features::{FeatureCache, FeatureKey, Features};
use crate::train::progress::{LogLine, StepProgress, TrainObserver, TrainReport};
use anyhow::{bail, Context, Result};
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
    /// Measure a trained drafter on data from `train data`: τ from greedy verify steps
    /// simulated on the answers (as serving counts it), loss and accuracy per position.
    Validate(ValidateArgs),
    /// Write data directories as one JSON-lines file of `input_ids` and `loss_mask` (what
    /// SpecForge's and speculators' trainers read as pre-tokenized data), the held-out
    /// examples left out.
    Export(ExportArgs),
}

#[derive(clap::Args)]
pub struct ValidateArgs {
    /// Target model: key or path (the one the data was made with).
    #[arg(long)]
    target: String,
    /// The drafter: dflash:DIR or eagle3:DIR.
    #[arg(long)]
    drafter: String,
    /// Data directories (from `specula train data`), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    data: Vec<PathBuf>,
    /// Measure on every example, not only the held-out split (for data no drafter of this
    /// lineage trained on).
    #[arg(long)]
    all: bool,
    /// Examples measured on, at most.
    #[arg(long, default_value_t = 64)]
    val_examples: usize,
    /// Drafted tokens per simulated verify step (DFlash; EAGLE-3 drafts its training-time-test
    /// depth, --ttt-steps).
    #[arg(long, default_value_t = 7)]
    draft_len: usize,
    /// EAGLE-3 chain length.
    #[arg(long, default_value_t = 7)]
    ttt_steps: usize,
    /// Examples are cut to this many tokens.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
    /// Target features: `offline` (cached per data directory, shared with training runs),
    /// `online`, or `auto` (offline when already cached).
    #[arg(long, default_value = "offline")]
    features: String,
    /// The folder the feature caches are in (default: `features/` in the specula cache).
    #[arg(long)]
    features_dir: Option<PathBuf>,
    /// Target weight format in memory (default: measured best).
    #[arg(long)]
    weights: Option<String>,
    /// cpu, cuda, cuda:N, metal.
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// Data directories (from `specula train data`), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    data: Vec<PathBuf>,
    /// The JSON-lines file to write.
    #[arg(long)]
    out: PathBuf,
    /// The end-of-sequence token id to append (with loss 1) to answers that ended with it, as
    /// the frameworks' own tokenization of a finished answer has it (default: none appended).
    #[arg(long)]
    eos: Option<u32>,
    /// Export the held-out examples too (they are then no longer held out for drafters
    /// trained on the file).
    #[arg(long)]
    include_held_out: bool,
}

/// What both trainers take.
#[derive(clap::Args)]
pub struct RunArgs {
    /// Target model: key or path (the one the data was made with).
    #[arg(long)]
    target: String,
    /// Training data directories (from `specula train data`), comma-separated. With --quick
    /// and none given, a small one is made first in OUT/data.
    #[arg(long, value_delimiter = ',')]
    data: Vec<PathBuf>,
    /// Take the held-out examples from these directories instead (the same prompts' examples
    /// in --data are then left out of training): to validate drafters trained on other answers
    /// (`train data --responses dataset`) on the target's own.
    #[arg(long, value_delimiter = ',')]
    val_data: Vec<PathBuf>,
    /// Output directory: OUT/drafter (the exported drafter and its training.json),
    /// OUT/checkpoint, OUT/train-log.jsonl.
    #[arg(long)]
    out: PathBuf,
    /// Optimiser steps (default: --epochs over the training split). With --resume, more
    /// steps than the checkpoint's run extend it.
    #[arg(long)]
    steps: Option<usize>,
    #[arg(long, default_value_t = 1.0)]
    epochs: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Examples are cut to this many tokens.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
    /// Held-out examples validated on, at most (the held-out split itself is fixed: one
    /// example in 20, by a hash of its set/id).
    #[arg(long, default_value_t = 64)]
    val_examples: usize,
    /// Checkpoint, validate and export every N steps.
    #[arg(long, default_value_t = 200)]
    checkpoint_every: usize,
    /// Log training metrics every N steps.
    #[arg(long, default_value_t = 10)]
    log_every: usize,
    /// Draft vocabulary: N (the N most frequent response tokens of this run's data), `full`
    /// (the target's), or `keep` (with --init-from: the drafter's own).
    #[arg(long, default_value = "16384")]
    draft_vocab: String,
    /// Target features: `offline` (computed once, cached in f16 per data directory and shared
    /// by every run on it with the same target and taps), `online` (recomputed at every use),
    /// or `auto`: offline when the run reads its examples more than once (or --resume /
    /// --stop-after may read them again) or they are all cached already (`train data
    /// --features`), online for a single pass over fresh data.
    #[arg(long, default_value = "auto")]
    features: String,
    /// The folder the feature caches are in: one per data directory, named by the directory,
    /// the target's SHA-256, the taps and --max-tokens (default: `features/` in the specula
    /// cache).
    #[arg(long)]
    features_dir: Option<PathBuf>,
    /// Continue from OUT/checkpoint with its moments and schedule: exactly, or extended by
    /// more --steps or more --data (then the learning rate decays on from where it is).
    #[arg(long)]
    resume: bool,
    /// Start from an exported drafter directory's weights (its shape and taps) with a new
    /// schedule instead of a fresh initialisation.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Stop after this many steps in this run (the schedule still spans every step).
    #[arg(long)]
    stop_after: Option<usize>,
    /// A short run for trying the pipeline end to end: 60 steps, checkpoints every 30, and
    /// with no --data, 96 ShareGPT answers made first (a few minutes for a small target).
    #[arg(long)]
    quick: bool,
    /// Exported weight type: f32, f16 or bf16.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// Target weight format in memory (default: measured best).
    #[arg(long)]
    weights: Option<String>,
    /// Where the target and the drafter run: cpu, cuda, cuda:N, metal (GPU builds only).
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(clap::Args)]
pub struct Eagle3Args {
    #[command(flatten)]
    run: RunArgs,
    /// Unrolled training-time-test steps (step j weighs 0.8^j).
    #[arg(long, default_value_t = 7)]
    ttt_steps: usize,
    /// The three fused target layers: 0-based ids of the layers whose outputs are read
    /// (default: 1, N/2 − 1, N − 4).
    #[arg(long, value_delimiter = ',')]
    taps: Option<Vec<usize>>,
    /// MLP width (default: the target's).
    #[arg(long)]
    ffn: Option<usize>,
    /// Peak learning rate (AdamW, β 0.9/0.999).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Fraction of steps warming up.
    #[arg(long, default_value_t = 0.04)]
    warmup: f64,
    /// Gradient clipping (global norm).
    #[arg(long, default_value_t = 0.5)]
    clip: f64,
    /// Sequences per step.
    #[arg(long, default_value_t = 2)]
    batch: usize,
}

#[derive(clap::Args)]
pub struct DflashArgs {
    #[command(flatten)]
    run: RunArgs,
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
    /// Block size B (the anchor + B − 1 masks): 8 is what serving drafts at 7 tokens per step.
    #[arg(long, default_value_t = 8)]
    block: usize,
    /// Tapped target layers, comma-separated 0-based ids (default: --n-taps spread from the
    /// second layer to the third-from-last).
    #[arg(long, value_delimiter = ',')]
    taps: Option<Vec<usize>>,
    #[arg(long, default_value_t = 5)]
    n_taps: usize,
    /// Anchors per sequence and step.
    #[arg(long, default_value_t = 48)]
    anchors: usize,
    /// Loss decay γ: block offset k weighs exp(−(k−1)/γ).
    #[arg(long, default_value_t = 2.0)]
    gamma: f64,
    /// Per-offset loss weights instead of γ's decay: comma-separated, offset 1 first (offsets
    /// past the list weigh 0), or `serving:REPORT.json`: how often serving's verifier reached
    /// each draft position in a `bench --mode spec` report (its speculative runs together).
    #[arg(long)]
    position_weights: Option<String>,
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Fraction of steps warming up.
    #[arg(long, default_value_t = 0.04)]
    warmup: f64,
    /// Gradient clipping (global norm).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Sequences per step.
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// MASK token id (default: an unused control token of the target).
    #[arg(long)]
    mask_token: Option<u32>,
    /// Drafted tokens per verify step in the validation estimate of τ (the `max` the drafter
    /// will be served with).
    #[arg(long, default_value_t = 7)]
    serving_draft_len: usize,
    /// Initialise drafter layer i from target layer i (same head and MLP shapes) instead of
    /// random weights.
    #[arg(long)]
    init_from_target: bool,
    /// Attention biases whose q/k parts start as relative-position heads (head h looks
    /// 1 + h/2 positions back): the drafter learns where the anchor's token is in far fewer
    /// steps. On by default; kept as a flag so older commands still read.
    #[arg(long, overrides_with = "no_attention_bias")]
    attention_bias: bool,
    /// A drafter without attention biases (the z-lab shape).
    #[arg(long)]
    no_attention_bias: bool,
    /// Distil: score each block row by soft cross-entropy against the target's distribution
    /// over the drafter's vocabulary instead of its greedy token (the features then include
    /// the target's last layer).
    #[arg(long)]
    distill: bool,
}

#[derive(clap::Args)]
pub struct DataArgs {
    /// Target model: key (see `specula fetch --list`) or path to a GGUF file.
    #[arg(long)]
    target: String,
    /// Prompt sets, comma-separated (sharegpt, fastchat-dummy, codeio, codeio-completion,
    /// reasoning-gym-math, word-problems, function-stubs); evaluation sets are refused.
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
    /// Where the target runs: cpu, cuda, cuda:N, metal (GPU builds only).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Also write the target's features from the same pass that generates each answer, into
    /// the cache `train dflash` / `train eagle3` read for this directory: `dflash` (the
    /// DFlash trainer's default taps), `eagle3` (its three taps and the last layer), or
    /// comma-separated layer ids.
    #[arg(long)]
    features: Option<String>,
    /// The folder the feature caches are in (the trainers' --features-dir; default:
    /// `features/` in the specula cache).
    #[arg(long)]
    features_dir: Option<PathBuf>,
    /// With --features: the --max-tokens of the training runs that will read them.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
}

pub fn run(args: TrainArgs) -> Result<()> {
    match args.command {
        TrainCommand::Data(a) => run_data(a),
        TrainCommand::Dflash(a) => run_dflash(*a),
        TrainCommand::Eagle3(a) => run_eagle3(*a),
        TrainCommand::Validate(a) => run_validate(a),
        TrainCommand::Export(a) => run_export(a),
    }
}

fn run_validate(args: ValidateArgs) -> Result<()> {
    use crate::speculative::DrafterSpec;
    let target = load_target(&args.target, args.weights.as_deref(), &parse_device(&args.device)?)?;
    let examples = load_examples(&target, &args.data, args.max_tokens, 0)?;
    let mut examples =
        if args.all { examples } else { crate::train::validation::split(examples, None, usize::MAX)?.val };
    examples.truncate(args.val_examples);
    if examples.is_empty() {
        bail!("no example to measure on (one in 20 is held out; --all measures on every example)");
    }
    let device = target.model.device().clone();
    let mut observer = ProgressObserver::new();
    let all: Vec<&TrainExample> = examples.iter().collect();
    let features_for = |layer_ids: Vec<usize>, observer: &mut ProgressObserver| {
        let source = FeatureSource {
            mode: &args.features,
            parent: args.features_dir.as_deref(),
            dirs: args.data.clone(),
            rereads: false,
        };
        open_features(&source, &target, layer_ids, args.max_tokens, &all, observer)
    };
    let (m, what) = match DrafterSpec::parse(&args.drafter)? {
        DrafterSpec::Dflash { path: dir, .. } => {
            use crate::train::dflash::{evaluate, frozen_target, objective::ObjectiveSettings, AnchorDraw};
            let drafter = crate::speculative::dflash::DflashDrafter::load(&dir, &device)?;
            drafter.config.check_target(&target.model.config)?;
            let frozen = frozen_target(&target.model, drafter.draft_vocab())?;
            let (mut features, _) = features_for(drafter.config.target_layer_ids.clone(), &mut observer)?;
            let objective = ObjectiveSettings::hard(drafter.config.block_size, 2.0);
            let anchors = AnchorDraw { per_sequence: 48, seed: 0 };
            (evaluate(&drafter, &frozen, &examples, &mut features, objective, anchors, args.draft_len)?, "DFlash")
        }
        DrafterSpec::Eagle3 { path: dir, .. } => {
            use crate::train::eagle3::{evaluate, frozen_target};
            let drafter = crate::speculative::eagle3::Eagle3Drafter::load(&dir, &device)?;
            drafter.config.check_target(&target.model.config)?;
            let frozen = frozen_target(&target.model, drafter.draft_vocab())?;
            let mut layers = drafter.config.tap_layers(target.model.config.n_layers);
            layers.push(target.model.config.n_layers - 1);
            let (mut features, _) = features_for(layers, &mut observer)?;
            (evaluate(&drafter, &frozen, &examples, &mut features, args.ttt_steps)?, "EAGLE-3")
        }
        _ => bail!("--drafter {}: train validate measures dflash:DIR and eagle3:DIR drafters", args.drafter),
    };
    observer.finish();
    let acc: Vec<String> = m.accuracy.iter().take(7).map(|a| a.map_or("-".into(), |a| format!("{:.3}", a))).collect();
    println!(
        "{what} drafter on {} examples ({}): τ {}{} (greedy verify steps simulated at {} drafted tokens); \
         loss {:.4}; accuracy at positions 1.. [{}]",
        examples.len(),
        if args.all { "every example" } else { "the held-out split" },
        m.serving_tau.map_or("-".into(), |t| format!("{t:.3}")),
        m.serving_tau_interval
            .map_or(String::new(), |(lo, hi)| format!(", 95% interval {lo:.2}–{hi:.2} over the examples")),
        m.serving_draft_len.unwrap_or(0),
        m.loss,
        acc.join(" ")
    );
    Ok(())
}

fn run_export(args: ExportArgs) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?,
    );
    let (mut written, mut held, mut short) = (0usize, 0usize, 0usize);
    for dir in &args.data {
        // Refuses a directory holding any evaluation prompt.
        data::check_no_eval_prompts(dir)?;
        for e in data::read_examples(dir, false)?.examples {
            if !args.include_held_out && crate::train::validation::is_held_out(&format!("{}/{}", e.set, e.id)) {
                held += 1;
                continue;
            }
            let (mut ids, mut mask) = (e.tokens.clone(), e.loss_mask.clone());
            if let (Some(eos), "stop") = (args.eos, e.finish.as_str()) {
                ids.push(eos);
                mask.push(1);
            }
            // The trainers drop rows without two supervised tokens.
            if mask.iter().filter(|&&m| m == 1).count() < 2 {
                short += 1;
                continue;
            }
            serde_json::to_writer(&mut out, &serde_json::json!({ "input_ids": ids, "loss_mask": mask }))?;
            out.write_all(b"\n")?;
            written += 1;
        }
    }
    out.flush()?;
    println!(
        "{written} examples written to {} ({held} held out and left out{}; {short} with fewer than 2 answer tokens skipped)",
        args.out.display(),
        if args.include_held_out { "" } else { " (--include-held-out exports them)" }
    );
    Ok(())
}

/// `--position-weights W1,W2,…|serving:REPORT.json` as per-offset weights.
fn parse_position_weights(spec: &str) -> Result<Vec<f64>> {
    use crate::train::dflash::objective::{serving_position_weights, PositionWeights};
    let weights = match spec.strip_prefix("serving:") {
        Some(path) => {
            let (drafted_at, accepted_at, steps) = serving_use(std::path::Path::new(path))?;
            let w = serving_position_weights(&drafted_at, &accepted_at);
            if w.is_empty() {
                bail!("--position-weights {spec}: the report's speculative runs drafted nothing");
            }
            let shown: Vec<String> = w.iter().map(|x| format!("{x:.3}")).collect();
            eprintln!(
                "position weights from serving ({path}: {steps} verify steps): {} (offsets past {} weigh 0)",
                shown.join(", "),
                w.len()
            );
            w
        }
        None => spec
            .split(',')
            .map(|x| x.trim().parse::<f64>().with_context(|| format!("--position-weights: `{x}` is not a number")))
            .collect::<Result<_>>()?,
    };
    PositionWeights::table(&weights).with_context(|| format!("--position-weights {spec}"))?;
    Ok(weights)
}

/// The summed `drafted_at` / `accepted_at` counts and verify steps of a `bench --mode spec`
/// report's speculative runs.
fn serving_use(path: &std::path::Path) -> Result<(Vec<u64>, Vec<u64>, u64)> {
    const MAX_REPORT_BYTES: u64 = 512 << 20;
    let len = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?.len();
    if len > MAX_REPORT_BYTES {
        bail!("{}: {len} bytes is not a bench report (at most {MAX_REPORT_BYTES})", path.display());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let report: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let models =
        report["models"].as_array().with_context(|| format!("{}: no `models`: not a bench report", path.display()))?;
    let counts = |v: &serde_json::Value| -> Vec<u64> {
        v.as_array().map(|a| a.iter().map(|x| x.as_u64().unwrap_or(0)).collect()).unwrap_or_default()
    };
    let add = |sum: &mut Vec<u64>, more: Vec<u64>| {
        if sum.len() < more.len() {
            sum.resize(more.len(), 0);
        }
        sum.iter_mut().zip(more).for_each(|(s, m)| *s = s.saturating_add(m));
    };
    let (mut drafted_at, mut accepted_at, mut steps) = (Vec::new(), Vec::new(), 0u64);
    for run in models.iter().filter_map(|m| m["runs"].as_array()).flatten() {
        if run["mode"].as_str().is_none_or(|m| m == "plain") {
            continue;
        }
        let m = &run["metrics"];
        add(&mut drafted_at, counts(&m["drafted_at"]));
        add(&mut accepted_at, counts(&m["accepted_at"]));
        steps = steps.saturating_add(m["steps"].as_u64().unwrap_or(0));
    }
    Ok((drafted_at, accepted_at, steps))
}

/// `--draft-vocab N|full|keep` as (size, keep the drafter's); `keep` needs `--init-from`.
fn parse_draft_vocab(run: &RunArgs) -> Result<(Option<usize>, bool)> {
    Ok(match run.draft_vocab.as_str() {
        "full" => (None, false),
        "keep" if run.init_from.is_none() => {
            bail!("--draft-vocab keep needs --init-from (the drafter whose vocabulary to keep)")
        }
        "keep" => (None, true),
        n => match n.parse::<usize>() {
            Ok(0) | Err(_) => bail!("--draft-vocab {n}: expected a positive number, `full` or `keep`"),
            Ok(n) => (Some(n), false),
        },
    })
}

/// What a trainer's run loop needs besides its settings: the split examples and their
/// features (of `layer_ids`), with the seconds spent caching them.
struct Prepared<'a> {
    train: Vec<TrainExample>,
    val: Vec<TrainExample>,
    features: Features<'a>,
    feature_secs: f64,
}

/// Splits `run`'s data and opens the features of a run of `steps` steps of `batch` sequences.
fn examples_and_features<'a>(
    run: &RunArgs,
    target: &'a crate::engine::LoadedModel,
    max_tokens: usize,
    (steps, batch): (Option<usize>, usize),
    layer_ids: Vec<usize>,
    observer: &mut ProgressObserver,
) -> Result<Prepared<'a>> {
    let (train, val) = split_examples(target, run, max_tokens)?;
    let all: Vec<&TrainExample> = train.iter().chain(&val).collect();
    let source = FeatureSource::of(run, steps, batch, train.len());
    let (features, feature_secs) = open_features(&source, target, layer_ids, max_tokens, &all, observer)?;
    Ok(Prepared { train, val, features, feature_secs })
}

/// `--device cpu|cuda|cuda:N|metal|metal:N`.
pub fn parse_device(text: &str) -> Result<candle_core::Device> {
    let (kind, ordinal) = match text.split_once(':') {
        Some((k, n)) => (k, n.parse::<usize>().with_context(|| format!("--device {text}: bad ordinal"))?),
        None => (text, 0),
    };
    Ok(match kind {
        "cpu" => candle_core::Device::Cpu,
        "cuda" => candle_core::Device::new_cuda(ordinal)
            .with_context(|| format!("--device {text}: this build has no CUDA device (build with --features cuda)"))?,
        "metal" => candle_core::Device::new_metal(ordinal)
            .with_context(|| format!("--device {text}: this build has no Metal device"))?,
        other => bail!("--device {other}: expected cpu, cuda[:N] or metal[:N]"),
    })
}

/// Steps of a `--quick` run.
const QUICK_STEPS: usize = 60;

impl RunArgs {
    /// Applies `--quick` (a short schedule, and data made first when none is given), then
    /// checks there is data.
    fn apply_quick(&mut self, target: &crate::engine::LoadedModel) -> Result<()> {
        if self.quick {
            self.steps.get_or_insert(QUICK_STEPS);
            self.checkpoint_every = self.checkpoint_every.min(30);
            self.log_every = self.log_every.min(5);
            if self.data.is_empty() {
                let dir = self.out.join("data");
                eprintln!(
                    "--quick: making a small data set in {} (96 ShareGPT prompts, 128 tokens each)",
                    dir.display()
                );
                let settings = DataSettings {
                    sources: vec![PromptSource::Set("sharegpt".into())],
                    skip: 0,
                    limit: Some(96),
                    gen: GenSettings {
                        max_new_tokens: 128,
                        temperature: 0.0,
                        seed: 0,
                        chat_template_kwargs: Default::default(),
                        responses: data::ResponseSource::Target,
                    },
                    out: dir.clone(),
                    batch: 16,
                    shard_size: 1000,
                    kv_tokens: 16384,
                    max_prompt_tokens: Some(256),
                    features: None,
                };
                make_data(target, &settings)?;
                self.data = vec![dir];
            }
        }
        if self.data.is_empty() {
            bail!("--data: give the training data directories (from `specula train data`), or --quick");
        }
        Ok(())
    }

    fn data_names(&self) -> Vec<String> {
        self.data
            .iter()
            .map(|d| d.file_name().map_or_else(|| d.display().to_string(), |n| n.to_string_lossy().into_owned()))
            .collect()
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
        features: None,
    };
    let mut settings = settings;
    settings.validate()?;
    // Refuse evaluation and unknown sets before loading a model.
    for s in &settings.sources {
        data::check_training_set(s.key())?;
    }
    let target = load_target(&args.target, args.weights.as_deref(), &parse_device(&args.device)?)?;
    eprintln!("target {} ({} tokens in the vocabulary)", target.path.display(), target.tokenizer.vocab_size());
    if let Some(which) = &args.features {
        let n = target.model.config.n_layers;
        let layer_ids = match which.as_str() {
            "dflash" => crate::speculative::dflash::default_target_layer_ids(
                n,
                crate::train::dflash::TrainSettings::default().n_taps,
            ),
            "eagle3" => {
                let mut l = crate::speculative::eagle3::default_aux_layer_ids(n);
                l.push(n - 1);
                l
            }
            list => list
                .split(',')
                .map(|x| x.trim().parse::<usize>().ok().filter(|&l| l < n))
                .collect::<Option<Vec<_>>>()
                .with_context(|| format!("--features {list}: expected dflash, eagle3 or layer ids below {n}"))?,
        };
        settings.features = Some(data::DataFeatures {
            key: FeatureKey {
                target: data::TargetId::of(&target).file_name.clone(),
                target_sha256: crate::train::features::model_sha256(&target.path)?,
                layer_ids,
                hidden: target.model.config.hidden,
                max_tokens: args.max_tokens,
            },
            dir: args.features_dir.clone(),
        });
    }
    make_data(&target, &settings)
}

/// Runs `train data` with `settings`, printing progress to stderr and the summary to stdout.
fn make_data(target: &crate::engine::LoadedModel, settings: &DataSettings) -> Result<()> {
    settings.validate()?;
    let mut last_print = Instant::now();
    let summary = data::generate_data(target, settings, &mut |p| {
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
            if settings.gen.responses == data::ResponseSource::Dataset {
                ", or without an answer of their own"
            } else {
                ""
            }
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
        settings.out.display()
    );
    Ok(())
}

fn run_dflash(mut args: DflashArgs) -> Result<()> {
    use crate::train::dflash::{TrainRun, TrainSettings};
    let (draft_vocab, keep_draft_vocab) = parse_draft_vocab(&args.run)?;
    let quick = args.run.quick;
    let settings = TrainSettings {
        layers: args.layers,
        heads: args.heads,
        kv_heads: args.kv_heads,
        head_dim: args.head_dim,
        ffn: args.ffn,
        block: args.block,
        taps: args.taps.clone(),
        n_taps: args.n_taps,
        anchors: if quick { args.anchors.min(32) } else { args.anchors },
        gamma: Some(args.gamma),
        position_weights: args.position_weights.as_deref().map(parse_position_weights).transpose()?,
        adam: crate::train::optim::AdamWSettings { lr: args.lr, weight_decay: args.weight_decay, ..Default::default() },
        warmup: args.warmup,
        clip: args.clip,
        steps: args.run.steps,
        epochs: args.run.epochs,
        batch: args.batch,
        seed: args.run.seed,
        max_tokens: args.run.max_tokens,
        draft_vocab,
        keep_draft_vocab,
        mask_token: args.mask_token,
        val_examples: args.run.val_examples,
        checkpoint_every: args.run.checkpoint_every,
        init_from: args.run.init_from.clone(),
        init_from_target: args.init_from_target,
        attention_bias: !args.no_attention_bias,
        distill: args.distill,
        serving_draft_len: args.serving_draft_len,
    };
    settings.validate()?;
    let export_dtype = export_dtype(&args.run.dtype)?;
    let target = load_target(&args.run.target, args.run.weights.as_deref(), &parse_device(&args.run.device)?)?;
    args.run.apply_quick(&target)?;
    let mut settings = settings;
    settings.steps = args.run.steps;
    settings.checkpoint_every = args.run.checkpoint_every;
    // The tapped layers, before the drafter exists: from the settings or the drafter started from.
    let taps = match (&settings.taps, &settings.init_from) {
        (Some(t), _) => t.clone(),
        // A drafter trained further keeps its own taps.
        (None, Some(dir)) => {
            crate::speculative::dflash::DflashConfig::from_file(&dir.join("config.json"))?.target_layer_ids
        }
        (None, None) => {
            crate::speculative::dflash::default_target_layer_ids(target.model.config.n_layers, settings.n_taps)
        }
    };
    let layer_ids = settings.feature_layers(&taps, target.model.config.n_layers);
    let mut observer = ProgressObserver::new();
    let shape = (settings.steps, settings.batch);
    let Prepared { train, val, mut features, feature_secs } =
        examples_and_features(&args.run, &target, settings.max_tokens, shape, layer_ids, &mut observer)?;
    let run = TrainRun {
        target: &target.model,
        tokenizer: &target.tokenizer,
        train,
        val,
        settings,
        out: args.run.out.clone(),
        resume: args.run.resume,
        stop_after: args.run.stop_after,
        export_dtype,
        log_every: args.run.log_every,
        data: args.run.data_names(),
        feature_secs,
    };
    let report = run.run(&mut features, &mut observer)?;
    observer.finish();
    print_report(&report, "scored block rows");
    Ok(())
}

fn run_eagle3(mut args: Eagle3Args) -> Result<()> {
    use crate::train::eagle3::{Eagle3Run, Eagle3TrainSettings};
    let (draft_vocab, keep_draft_vocab) = parse_draft_vocab(&args.run)?;
    let mut settings = Eagle3TrainSettings {
        ttt_steps: args.ttt_steps,
        taps: args.taps.clone(),
        draft_vocab,
        keep_draft_vocab,
        ffn: args.ffn,
        adam: crate::train::optim::AdamWSettings { lr: args.lr, weight_decay: args.weight_decay, ..Default::default() },
        warmup: args.warmup,
        clip: args.clip,
        steps: args.run.steps,
        epochs: args.run.epochs,
        batch: args.batch,
        seed: args.run.seed,
        max_tokens: args.run.max_tokens,
        val_examples: args.run.val_examples,
        checkpoint_every: args.run.checkpoint_every,
        init_from: args.run.init_from.clone(),
    };
    settings.validate()?;
    let dtype = export_dtype(&args.run.dtype)?;
    let target = load_target(&args.run.target, args.run.weights.as_deref(), &parse_device(&args.run.device)?)?;
    args.run.apply_quick(&target)?;
    settings.steps = args.run.steps;
    settings.checkpoint_every = args.run.checkpoint_every;
    if let Some(dir) = &settings.init_from {
        // A drafter trained further keeps its own taps (the feature cache must hold them); a
        // shape it does not have is refused here, before features are computed.
        let c = crate::speculative::eagle3::Eagle3Config::from_file(&dir.join("config.json"))?;
        if settings.taps.is_none() {
            settings.taps = c.aux_layer_ids.clone();
        }
        settings.check_init_from(dir, &c, target.model.config.n_layers)?;
    }
    let layer_ids = settings.feature_layers(&target.model);
    let mut observer = ProgressObserver::new();
    let shape = (settings.steps, settings.batch);
    let Prepared { train, val, mut features, feature_secs } =
        examples_and_features(&args.run, &target, settings.max_tokens, shape, layer_ids, &mut observer)?;
    let run = Eagle3Run {
        target: &target.model,
        train,
        val,
        settings,
        out: args.run.out.clone(),
        resume: args.run.resume,
        stop_after: args.run.stop_after,
        export_dtype: dtype,
        log_every: args.run.log_every,
        data: args.run.data_names(),
        feature_secs,
    };
    let report = run.run(&mut features, &mut observer)?;
    observer.finish();
    print_report(&report, "scored rows");
    Ok(())
}

/// The one-line summary of a finished (or stopped) training run.
fn print_report(report: &TrainReport, rows: &str) {
    let val = report.final_val.as_ref();
    println!(
        "{} of {} steps ({} train / {} validation examples) in {:.0}s ({:.2} h of training in all), {:.0} {rows}/s, \
         peak memory {:.0} MB; validation loss {}, τ {} (greedy verify steps simulated at {} drafted tokens); drafter in {}",
        report.steps,
        report.total_steps,
        report.train_examples,
        report.val_examples,
        report.secs,
        report.total_secs / 3600.0,
        report.rows_per_sec,
        report.peak_rss_mb.unwrap_or(f64::NAN),
        val.map_or("-".into(), |v| format!("{:.4}", v.loss)),
        val.and_then(|v| v.serving_tau).map_or("-".into(), |t| format!("{t:.2}")),
        val.and_then(|v| v.serving_draft_len).map_or("-".into(), |k| k.to_string()),
        report.drafter_dir.display()
    );
}

/// The target model a trainer runs against.
fn load_target(key: &str, weights: Option<&str>, device: &candle_core::Device) -> Result<crate::engine::LoadedModel> {
    let path = crate::fetch::resolve_model(key, true)?;
    let weights = weights.map(crate::model::WeightFormat::parse).transpose()?;
    crate::engine::LoadedModel::load(&path, weights, device)
}

/// The examples of every data directory, after checking each was made with `target` and holds
/// no evaluation prompt; directory i is source `first_source + i`.
fn load_examples(
    target: &crate::engine::LoadedModel,
    dirs: &[PathBuf],
    max_tokens: usize,
    first_source: usize,
) -> Result<Vec<TrainExample>> {
    let id = data::TargetId::of(target);
    let mut examples = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
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
        examples.extend(crate::train::examples::load_examples(dir, max_tokens, first_source + i)?);
    }
    Ok(examples)
}

/// Training and validation examples by the fixed held-out split
/// ([`crate::train::validation::split`]); with --val-data, the held-out examples come from
/// those directories (sources after --data's).
fn split_examples(
    target: &crate::engine::LoadedModel,
    run: &RunArgs,
    max_tokens: usize,
) -> Result<(Vec<TrainExample>, Vec<TrainExample>)> {
    let examples = load_examples(target, &run.data, max_tokens, 0)?;
    let pool = if run.val_data.is_empty() {
        None
    } else {
        Some(load_examples(target, &run.val_data, max_tokens, run.data.len())?)
    };
    let split = crate::train::validation::split(examples, pool, run.val_examples)?;
    eprintln!(
        "{} training examples, {} held out and validated on{}{}",
        split.train.len(),
        split.val.len(),
        if split.held_out_unused > 0 {
            format!(" ({} more held out, over --val-examples)", split.held_out_unused)
        } else {
            String::new()
        },
        if split.same_prompt_dropped > 0 {
            format!("; {} left out of training for sharing a held-out prompt", split.same_prompt_dropped)
        } else {
            String::new()
        }
    );
    if split.val.is_empty() {
        eprintln!("warning: no example of this data is held out (one in 20 is): the run has no validation");
    }
    Ok((split.train, split.val))
}

/// Where a command's features come from: `--features`, `--features-dir` and the data
/// directories (in source order) they are for.
struct FeatureSource<'s> {
    mode: &'s str,
    parent: Option<&'s std::path::Path>,
    dirs: Vec<PathBuf>,
    /// The run reads its examples more than once (or may, resumed): `auto` caches them.
    rereads: bool,
}

impl<'s> FeatureSource<'s> {
    /// A training run of `steps` × `batch` example reads over `train` training examples.
    fn of(run: &'s RunArgs, steps: Option<usize>, batch: usize, train: usize) -> Self {
        let reads = steps.map_or(run.epochs * train as f64, |s| (s * batch) as f64);
        Self {
            mode: &run.features,
            parent: run.features_dir.as_deref(),
            dirs: run.data.iter().chain(&run.val_data).cloned().collect(),
            rereads: reads > train as f64 || run.resume || run.stop_after.is_some(),
        }
    }
}

/// Target features of `layer_ids` for the examples: recomputed on use (`online`), or cached
/// once in f16 per data directory (`offline`; `auto`: offline when the run reads its examples
/// more than once or every example's features are cached already, as `train data --features`
/// leaves them), the disk size printed first. Returns them and the seconds spent caching.
fn open_features<'a>(
    source: &FeatureSource,
    target: &'a crate::engine::LoadedModel,
    layer_ids: Vec<usize>,
    max_tokens: usize,
    examples: &[&TrainExample],
    observer: &mut ProgressObserver,
) -> Result<(Features<'a>, f64)> {
    if !matches!(source.mode, "auto" | "online" | "offline") {
        bail!("--features {}: expected auto, online or offline", source.mode);
    }
    if source.mode == "online" {
        eprintln!("target features: online");
        return Ok((Features::Online { target: &target.model, layer_ids }, 0.0));
    }
    let t0 = Instant::now();
    let key = FeatureKey {
        target: data::TargetId::of(target).file_name.clone(),
        target_sha256: crate::train::features::model_sha256(&target.path)?,
        layer_ids: layer_ids.clone(),
        hidden: target.model.config.hidden,
        max_tokens,
    };
    let dirs: Vec<PathBuf> = source
        .dirs
        .iter()
        .map(|d| crate::train::features::default_dir(&key, d, source.parent))
        .collect::<Result<_>>()?;
    if source.mode == "auto" && !source.rereads {
        let cached = examples.iter().all(|e| {
            dirs.get(e.source).is_some_and(|d| {
                d.join("features.json").exists() && FeatureCache::open(d, key.clone()).is_ok_and(|c| c.contains(&e.key))
            })
        });
        if !cached {
            eprintln!("target features: online (one pass over the data; no complete cache)");
            return Ok((Features::Online { target: &target.model, layer_ids }, 0.0));
        }
    }
    eprintln!(
        "target features: offline, cached in {}",
        dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
    );
    let mut caches = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        let mut cache = FeatureCache::open(dir, key.clone())?;
        let mine: Vec<&TrainExample> = examples.iter().copied().filter(|e| e.source == i).collect();
        crate::train::features::fill_feature_cache(&mut cache, &key, &target.model, &mine, |done, total| {
            observer.prepare("examples' target features", done, total)
        })?;
        caches.push(cache);
    }
    Ok((Features::Offline(caches), t0.elapsed().as_secs_f64()))
}

fn export_dtype(name: &str) -> Result<candle_core::DType> {
    Ok(match name {
        "f32" => candle_core::DType::F32,
        "f16" => candle_core::DType::F16,
        "bf16" => candle_core::DType::BF16,
        other => bail!("--dtype {other}: expected f32, f16 or bf16"),
    })
}

/// Progress: a bar on a terminal, else a plain line every [`PLAIN_EVERY_SECS`].
struct ProgressObserver {
    bar: indicatif::ProgressBar,
    last_plain: Option<Instant>,
    started: Instant,
    /// The step `started` was taken at: a resumed run's ETA counts only the steps it ran.
    started_step: usize,
}

const PLAIN_EVERY_SECS: f64 = 15.0;

impl ProgressObserver {
    fn new() -> Self {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} {elapsed}<{eta}")
                .expect("valid template"),
        );
        Self { bar, last_plain: None, started: Instant::now(), started_step: 0 }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }

    /// The plain progress line of a step.
    fn step_line(&self, p: &StepProgress) -> String {
        let tau = p.tau.map_or("-".into(), |t| format!("{t:.2}"));
        let secs = self.started.elapsed().as_secs_f64();
        let done = p.step.saturating_sub(self.started_step);
        format!(
            "step {}/{} loss {:.3} {:.0} rows/s τ {tau} ETA {}",
            p.step,
            p.total,
            p.loss,
            p.rows_per_sec,
            eta(done, p.total.saturating_sub(self.started_step), secs)
        )
    }

    /// Prints a plain line when there is no terminal and the last one is old enough.
    fn plain(&mut self, force: bool, text: impl FnOnce() -> String) {
        if !self.bar.is_hidden() {
            return;
        }
        if force || self.last_plain.is_none_or(|t| t.elapsed().as_secs_f64() >= PLAIN_EVERY_SECS) {
            self.last_plain = Some(Instant::now());
            eprintln!("{}", text());
        }
    }
}

fn eta(done: usize, total: usize, secs: f64) -> String {
    if done == 0 {
        return "?".into();
    }
    let left = secs / done as f64 * total.saturating_sub(done) as f64;
    format!("{}m{:02}s", (left / 60.0) as u64, (left % 60.0) as u64)
}

impl TrainObserver for ProgressObserver {
    fn prepare(&mut self, what: &str, done: usize, total: usize) {
        if done == 0 {
            self.started = Instant::now();
        }
        self.bar.set_length(total as u64);
        self.bar.set_position(done as u64);
        self.bar.set_message(what.to_string());
        let secs = self.started.elapsed().as_secs_f64();
        self.plain(done == total, || format!("{what}: {done}/{total}, {:.0}s, ETA {}", secs, eta(done, total, secs)));
    }

    fn step(&mut self, p: StepProgress) {
        let restarted = self.bar.length() != Some(p.total as u64) || p.step <= 1;
        if restarted {
            self.started = Instant::now();
            self.started_step = p.step;
        }
        let tau = p.tau.map_or("-".into(), |t| format!("{t:.2}"));
        self.bar.set_length(p.total as u64);
        self.bar.set_position(p.step as u64);
        if restarted {
            // A resumed run jumps to its checkpoint's step: not progress made at this rate.
            self.bar.reset_eta();
        }
        self.bar.set_message(format!("steps, loss {:.3}, {:.0} rows/s, τ {tau}", p.loss, p.rows_per_sec));
        let line = self.step_line(&p);
        self.plain(p.step == p.total, || line);
    }

    fn log(&mut self, line: &LogLine) {
        let acc: Vec<String> =
            line.train.accuracy.iter().take(4).map(|a| a.map_or("-".into(), |a| format!("{:.2}", a))).collect();
        let val = line.val.as_ref().map_or(String::new(), |v| {
            format!(" | val loss {:.3}, τ {}", v.loss, v.serving_tau.map_or("-".into(), |t| format!("{t:.2}")))
        });
        let text = format!(
            "step {} lr {:.2e} loss {:.3} acc@1..4 [{}] |g| {:.2} {:.0} rows/s{}",
            line.step,
            line.lr,
            line.train.loss,
            acc.join(" "),
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

#[cfg(test)]
mod tests {
    use super::parse_position_weights;

    #[test]
    fn a_resumed_runs_eta_counts_the_steps_it_ran() {
        use crate::train::progress::{StepProgress, TrainObserver};
        let mut obs = super::ProgressObserver::new();
        let at = |step| StepProgress { step, total: 1000, loss: 1.0, rows_per_sec: 300.0, tau: None };
        obs.step(at(801));
        // Resumed after step 800: steps 802-821 in 80 s leave 179 steps, 716 s (counting from
        // step 0 it said 14 s).
        obs.started -= std::time::Duration::from_secs(80);
        let line = obs.step_line(&at(821));
        assert!(line.ends_with("ETA 11m56s"), "{line}");
    }

    #[test]
    fn position_weights_come_as_a_list_or_from_a_bench_reports_serving_use() {
        assert_eq!(parse_position_weights("1, 0.5,0.25").unwrap(), vec![1.0, 0.5, 0.25]);
        for bad in ["", "1,x", "-1", "0,0", "serving:/nonexistent/report.json"] {
            assert!(parse_position_weights(bad).is_err(), "{bad}");
        }
        // Two speculative runs and a plain one (ignored): positions drafted 100/50, accepted 40/0.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("report.json");
        let run = |mode: &str, drafted: [u64; 2], accepted: [u64; 2]| serde_json::json!({"mode": mode, "metrics": {"steps": 120, "drafted_at": drafted, "accepted_at": accepted}});
        let report = serde_json::json!({"models": [{"runs": [
            run("plain", [9, 9], [9, 9]), run("dflash k=auto", [60, 30], [24, 0]), run("dflash k=auto", [40, 20], [16, 0])
        ]}]});
        std::fs::write(&path, report.to_string()).unwrap();
        let w = parse_position_weights(&format!("serving:{}", path.display())).unwrap();
        // Position 2: accepted at 1 (40) × half the drafts going on (50/100), over 100.
        assert_eq!(w, vec![1.0, 0.2]);
        std::fs::write(&path, "{\"models\": 3}").unwrap();
        assert!(parse_position_weights(&format!("serving:{}", path.display())).is_err());
    }
}
