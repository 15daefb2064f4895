//! The `specula` command line: one subcommand per file.

mod bench_cmd;
mod fetch_cmd;
mod generate_cmd;
mod inspect_cmd;
mod loadtest_cmd;
mod serve_cmd;
mod train_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "specula", version, about = "LLM inference with lossless speculative decoding")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download a model or data set (verified, resumable) into $SPECULA_HOME.
    Fetch(fetch_cmd::FetchArgs),
    /// Print a model's architecture, dimensions, quantisation types, tokenizer and template.
    Inspect(inspect_cmd::InspectArgs),
    /// Generate text from a prompt, streaming it, and print tokens/s.
    Generate(generate_cmd::GenerateArgs),
    /// Measure prefill/decode tokens/s and the verify-cost curve.
    Bench(bench_cmd::BenchArgs),
    /// Serve the OpenAI-compatible API (chat, completions, streaming) with continuous batching.
    Serve(serve_cmd::ServeArgs),
    /// Drive a running server with concurrent streaming clients; report tok/s, TTFT, ITL.
    Loadtest(loadtest_cmd::LoadtestArgs),
    /// Train DFlash drafters: `train data` makes training data with the target.
    Train(train_cmd::TrainArgs),
}

/// Entry point; returns the process exit code. Errors print as one line.
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    init_logging(matches!(cli.command, Command::Serve(_)));
    let result = match cli.command {
        Command::Fetch(a) => fetch_cmd::run(a),
        Command::Inspect(a) => inspect_cmd::run(a),
        Command::Generate(a) => generate_cmd::run(a),
        Command::Bench(a) => bench_cmd::run(a),
        Command::Serve(a) => serve_cmd::run(a),
        Command::Loadtest(a) => loadtest_cmd::run(a),
        Command::Train(a) => train_cmd::run(a),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            1
        }
    }
}

/// Logs through `tracing` to stderr, filtered by `RUST_LOG` (default: `info` for `serve`, whose
/// info lines are one per request, `warn` otherwise; `RUST_LOG=specula::engine=debug` adds a
/// line per engine step). `SPECULA_LOG_FORMAT=json` writes one JSON object per line.
fn init_logging(serving: bool) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(if serving { "info" } else { "warn" }));
    let json = std::env::var("SPECULA_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(true);
    let _ = if json { builder.json().flatten_event(true).try_init() } else { builder.with_ansi(false).try_init() };
}

/// The error and its causes on one line.
fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}").replace('\n', " ")
}

/// Shared model options.
#[derive(clap::Args, Clone)]
pub struct ModelArgs {
    /// Model key (see `specula fetch --list`) or path to a GGUF file.
    #[arg(long, short = 'm', default_value = "smollm2-135m")]
    pub model: String,
    /// Weight format in memory: native, q8_0, q4_0, f16, f32 (default: measured best for the file).
    #[arg(long)]
    pub weights: Option<String>,
    /// KV cache capacity in tokens.
    #[arg(long, default_value_t = 8192)]
    pub kv_tokens: usize,
    /// KV cache element type: f16 (like llama.cpp) or f32.
    #[arg(long, default_value = "f16")]
    pub kv_type: String,
}

impl ModelArgs {
    pub fn kv_pool(&self, model: &crate::model::Transformer) -> anyhow::Result<crate::kv::KvPool> {
        let dtype = crate::kv::KvDtype::parse(&self.kv_type).map_err(anyhow::Error::msg)?;
        Ok(model.new_kv_pool_typed(self.kv_tokens, dtype))
    }

    pub fn load(&self) -> anyhow::Result<crate::engine::LoadedModel> {
        let path = crate::fetch::resolve_model(&self.model, true)?;
        let weights = self.weights.as_deref().map(crate::model::WeightFormat::parse).transpose()?;
        crate::engine::LoadedModel::load(&path, weights, &candle_core::Device::Cpu)
    }
}
