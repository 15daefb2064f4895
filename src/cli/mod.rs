//! The `specula` command line: one subcommand per file.

mod bench_cmd;
mod fetch_cmd;
mod generate_cmd;
mod inspect_cmd;
mod loadtest_cmd;
mod serve_cmd;
mod speculative_config;
mod train_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "specula", version, about = "LLM inference with lossless speculative decoding")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Worker threads for the model's matmuls and attention (as llama.cpp's `-t`); default one
    /// per physical core. Same as setting `CANDLE_NUM_THREADS`.
    #[arg(long, short = 't', global = true, value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: Option<u16>,
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
    let cli = match Cli::try_parse_from(llama_cpp_spellings(std::env::args_os())) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    if let Some(threads) = cli.threads {
        set_threads(threads, matches!(cli.command, Command::Train(_)));
    }
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

/// `--draft-max`: 0 to [`MAX_DRAFT`](crate::speculative::MAX_DRAFT) tokens.
fn draft_max_arg(text: &str) -> Result<usize, String> {
    let max = crate::speculative::MAX_DRAFT;
    text.trim().parse::<usize>().ok().filter(|&n| n <= max).ok_or_else(|| format!("expected 0 to {max}, got `{text}`"))
}

/// A count of at least 1.
fn positive_count_arg(text: &str) -> Result<usize, String> {
    text.trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n >= 1)
        .ok_or_else(|| format!("expected a whole number ≥ 1, got `{text}`"))
}

/// llama-server's two-letter single-dash flags, which clap would read as a short flag and its
/// value (`-np 4` as `-n p`), rewritten to their long spellings in `serve` command lines.
fn llama_cpp_spellings(args: impl IntoIterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let args: Vec<std::ffi::OsString> = args.into_iter().collect();
    if args.get(1).and_then(|a| a.to_str()) != Some("serve") {
        return args;
    }
    args.into_iter()
        .map(|arg| match arg.to_str() {
            Some("-np") => "--parallel".into(),
            Some(other) if other.starts_with("-np=") => format!("--parallel={}", &other[4..]).into(),
            _ => arg,
        })
        .collect()
}

/// Sizes the matmul pool (candle's, read when it first starts, which is after this) and, for
/// training, whose backward pass runs on rayon's pool, that one too. Runs before any worker
/// thread exists, so changing the environment is safe.
fn set_threads(threads: u16, training: bool) {
    std::env::set_var("CANDLE_NUM_THREADS", threads.to_string());
    if training {
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
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

/// The model `serve` and `generate` run when none is named.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// Shared model options.
#[derive(clap::Args, Clone)]
pub struct ModelArgs {
    /// Model key (see `specula fetch --list`) or path to a GGUF file (default smollm2-135m).
    #[arg(value_name = "MODEL")]
    model_positional: Option<String>,
    /// The model, as a flag (llama.cpp's `-m`); the same as the positional MODEL.
    #[arg(long = "model", short = 'm', value_name = "MODEL", conflicts_with = "model_positional")]
    model_flag: Option<String>,
    /// Weight format in memory: native, q8_0, q4_0, f16, f32 (default: measured best for the file).
    #[arg(long)]
    pub weights: Option<String>,
    /// KV cache capacity in tokens, shared by all requests.
    #[arg(long, default_value_t = 8192)]
    pub kv_tokens: usize,
    /// The most tokens (prompt + output) one request may have (llama.cpp's `-c`, vLLM's
    /// `--max-model-len`); default the model's context, or the KV cache if smaller.
    #[arg(long = "ctx-size", short = 'c', visible_alias = "max-model-len", value_name = "TOKENS",
          value_parser = clap::value_parser!(u64).range(2..))]
    ctx_size: Option<u64>,
    /// KV cache element type: f16 (like llama.cpp) or f32.
    #[arg(long, default_value = "f16")]
    pub kv_type: String,
}

impl ModelArgs {
    /// The model key or path, positional or `--model`.
    pub fn name(&self) -> &str {
        self.model_positional.as_deref().or(self.model_flag.as_deref()).unwrap_or(DEFAULT_MODEL)
    }

    /// `--ctx-size` / `--max-model-len`, if given.
    pub fn max_model_len(&self) -> Option<usize> {
        self.ctx_size.map(|n| usize::try_from(n).unwrap_or(usize::MAX))
    }

    pub fn kv_pool(&self, model: &crate::model::Transformer) -> anyhow::Result<crate::kv::KvPool> {
        let dtype = crate::kv::KvDtype::parse(&self.kv_type).map_err(anyhow::Error::msg)?;
        Ok(model.new_kv_pool_typed(self.kv_tokens, dtype))
    }

    pub fn load(&self) -> anyhow::Result<crate::engine::LoadedModel> {
        let path = crate::fetch::resolve_model(self.name(), true)?;
        let weights = self.weights.as_deref().map(crate::model::WeightFormat::parse).transpose()?;
        crate::engine::LoadedModel::load(&path, weights, &candle_core::Device::Cpu)
    }
}
