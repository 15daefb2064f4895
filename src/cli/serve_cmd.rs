//! `specula serve`: the OpenAI-compatible server with continuous batching and speculation.

use super::speculative_config::SpeculativeConfig;
use super::ModelArgs;
use crate::engine::{Engine, EngineConfig};
use crate::server::{serve, serve_while_loading, AppState, ServerConfig};
use crate::speculative::suffix::cache::{SuffixCache, SuffixCacheConfig, SuffixScope, DEFAULT_CACHE_MB};
use crate::speculative::{parse_draft_len, parse_draft_tree, DraftTree, DrafterSpec, MAX_DRAFT};
use anyhow::{bail, Context, Result};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Drafter for every request: ngram[:N], suffix[:OPTIONS],
    /// draft-model:KEY|PATH[,weights=FORMAT][,vocab=N], dflash:DIR, eagle3:DIR, two of those
    /// joined by `+` (the second drafts where the first finds nothing), `auto` (prompt
    /// lookup, with the repository's DFlash drafter for the model behind it where there is
    /// one), or `none` (default `suffix`). The draft length adapts per request and to the load
    /// (down to none when the batch is compute-bound); a request can opt out with
    /// "speculate": false.
    #[arg(long)]
    drafter: Option<String>,
    /// vLLM's speculative decoding settings as JSON, instead of --drafter and --draft-max:
    /// `method` (ngram, draft_model, eagle3, dflash, suffix), `model` (the drafter's key or
    /// directory), `num_speculative_tokens` (the longest draft), and the method's options
    /// (`prompt_lookup_max`, `suffix_decoding_*`).
    #[arg(long, value_name = "JSON", conflicts_with = "drafter")]
    speculative_config: Option<String>,
    /// The name clients use for the model, reported by /v1/models (llama.cpp's `--alias`,
    /// vLLM's `--served-model-name`); several, comma-separated: the first is reported, all are
    /// accepted. Default: the model key or file name.
    #[arg(long = "alias", visible_alias = "served-model-name", value_name = "NAME", value_delimiter = ',', num_args = 1..)]
    alias: Vec<String>,
    /// Address to listen on (loopback by default; anything else exposes the server).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Chat template variables for every request, as a JSON object, e.g.
    /// '{"enable_thinking": false}' (Qwen3 without thinking; a request's own
    /// `chat_template_kwargs` override these key by key).
    #[arg(long)]
    chat_template_kwargs: Option<String>,
    /// A Jinja chat template file to use instead of the model's (as llama.cpp's and vLLM's
    /// `--chat-template`), e.g. one that offers tools.
    #[arg(long)]
    chat_template: Option<std::path::PathBuf>,
    /// Requests allowed to wait for a slot; more get 503.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Sequences decoding together at most (llama.cpp's `-np`/`--parallel`, vLLM's
    /// `--max-num-seqs`).
    #[arg(long, visible_aliases = ["parallel", "max-num-seqs"], default_value_t = 32,
          value_parser = super::positive_count_arg)]
    max_running: usize,
    /// Tokens per batched forward (decode rows, draft rows and prefill chunks together).
    #[arg(long, default_value_t = 256)]
    step_tokens: usize,
    /// Draft length per sequence and step: `auto` (where it pays, weighed against the rest of
    /// the batch) or a fixed number of tokens.
    #[arg(long, default_value = "auto")]
    draft_len: String,
    /// Longest draft per sequence and step (llama.cpp's `--draft-max`; default 15).
    #[arg(long = "draft-max", visible_alias = "draft", alias = "max-draft",
          value_parser = super::draft_max_arg)]
    draft_max: Option<usize>,
    /// Draft trees, for drafters that can draft them (DFlash): `auto` (as many nodes as pay,
    /// chosen each step with the draft length), `off` (chains), or the most nodes per step.
    /// Trees verify several candidates per position in one forward; output is unchanged.
    #[arg(long, default_value = "auto", value_parser = parse_draft_tree)]
    draft_tree: DraftTree,
    /// Do not reuse the K/V of prompt prefixes shared between requests (prefix caching is
    /// on by default; outputs are the same either way).
    #[arg(long)]
    no_prefix_cache: bool,
    /// Require `Authorization: Bearer KEY` on the API routes (/v1, /tokenize, /detokenize).
    #[arg(long)]
    api_key: Option<String>,
    /// Request bodies larger than this get 413.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// On SIGTERM / Ctrl-C, seconds in-flight requests get to finish (a second Ctrl-C exits at once).
    #[arg(long, default_value_t = 30)]
    shutdown_grace_secs: u64,
    /// Memory of the suffix drafter's cache of recent requests, in MiB; the oldest requests
    /// are evicted whole to stay within it.
    #[arg(long, default_value_t = DEFAULT_CACHE_MB)]
    suffix_cache_mb: usize,
    /// Whose earlier requests the suffix drafter drafts from: `global` (everyone's), `api-key`
    /// (the same `Authorization: Bearer` key's; requests without a key share one scope) or
    /// `request` (its own text only). Outputs are the same either way; latency can tell one
    /// caller how well another's text predicted theirs.
    #[arg(long, default_value = "api-key", value_parser = SuffixScope::parse)]
    suffix_scope: SuffixScope,
    /// Keep the suffix drafter's cache in this file: read at start (a damaged or foreign file
    /// is reported and the server starts with an empty cache), written atomically at shutdown.
    /// Without it nothing is written to disk.
    #[arg(long)]
    suffix_cache_file: Option<std::path::PathBuf>,
    /// Publish KV-cache events (prefix blocks stored and evicted) as vLLM does, for
    /// prefix-aware routers: a ZeroMQ endpoint such as `tcp://*:5557` (bound; a host without
    /// a wildcard is connected to). Off by default. See docs/server.md.
    #[arg(long, value_name = "ENDPOINT")]
    kv_events: Option<String>,
    /// vLLM's KV-cache events settings as JSON, instead of --kv-events:
    /// `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": ""}`.
    #[arg(long, value_name = "JSON", conflicts_with = "kv_events")]
    kv_events_config: Option<String>,
    /// Measure the step-cost curve (what verifying m tokens costs, for the draft lengths) again
    /// instead of reading it from the cache (`step-cost/` in the cache directory), and replace
    /// the cached one.
    #[arg(long)]
    remeasure_step_cost: bool,
}

