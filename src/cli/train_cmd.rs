//! `specula train …`: training DFlash drafters. `train data` makes the training data.

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
}

#[derive(clap::Args)]
pub struct DataArgs {
    /// Target model: key (see `specula fetch --list`) or path to a GGUF file.
    #[arg(long)]
    target: String,
    /// Prompt sets, comma-separated (sharegpt, fastchat-dummy); evaluation sets are refused.
    #[arg(long, value_delimiter = ',')]
    prompts: Vec<String>,
    /// A local file in a set's format, KEY=PATH (e.g. fastchat-dummy=chats.json); repeatable.
    #[arg(long)]
    prompts_file: Vec<String>,
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
    /// Examples per shard file.
    #[arg(long, default_value_t = 1000)]
    shard_size: usize,
    /// KV cache capacity in tokens, shared by the batch.
    #[arg(long, default_value_t = 16384)]
    kv_tokens: usize,
    /// Weight format in memory: native, q8_0, q4_0, f16, f32 (default: measured best).
    #[arg(long)]
    weights: Option<String>,
}

pub fn run(args: TrainArgs) -> Result<()> {
    match args.command {
        TrainCommand::Data(a) => run_data(a),
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
        limit: args.limit,
        gen: GenSettings { max_new_tokens: args.max_new_tokens, temperature: args.temperature, seed: args.seed },
        out: args.out.clone(),
        batch: args.batch,
        shard_size: args.shard_size,
        kv_tokens: args.kv_tokens,
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
        eprintln!("skipped {} prompt(s) too long for the context or KV cache", summary.skipped.len());
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
