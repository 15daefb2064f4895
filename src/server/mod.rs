//! OpenAI-compatible HTTP server over the batching engine.
//!
//! - `POST /v1/chat/completions`, `POST /v1/completions`: streamed (SSE) or not; every
//!   streamed chunk that carries tokens also carries a `specula` extension object:
//!   `{"token_ids": [...], "pieces": [...], "sources": ["draft" | "target", ...]}` — per token
//!   its id, the text it released (the pieces concatenate to the chunk's content) and whether
//!   it was an accepted draft token or sampled from the target. `usage` carries `draft_n` and
//!   `draft_n_accepted`.
//! - `GET /v1/models`, `GET /health` (engine and KV pool state as JSON), `GET /metrics`
//!   (Prometheus), `GET /` (the playground page).
//!
//! A client that goes away cancels its request: the response body (or the handler future)
//! is dropped, which drops the engine's event receiver; the engine frees the request's KV
//! blocks at the next step boundary.

mod api_error;
pub mod http_client;
pub mod loadtest;
mod metrics;
mod openai_types;
mod routes;
mod tool_calls;

pub use api_error::ApiError;
pub use metrics::{Histogram, ServerMetrics};
pub use openai_types::{parse_request, CompletionRequest, Endpoint, PromptInput};

use crate::engine::Engine;
use anyhow::{Context, Result};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

/// Settings of the HTTP layer.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The id `/v1/models` lists and requests name.
    pub model_id: String,
    /// Other names accepted for the model (file name, path).
    pub model_aliases: Vec<String>,
    /// Require `Authorization: Bearer KEY` on the API routes.
    pub api_key: Option<String>,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// After a shutdown signal, in-flight requests get this long to finish before they are
    /// ended with an error event.
    pub shutdown_grace: Duration,
    /// Chat template variables for every request (`--chat-template-kwargs`); a request's own
    /// `chat_template_kwargs` override them key by key.
    pub chat_template_kwargs: crate::tokenize::TemplateKwargs,
    /// A chat template to use instead of the model's (`--chat-template`), e.g. one with tools.
    pub chat_template: Option<Arc<crate::tokenize::ChatTemplate>>,
}

impl ServerConfig {
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_id: model_id.into(),
            model_aliases: Vec::new(),
            api_key: None,
            max_body_bytes: 1 << 20,
            shutdown_grace: Duration::from_secs(30),
            chat_template_kwargs: Default::default(),
            chat_template: None,
        }
    }
}

/// Shared by all handlers.
pub struct AppState {
    pub engine: Arc<Engine>,
    pub config: ServerConfig,
    pub metrics: ServerMetrics,
    pub shutting_down: AtomicBool,
    next_id: AtomicU64,
    created: u64,
    /// Structured outputs' grammar compiler for the model's vocabulary, built on first use.
    grammars: std::sync::OnceLock<Result<crate::grammar::GrammarCompiler, String>>,
}

impl AppState {
    pub fn new(engine: Arc<Engine>, config: ServerConfig) -> Arc<Self> {
        Arc::new(Self {
            engine,
            config,
            metrics: ServerMetrics::default(),
            shutting_down: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            created: openai_types::unix_now(),
            grammars: std::sync::OnceLock::new(),
        })
    }

    /// The grammar compiler (built on the first structured request: the vocabulary's trie).
    pub fn grammars(&self) -> Result<&crate::grammar::GrammarCompiler, String> {
        self.grammars
            .get_or_init(|| {
                let loaded = self.engine.model();
                crate::grammar::GrammarCompiler::new(&loaded.tokenizer, &loaded.stop_ids(), loaded.model.config.vocab)
                    .map_err(|e| format!("{e:#}"))
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// Serves on `listener` until `shutdown` resolves. Then it drains: `/ready` answers 503 and new
/// requests get 503 at once, while the listener stays open and admitted requests run on; once
/// none is left (or the grace period ends, and the rest are ended with an error event), it
/// stops accepting connections, waits for the open ones, and returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let app = routes::router(state.clone());
    let st = state.clone();
    let signal = async move {
        shutdown.await;
        st.shutting_down.store(true, std::sync::atomic::Ordering::SeqCst);
        let grace = st.config.shutdown_grace;
        let deadline = tokio::time::Instant::now() + grace;
        // Idle twice in a row: a request admitted just now shows in the engine's next snapshot.
        let mut idle_polls = 0;
        while tokio::time::Instant::now() < deadline && idle_polls < 2 {
            idle_polls = if st.engine.is_idle() { idle_polls + 1 } else { 0 };
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        if !st.engine.is_idle() {
            st.engine.abort_all("the server is shutting down");
        }
    };
    axum::serve(listener, app).with_graceful_shutdown(signal).await.context("HTTP server failed")?;
    Ok(())
}

/// While the model loads: `/health` answers 200 (`"status": "loading"`), `/ready` and every
/// other route 503 with `Retry-After`, until `loaded` resolves. Then it returns and the listener
/// can serve [`serve`]'s routes.
pub async fn serve_while_loading(
    listener: tokio::net::TcpListener,
    model_id: String,
    loaded: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    axum::serve(listener, routes::loading_router(model_id))
        .with_graceful_shutdown(loaded)
        .await
        .context("HTTP server failed")?;
    Ok(())
}

/// A server running on its own thread (and tokio runtime); stops when dropped.
pub struct ServerHandle {
    addr: SocketAddr,
    state: Arc<AppState>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl ServerHandle {
    /// Binds `addr` (port 0 = any free port) and starts serving.
    pub fn spawn(engine: Arc<Engine>, config: ServerConfig, addr: SocketAddr) -> Result<Self> {
        let listener = std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let state = AppState::new(engine, config);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let st = state.clone();
        let thread = std::thread::Builder::new().name("specula-http".into()).spawn(move || -> Result<()> {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                serve(listener, st, async move {
                    let _ = rx.await;
                })
                .await
            })
        })?;
        Ok(Self { addr, state, shutdown: Some(tx), thread: Some(thread) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Signals shutdown and waits for the server to finish.
    pub fn stop(mut self) -> Result<()> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| anyhow::anyhow!("the server thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}