/// The drafter to serve with when neither --drafter nor --speculative-config names one.
const DEFAULT_DRAFTER: &str = "suffix";

pub fn run(args: ServeArgs) -> Result<()> {
    let (drafter_arg, draft_max) = match &args.speculative_config {
        Some(json) => {
            let config = SpeculativeConfig::parse(json)?;
            if let (Some(flag), Some(json)) = (args.draft_max, config.draft_max) {
                if flag != json {
                    bail!("--draft-max {flag} and num_speculative_tokens {json} in --speculative-config disagree");
                }
            }
            (config.drafter, args.draft_max.or(config.draft_max))
        }
        None => (args.drafter.clone().unwrap_or_else(|| DEFAULT_DRAFTER.to_string()), args.draft_max),
    };
    let drafter = match drafter_arg.as_str() {
        "none" => None,
        spec => Some(DrafterSpec::parse_for_model(spec, args.model.name()).context("--drafter")?),
    };
    // Listen first: while the model loads, /health answers (alive) and /ready says 503, so a
    // supervisor can tell a loading replica from a dead one.
    let addr = SocketAddr::new(args.host, args.port);
    let listener = std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    let loading_listener = listener.try_clone()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let provisional_id = args.alias.first().cloned().unwrap_or_else(|| args.model.name().to_string());
    let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel::<()>();
    let loading = rt.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(loading_listener)?;
        serve_while_loading(listener, provisional_id, async move {
            let _ = loaded_rx.await;
        })
        .await
    });
    eprintln!("specula: loading {} (/health and /ready answer on {local} meanwhile)", args.model.name());
    let started = start_engine(&args, drafter, draft_max);
    let _ = loaded_tx.send(());
    rt.block_on(loading).context("the loading server stopped")??;
    let (engine, state, model_id, suffix_identity) = started?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        if !args.host.is_loopback() {
            eprintln!("warning: listening on {local}, reachable from other machines{}", if args.api_key.is_none() { " without an API key" } else { "" });
        }
        eprintln!(
            "specula: serving {model_id} on http://{local} (playground: /, API: /v1, metrics: /metrics; context {} tokens, drafter {})",
            engine.context_limit(),
            engine.config().drafter.as_ref().map_or("none".to_string(), |d| d.label()),
        );
        if let Some(cost) = engine.step_cost() {
            let points: Vec<String> = cost.points().iter().map(|(r, t)| format!("{r}: {:.1}", t * 1e3)).collect();
            eprintln!("specula: step cost (rows: ms) {}", points.join(", "));
        }
        serve(listener, state, shutdown_signal()).await
    })?;
    engine.shutdown();
    if let (Some(path), Some(cache)) = (&args.suffix_cache_file, engine.suffix_cache()) {
        match cache.save(path, &suffix_identity) {
            Ok(()) => eprintln!("specula: suffix cache written to {}", path.display()),
            Err(e) => eprintln!("specula: error: the suffix cache was not written: {e:#}"),
        }
    }
    eprintln!("specula: stopped");
    Ok(())
}

