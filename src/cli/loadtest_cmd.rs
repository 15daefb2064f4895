//! `specula loadtest`: concurrent streaming clients against a running server on this machine.

use crate::server::loadtest::{run as run_load, LoadConfig, LoadPrompt, LoadReport};
use anyhow::Result;
use std::time::Duration;

#[derive(clap::Args)]
pub struct LoadtestArgs {
    /// Server to load (loopback addresses only).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Concurrent clients; a comma-separated list runs one round per value (e.g. 1,4,8,16).
    #[arg(long, value_delimiter = ',', default_value = "4")]
    clients: Vec<usize>,
    /// Requests per round (shared by the clients).
    #[arg(long, default_value_t = 16)]
    requests: usize,
    /// Completion tokens per request.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// A round starts no request after this many seconds.
    #[arg(long, default_value_t = 300)]
    max_secs: u64,
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long)]
    api_key: Option<String>,
    #[arg(long)]
    model: Option<String>,
    /// Ask the server not to speculate (compare against its drafter on the same server).
    #[arg(long)]
    no_speculate: bool,
    /// Generate exactly --max-tokens per request (the server ignores end-of-sequence tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Print the reports as JSON (vLLM's serving benchmark keys among them).
    #[arg(long)]
    json: bool,
    /// Prompts from a real prompt set instead of the built-in eight (e.g. sharegpt, mt-bench,
    /// humaneval: code completions go to /v1/completions), as many as --requests.
    #[arg(long)]
    dataset: Option<String>,
    /// Write an SVG chart of output tokens/s and median inter-token latency against clients.
    #[arg(long)]
    chart: Option<std::path::PathBuf>,
    /// Hang up this fraction of requests mid-stream, after a random number of tokens.
    #[arg(long, default_value_t = 0.0)]
    disconnect_fraction: f64,
    /// Send this fraction of requests malformed; each must get a 4xx OpenAI error.
    #[arg(long, default_value_t = 0.0)]
    malformed_fraction: f64,
}

pub fn run(args: LoadtestArgs) -> Result<()> {
    if !(0.0..=1.0).contains(&(args.disconnect_fraction + args.malformed_fraction))
        || args.disconnect_fraction < 0.0
        || args.malformed_fraction < 0.0
    {
        anyhow::bail!("--disconnect-fraction and --malformed-fraction must be ≥ 0 and sum to at most 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let prompts = match &args.dataset {
        Some(key) => crate::datasets::load(key, Some(args.requests))?
            .into_iter()
            .map(|p| LoadPrompt { text: p.text, chat: p.kind == crate::datasets::PromptKind::Chat })
            .collect(),
        None => LoadConfig::default().prompts,
    };
    let mut reports: Vec<LoadReport> = Vec::new();
    for &clients in &args.clients {
        let cfg = LoadConfig {
            url: args.url.clone(),
            clients,
            requests: args.requests,
            max_duration: Duration::from_secs(args.max_secs),
            max_tokens: args.max_tokens,
            temperature: args.temperature,
            api_key: args.api_key.clone(),
            no_speculate: args.no_speculate,
            model: args.model.clone(),
            ignore_eos: args.ignore_eos,
            prompts: prompts.clone(),
            disconnect_fraction: args.disconnect_fraction,
            malformed_fraction: args.malformed_fraction,
        };
        let report = rt.block_on(run_load(&cfg))?;
        if !args.json {
            println!("{}", report.render());
        }
        reports.push(report);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    }
    if let Some(path) = &args.chart {
        let rounds: Vec<(usize, f64, f64)> =
            reports.iter().map(|r| (r.clients, r.output_throughput, r.median_itl_ms)).collect();
        let title = format!("specula loadtest against {} ({} tokens per request)", args.url, args.max_tokens);
        std::fs::write(path, crate::bench::report::render_throughput_svg(&title, &rounds)?)?;
        eprintln!("wrote {}", path.display());
    }
    if reports.iter().any(|r| r.requests_ok == 0) {
        anyhow::bail!("a round completed no request");
    }
    Ok(())
}