/// Loads the model and drafter and starts the engine (measuring its step cost where a drafter
/// needs it): everything `/ready` waits for. Returns the engine, the server's state, the
/// model's id and the suffix cache's identity.
fn start_engine(
    args: &ServeArgs,
    drafter: Option<DrafterSpec>,
    draft_max: Option<usize>,
) -> Result<(Arc<Engine>, Arc<AppState>, String, String)> {
    let kv_dtype = crate::kv::KvDtype::parse(&args.model.kv_type).map_err(anyhow::Error::msg)?;
    let loaded = Arc::new(args.model.load()?);
    let (model_id, aliases) = model_names(args.model.name(), &loaded.path, &args.alias);
    let config = EngineConfig {
        kv_tokens: args.model.kv_tokens,
        kv_dtype,
        step_tokens: args.step_tokens,
        max_running: args.max_running,
        max_waiting: args.max_queue,
        drafter,
        draft_len: parse_draft_len(&args.draft_len)?,
        max_draft: draft_max.unwrap_or(MAX_DRAFT),
        draft_tree: args.draft_tree,
        step_cost: None,
        step_cost_dir: Some(crate::speculative::step_cost_cache::default_dir()),
        remeasure_step_cost: args.remeasure_step_cost,
        prefix_caching: !args.no_prefix_cache,
        trace: false,
        suffix_cache: None,
        max_model_len: args.model.max_model_len(),
        kv_events: crate::server::kv_events::start_kv_event_publisher(
            args.kv_events.as_deref(),
            args.kv_events_config.as_deref(),
        )?,
    };
    let suffix_identity = format!("{}:{}", model_id, loaded.tokenizer.vocab_size());
    let mut config = config;
    if config.drafter.as_ref().is_some_and(DrafterSpec::uses_suffix) {
        let suffix_config = SuffixCacheConfig {
            max_bytes: args.suffix_cache_mb.saturating_mul(1 << 20),
            scope: args.suffix_scope,
            ..Default::default()
        };
        let cache = match &args.suffix_cache_file {
            Some(path) if path.exists() => {
                match SuffixCache::load(suffix_config.clone(), path, &suffix_identity, loaded.tokenizer.vocab_size()) {
                    Ok(cache) => {
                        eprintln!(
                            "specula: suffix cache: {} requests from {}",
                            cache.read().sequences(),
                            path.display()
                        );
                        cache
                    }
                    Err(e) => {
                        eprintln!("specula: error: {e:#}; starting with an empty suffix cache");
                        SuffixCache::new(suffix_config)
                    }
                }
            }
            _ => SuffixCache::new(suffix_config),
        };
        config.suffix_cache = Some(Arc::new(cache));
    }
    let engine = Arc::new(Engine::start(loaded, config)?);
    let server_config = ServerConfig {
        model_id: model_id.clone(),
        model_aliases: aliases,
        api_key: args.api_key.clone(),
        max_body_bytes: args.max_body_bytes,
        shutdown_grace: Duration::from_secs(args.shutdown_grace_secs),
        chat_template_kwargs: match &args.chat_template_kwargs {
            Some(text) => crate::tokenize::parse_template_kwargs(text)?,
            None => Default::default(),
        },
        chat_template: match &args.chat_template {
            Some(path) => {
                let source = std::fs::read_to_string(path)
                    .with_context(|| format!("reading the chat template {}", path.display()))?;
                Some(Arc::new(engine.model().template_from_source(&source)?))
            }
            None => None,
        },
    };
    let state = AppState::new(engine.clone(), server_config);
    Ok((engine, state, model_id, suffix_identity))
}

/// The id clients name the model by (the first `--alias`, else the registry key, else the file
/// name without extension), and the other names accepted for it.
fn model_names(arg: &str, path: &Path, served_names: &[String]) -> (String, Vec<String>) {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| arg.to_string());
    let default_id = if crate::fetch::find_asset(arg).is_some() { arg.to_string() } else { stem.clone() };
    let mut names: Vec<String> = served_names.iter().map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect();
    names.extend([default_id, stem, arg.to_string(), path.display().to_string()]);
    if let Some(name) = path.file_name() {
        names.push(name.to_string_lossy().into_owned());
    }
    let id = names.remove(0);
    let mut aliases = Vec::new();
    for name in names {
        if name != id && !aliases.contains(&name) {
            aliases.push(name);
        }
    }
    (id, aliases)
}

/// Resolves on the first SIGTERM or Ctrl-C; a second Ctrl-C exits at once.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("specula: shutting down; in-flight requests may finish (Ctrl-C again to exit now)");
    tokio::spawn(async {
        let _ = tokio::signal::ctrl_c().await;
        eprintln!("specula: exiting");
        std::process::exit(130);
    });
}
