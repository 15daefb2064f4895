//! HTTP handlers: body limits, auth, request → engine → JSON or SSE.

use super::api_error::ApiError;
use super::openai_types::{
    chat_logprobs, parse_detokenize_request, parse_request, parse_tokenize_request, unix_now, Choice,
    CompletionLogprobs, CompletionRequest, Endpoint, PromptInput, ResponseMeta, TokenizeInput, TokenizeRequest,
    ToolChoice,
};
use super::tool_calls;
use super::AppState;
use crate::engine::{EngineEvent, EngineRequest, SubmitError, TokenLogprob, Usage};
use crate::tokenize::ChatTemplate;
use crate::tokenize::Tokenizer;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::StreamExt;

const PLAYGROUND: &str = include_str!("playground.html");

/// Completion tokens when a legacy completion request gives no `max_tokens` (OpenAI's default).
const COMPLETION_DEFAULT_MAX_TOKENS: usize = 16;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/", get(playground))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

fn json_response(status: StatusCode, body: &serde_json::Value) -> Response {
    let mut resp = (status, body.to_string()).into_response();
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

async fn playground() -> Html<&'static str> {
    Html(PLAYGROUND)
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let s = state.engine.snapshot();
    let shutting_down = state.shutting_down.load(Ordering::SeqCst);
    // A bug that ended the engine thread leaves a server that refuses everything: say so, so
    // that a supervisor restarts it.
    let engine_stopped = !state.engine.is_running();
    // Liveness: a draining server is alive (`/ready` is what turns it away); a stopped engine
    // is not.
    let status = match (engine_stopped, shutting_down) {
        (true, _) => "engine_stopped",
        (false, true) => "draining",
        (false, false) => "ok",
    };
    let mut body = json!({
        "status": status,
        "model": state.config.model_id,
        "drafter": state.engine.config().drafter.as_ref().map(|d| d.label()),
        "context_length": state.engine.context_limit(),
        "step_cost_ms": state.engine.step_cost().map(|c| c.points().iter().map(|&(r, t)| json!([r, t * 1e3])).collect::<Vec<_>>()),
        "waiting": s.waiting,
        "running": s.running,
        "kv": {
            "total_blocks": s.kv_total_blocks,
            "free_blocks": s.kv_free_blocks,
            "used_blocks": s.kv_total_blocks - s.kv_free_blocks,
            "block_size": s.kv_block_size,
        },
    });
    if let Some(cache) = state.engine.suffix_cache() {
        body["suffix_cache"] = json!({
            "bytes": s.suffix_cache_bytes,
            "max_bytes": cache.config().max_bytes,
            "requests": s.suffix_cache_sequences,
            "evicted_requests": s.suffix_cache_evicted,
        });
    }
    json_response(if status == "engine_stopped" { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK }, &body)
}

/// Readiness, for load balancers and Kubernetes: 200 while requests are admitted, 503 while
/// draining after a shutdown signal or when the engine has stopped. (`/health` is liveness.)
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let status = if state.shutting_down.load(Ordering::SeqCst) {
        "draining"
    } else if !state.engine.is_running() {
        "engine_stopped"
    } else {
        "ready"
    };
    let code = if status == "ready" { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    json_response(code, &json!({"status": status, "model": state.config.model_id}))
}

/// The routes answered while the model loads (see `serve_while_loading`).
pub fn loading_router(model_id: String) -> Router {
    let health_id = model_id.clone();
    let ready_id = model_id;
    Router::new()
        .route(
            "/health",
            get(
                move || async move { json_response(StatusCode::OK, &json!({"status": "loading", "model": health_id})) },
            ),
        )
        .route(
            "/ready",
            get(move || async move {
                json_response(StatusCode::SERVICE_UNAVAILABLE, &json!({"status": "loading", "model": ready_id}))
            }),
        )
        .fallback(|| async { ApiError::loading().into_response() })
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = state.metrics.render(&state.engine.snapshot(), &state.config.model_id);
    let mut resp = text.into_response();
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    resp
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&state, &headers) {
        return e.into_response();
    }
    let body = json!({
        "object": "list",
        "data": [{
            "id": state.config.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "specula",
            "context_length": state.engine.context_limit(),
            "max_model_len": state.engine.context_limit(),
            "drafter": state.engine.config().drafter.as_ref().map(|d| d.label()),
        }],
    });
    json_response(StatusCode::OK, &body)
}

async fn chat_completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    handle(state, Endpoint::Chat, headers, body).await
}

async fn completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    handle(state, Endpoint::Completion, headers, body).await
}

async fn tokenize(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        let body = checked_body(&state, &headers, body).await?;
        let req = parse_tokenize_request(&body)?;
        check_model(&state, req.model.as_deref())?;
        let st = state.clone();
        // A long text or chat is tokenized off the async workers, as for completions.
        tokio::task::spawn_blocking(move || tokenize_body(&st, &req))
            .await
            .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?
    }
    .await;
    finish_simple(&state, "tokenize", result)
}

/// vLLM's `/tokenize` answer (`count`, `max_model_len`, `tokens`, `token_strs`); with
/// llama-server's `with_pieces`, `tokens` holds `{id, piece}` objects as llama-server's does.
fn tokenize_body(state: &AppState, req: &TokenizeRequest) -> Result<Value, ApiError> {
    let tokenizer = &state.engine.model().tokenizer;
    let ids = match &req.input {
        TokenizeInput::Text { text, add_special } => {
            tokenizer.encode(text, *add_special).map_err(|e| ApiError::invalid("prompt", format!("{e:#}")))?
        }
        TokenizeInput::Chat { request, add_generation_prompt } => {
            let prompt = request.prompts.first().ok_or_else(|| ApiError::invalid("messages", "no messages"))?;
            prompt_ids(state, request, prompt, *add_generation_prompt)?
        }
    };
    let tokens = if req.with_pieces {
        ids.iter()
            .map(|&id| json!({"id": id, "piece": String::from_utf8_lossy(tokenizer.piece(id, false))}))
            .collect::<Vec<_>>()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    let token_strs = req.token_strs.then(|| ids.iter().map(|&id| tokenizer.token_text(id)).collect::<Vec<_>>());
    Ok(json!({
        "count": ids.len(),
        "max_model_len": state.engine.context_limit(),
        "tokens": tokens,
        "token_strs": token_strs,
    }))
}

async fn detokenize(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        let body = checked_body(&state, &headers, body).await?;
        let tokenizer = &state.engine.model().tokenizer;
        let req = parse_detokenize_request(&body, tokenizer.vocab_size())?;
        check_model(&state, req.model.as_deref())?;
        let text = tokenizer.decode(&req.tokens, false);
        // vLLM answers `prompt`, llama-server `content`: both, so either client reads it.
        Ok(json!({"prompt": text, "content": text}))
    }
    .await;
    finish_simple(&state, "detokenize", result)
}

/// The body of an authorised request while the server still admits requests.
async fn checked_body(state: &AppState, headers: &HeaderMap, body: Body) -> Result<Vec<u8>, ApiError> {
    authorize(state, headers)?;
    if state.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::shutting_down());
    }
    read_body(body, headers, state.config.max_body_bytes).await
}

/// 404 for a model this server does not serve under that name.
fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.config.model_id && !state.config.model_aliases.iter().any(|a| a == m) => {
            Err(ApiError::model_not_found(m))
        }
        _ => Ok(()),
    }
}

/// A JSON answer or its error, counted in the request metrics under `endpoint`.
fn finish_simple(state: &AppState, endpoint: &'static str, result: Result<Value, ApiError>) -> Response {
    match result {
        Ok(body) => {
            state.metrics.request(endpoint, 200);
            json_response(StatusCode::OK, &body)
        }
        Err(e) => {
            state.metrics.request(endpoint, e.status.as_u16());
            e.into_response()
        }
    }
}

async fn handle(state: Arc<AppState>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let arrived = Instant::now();
    match start(&state, endpoint, &headers, body, arrived).await {
        Ok(resp) => {
            state.metrics.request(endpoint.label(), resp.status().as_u16());
            resp
        }
        Err(e) => {
            state.metrics.request(endpoint.label(), e.status.as_u16());
            tracing::warn!(
                target: "specula::request",
                endpoint = endpoint.label(),
                status = e.status.as_u16(),
                param = e.param.as_deref().unwrap_or(""),
                latency_ms = arrived.elapsed().as_secs_f64() * 1e3,
                "{}",
                e.message
            );
            e.into_response()
        }
    }
}

/// The key of `Authorization: Bearer KEY`, if sent.
fn bearer_key(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
}

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = state.config.api_key.as_deref() else { return Ok(()) };
    let given = bearer_key(headers);
    // Compare without an early exit, so timing does not tell how much of a guess was right.
    let ok = given.is_some_and(|g| {
        g.len() == key.len() && g.bytes().zip(key.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    });
    if ok {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

/// Reads the body, refusing it once it passes the limit (whatever Content-Length claims). An
/// oversized body is still read (and dropped) up to a few times the limit before the 413 goes
/// out: a client blocked sending its body would otherwise see a broken connection, not the error.
async fn read_body(body: Body, headers: &HeaderMap, limit: usize) -> Result<Vec<u8>, ApiError> {
    let drain_cap = limit.saturating_mul(8).max(8 << 20);
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let mut stream = body.into_data_stream();
    if declared.is_some_and(|n| n > limit as u64) {
        if declared.is_some_and(|n| n <= drain_cap as u64) {
            while let Some(Ok(_)) = stream.next().await {}
        }
        return Err(ApiError::body_too_large(limit));
    }
    let mut out = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("could not read the request body: {e}")))?;
        seen += chunk.len();
        if seen > drain_cap {
            break;
        }
        if seen <= limit {
            out.extend_from_slice(&chunk);
        }
    }
    if seen > limit {
        return Err(ApiError::body_too_large(limit));
    }
    Ok(out)
}

/// Validates a request, queues it, and answers (the stream starts once it is queued).
async fn start(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
    arrived: Instant,
) -> Result<Response, ApiError> {
    let body = checked_body(state, headers, body).await?;
    let req = parse_request(&body, endpoint)?;
    check_model(state, req.model.as_deref())?;
    // Tokenizing (and rendering a chat template) can take a while for a long prompt: keep it
    // off the async workers. Every prompt is checked before any is queued.
    let st = state.clone();
    let (prepared, req) = tokio::task::spawn_blocking(move || {
        let prepared = req.prompts.iter().map(|p| prepare(&st, &req, p)).collect::<Result<Vec<_>, ApiError>>();
        prepared.map(|r| (r, req))
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))??;
    let echo = if req.echo {
        req.prompts.iter().zip(&prepared).map(|(p, r)| echo_prompt(state, p, &r.prompt)).collect()
    } else {
        Vec::new()
    };
    let mut receivers = Vec::with_capacity(prepared.len() * req.n);
    // The caller's key scopes what the suffix drafter shares between requests (even where
    // the server checks no key, a router may send each user's own).
    let api_key = bearer_key(headers).map(str::to_string);
    for (p, engine_req) in prepared.iter().enumerate() {
        for i in 0..req.n {
            let mut choice = engine_req.clone();
            choice.api_key = api_key.clone();
            // Each choice samples on its own; with a seed, choice c is reproducible as seed + c.
            choice.params.seed = engine_req.params.seed.map(|s| s.wrapping_add((p * req.n + i) as u64));
            // A prompt's log-probs are the same for every choice of it: the first computes
            // them, the others reuse its prompt blocks through the prefix cache. A stream
            // sends each choice's echo with its first event, which may come before the first
            // choice's, so there every choice computes them.
            if i > 0 && !req.stream {
                choice.prompt_logprobs = None;
            }
            // A refused choice drops the receivers of those already queued, which cancels them.
            receivers.push(state.engine.submit(choice).map_err(|e| match e {
                SubmitError::QueueFull(_) => ApiError::overloaded(e.to_string()),
                SubmitError::Stopped => ApiError::shutting_down(),
            })?);
        }
    }
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let meta = ResponseMeta {
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-{id}"),
            Endpoint::Completion => format!("cmpl-{id}"),
        },
        created: unix_now(),
        model: state.config.model_id.clone(),
        endpoint,
    };
    let tools = !req.tools.is_empty() && req.tool_choice != ToolChoice::None;
    let shape = ResponseShape { meta, logprobs: req.logprobs.is_some(), echo, tools, n: req.n };
    if req.stream {
        Ok(stream_response(state.clone(), receivers, shape, req.include_usage, arrived))
    } else {
        collect_response(state, receivers, shape, arrived).await
    }
}

/// What a response holds besides the generated text.
struct ResponseShape {
    meta: ResponseMeta,
    /// Log-probs were asked for.
    logprobs: bool,
    /// Completions with `echo`: per prompt, its text and ids, which come before the output of
    /// each of its choices (empty without `echo`).
    echo: Vec<(String, Vec<u32>)>,
    /// Chat with `tools`: calls in the output become `tool_calls`.
    tools: bool,
    /// Choices per prompt: choice `c` answers prompt `c / n`.
    n: usize,
}

/// A prompt's text as echoed: the text given, or the ids decoded.
fn echo_prompt(state: &AppState, prompt: &PromptInput, ids: &[u32]) -> (String, Vec<u32>) {
    let text = match prompt {
        PromptInput::Text(t) => t.clone(),
        _ => state.engine.model().tokenizer.decode(ids, false),
    };
    (text, ids.to_vec())
}

/// One choice's log-probs as they are built, in its endpoint's format.
enum ChoiceLogprobs {
    Chat(Vec<TokenLogprob>),
    Completion(CompletionLogprobs),
}

impl ChoiceLogprobs {
    fn new(endpoint: Endpoint, offset: usize) -> Self {
        match endpoint {
            Endpoint::Chat => Self::Chat(Vec::new()),
            Endpoint::Completion => Self::Completion(CompletionLogprobs::starting_at(offset)),
        }
    }

    /// The echoed prompt: its first token (no log-prob) and the others'.
    fn push_prompt(&mut self, ids: &[u32], logprobs: &[TokenLogprob], tokenizer: &Tokenizer) {
        if let (Self::Completion(c), Some(&first)) = (self, ids.first()) {
            c.push_first(first, tokenizer);
            for l in logprobs {
                c.push(l, tokenizer);
            }
        }
    }

    fn push(&mut self, items: &[TokenLogprob], tokenizer: &Tokenizer) {
        match self {
            Self::Chat(v) => v.extend_from_slice(items),
            Self::Completion(c) => items.iter().for_each(|l| c.push(l, tokenizer)),
        }
    }

    fn to_json(&self, tokenizer: &Tokenizer) -> Value {
        match self {
            Self::Chat(v) => chat_logprobs(v, tokenizer),
            Self::Completion(c) => c.to_json(),
        }
    }

    /// The JSON of what was pushed since the last call, and a fresh start after it (streams
    /// send each chunk's tokens only).
    fn take_json(&mut self, tokenizer: &Tokenizer) -> Value {
        let json = self.to_json(tokenizer);
        let next = match self {
            Self::Chat(_) => Self::Chat(Vec::new()),
            Self::Completion(c) => Self::Completion(CompletionLogprobs::starting_at(c.offset())),
        };
        *self = next;
        json
    }
}

/// The one info line per finished request.
fn log_finished(
    meta: &ResponseMeta,
    status: u16,
    usage: &Usage,
    arrived: Instant,
    first_token: Option<Instant>,
    choices: usize,
) {
    tracing::info!(
        target: "specula::request",
        id = meta.id.as_str(),
        endpoint = meta.endpoint.label(),
        status,
        choices,
        prompt_tokens = usage.prompt_tokens,
        completion_tokens = usage.completion_tokens,
        cached_tokens = usage.cached_prompt_tokens,
        drafted = usage.draft_n,
        accepted = usage.draft_n_accepted,
        ttft_ms = first_token.map_or(0.0, |t| (t - arrived).as_secs_f64() * 1e3),
        latency_ms = arrived.elapsed().as_secs_f64() * 1e3,
        "finished"
    );
}

/// Usage of one prompt's choices: the prompt once, everything generated summed.
fn add_usage(total: &mut Option<Usage>, u: &Usage) {
    match total {
        None => *total = Some(*u),
        Some(t) => {
            t.completion_tokens += u.completion_tokens;
            t.draft_n += u.draft_n;
            t.draft_n_accepted += u.draft_n_accepted;
            t.verify_steps += u.verify_steps;
            t.preemptions += u.preemptions;
            t.cached_prompt_tokens = t.cached_prompt_tokens.max(u.cached_prompt_tokens);
        }
    }
}

/// Usage of a request: its prompts' usages summed.
fn request_usage(per_prompt: &[Option<Usage>]) -> Usage {
    let mut total = Usage::default();
    for u in per_prompt.iter().flatten() {
        total.prompt_tokens += u.prompt_tokens;
        total.cached_prompt_tokens += u.cached_prompt_tokens;
        total.completion_tokens += u.completion_tokens;
        total.draft_n += u.draft_n;
        total.draft_n_accepted += u.draft_n_accepted;
        total.verify_steps += u.verify_steps;
        total.preemptions += u.preemptions;
    }
    total
}

/// The server's chat template variables, overridden key by key by the request's.
fn template_kwargs(state: &AppState, req: &CompletionRequest) -> crate::tokenize::TemplateKwargs {
    let mut kwargs = state.config.chat_template_kwargs.clone();
    kwargs.extend(req.chat_template_kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
    kwargs
}

/// A conversation rendered with the server's chat template (`--chat-template`) or the model's,
/// then tokenized.
fn encode_chat(
    state: &AppState,
    render: impl FnOnce(&ChatTemplate) -> anyhow::Result<String>,
) -> Result<Vec<u32>, ApiError> {
    let loaded = state.engine.model();
    let template = state.config.chat_template.as_deref().or(loaded.template.as_ref()).ok_or_else(|| {
        ApiError::invalid("messages", "this model has no chat template; use /v1/completions or --chat-template")
    })?;
    let text = render(template).map_err(|e| ApiError::invalid("messages", format!("{e:#}")))?;
    loaded.tokenizer.encode(&text, true).map_err(|e| ApiError::invalid("messages", format!("{e:#}")))
}

/// A prompt's token ids, as the engine runs them: chats rendered with the template (and a
/// generation prompt after them, if asked), text with the model's special tokens.
fn prompt_ids(
    state: &AppState,
    req: &CompletionRequest,
    prompt: &PromptInput,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    let loaded = state.engine.model();
    Ok(match prompt {
        PromptInput::Chat(messages) => {
            let kwargs = template_kwargs(state, req);
            encode_chat(state, |t| t.render_with(messages, add_generation_prompt, &kwargs))?
        }
        PromptInput::ChatJson(messages) => {
            let kwargs = template_kwargs(state, req);
            let offered = !req.tools.is_empty() && req.tool_choice != ToolChoice::None;
            let tools = offered.then(|| Value::Array(req.tools.clone()));
            encode_chat(state, |t| t.render_json(messages, tools.as_ref(), add_generation_prompt, &kwargs))?
        }
        PromptInput::Text(text) => {
            loaded.encode_prompt(text).map_err(|e| ApiError::invalid("prompt", format!("{e:#}")))?
        }
        PromptInput::Ids(ids) => {
            let vocab = loaded.model.config.vocab;
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary ({vocab} tokens)"),
                ));
            }
            ids.clone()
        }
    })
}

/// Tokenizes the prompt and checks it and `max_tokens` against the context.
fn prepare(state: &AppState, req: &CompletionRequest, prompt: &PromptInput) -> Result<EngineRequest, ApiError> {
    let prompt = prompt_ids(state, req, prompt, true)?;
    let prompt_param = if req.endpoint == Endpoint::Chat { "messages" } else { "prompt" };
    if prompt.is_empty() {
        return Err(ApiError::invalid(prompt_param, "The prompt is empty"));
    }
    let limit = state.engine.context_limit();
    if prompt.len() >= limit {
        // vLLM's wording, which clients and routers already recognise.
        return Err(ApiError::context_exceeded(
            format!(
                "This model's maximum context length is {limit} tokens. However, your request has {} input tokens \
                 (no room for a completion). Please reduce the length of the input.",
                prompt.len()
            ),
            prompt_param,
        ));
    }
    let room = limit - prompt.len();
    let mut params = req.params.clone();
    params.max_tokens = match params.max_tokens {
        Some(m) if m > room => {
            return Err(ApiError::context_exceeded(
                format!(
                    "This model's maximum context length is {limit} tokens. However, you requested {} tokens ({} in the prompt, {m} for the completion)",
                    prompt.len() + m,
                    prompt.len()
                ),
                "max_tokens",
            ))
        }
        Some(m) => Some(m),
        None if req.endpoint == Endpoint::Completion => Some(COMPLETION_DEFAULT_MAX_TOKENS.min(room)),
        None => Some(room),
    };
    let prompt_logprobs = if req.echo { req.logprobs } else { None };
    let forced_call = match &req.tool_choice {
        ToolChoice::Required => Some(tool_calls::forced_call_grammar(&req.tools, None)),
        ToolChoice::Function(name) => Some(tool_calls::forced_call_grammar(&req.tools, Some(name))),
        ToolChoice::Auto | ToolChoice::None => None,
    };
    let grammar = match (forced_call, &req.grammar) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "a forced tool call cannot be combined with a response format",
            ))
        }
        (Some(call), None) => Some((call.map_err(|e| ApiError::invalid("tool_choice", e))?, "tool_choice")),
        (None, g) => g.clone(),
    };
    let constraint = match &grammar {
        None => None,
        Some((spec, param)) => {
            let compiler = state.grammars().map_err(|e| {
                ApiError::invalid(param, format!("structured outputs are not available for this model: {e}"))
            })?;
            Some(
                compiler
                    .compile(spec)
                    .map_err(|e| ApiError::invalid(param, format!("the grammar does not compile: {e:#}")))?,
            )
        }
    };
    Ok(EngineRequest {
        speculate: req.speculate,
        ignore_eos: req.ignore_eos,
        logprobs: req.logprobs,
        prompt_logprobs,
        constraint,
        ..EngineRequest::new(prompt, params)
    })
}

async fn collect_response(
    state: &Arc<AppState>,
    receivers: Vec<UnboundedReceiver<EngineEvent>>,
    shape: ResponseShape,
    arrived: Instant,
) -> Result<Response, ApiError> {
    let tokenizer = &state.engine.model().tokenizer;
    let mut choices = Vec::with_capacity(receivers.len());
    let prompts = receivers.len().div_ceil(shape.n.max(1));
    let mut usage: Vec<Option<Usage>> = vec![None; prompts];
    let mut prompt_logprobs: Vec<Option<Vec<TokenLogprob>>> = vec![None; prompts];
    let mut last: Option<Instant> = None;
    let mut first_token: Option<Instant> = None;
    // The choices run together in the engine; collecting them one after another waits no longer.
    for (c, mut rx) in receivers.into_iter().enumerate() {
        let p = c / shape.n.max(1);
        let mut text = String::new();
        let mut logprobs: Vec<TokenLogprob> = Vec::new();
        let finish = loop {
            match rx.recv().await {
                Some(EngineEvent::Tokens(chunk)) => {
                    observe_tokens(state, &mut last, arrived, chunk.ids.len());
                    first_token.get_or_insert_with(Instant::now);
                    text.push_str(&chunk.text());
                    logprobs.extend(chunk.logprobs.iter().cloned());
                    if !chunk.prompt_logprobs.is_empty() {
                        prompt_logprobs[p] = Some(chunk.prompt_logprobs);
                    }
                }
                Some(EngineEvent::Done(done)) => {
                    text.push_str(&done.tail);
                    if !done.prompt_logprobs.is_empty() {
                        prompt_logprobs[p] = Some(done.prompt_logprobs);
                    }
                    add_usage(&mut usage[p], &done.usage);
                    break done.finish;
                }
                Some(EngineEvent::Failed(message)) => return Err(failure(state, message)),
                None => return Err(failure(state, "the engine stopped".into())),
            }
        };
        choices.push((text, logprobs, finish));
    }
    let choices: Vec<Choice> = choices
        .into_iter()
        .enumerate()
        .map(|(c, (text, items, finish))| {
            let p = c / shape.n.max(1);
            let mut lp = ChoiceLogprobs::new(shape.meta.endpoint, 0);
            let text = match shape.echo.get(p) {
                Some((prompt_text, ids)) => {
                    lp.push_prompt(ids, prompt_logprobs[p].as_deref().unwrap_or(&[]), tokenizer);
                    format!("{prompt_text}{text}")
                }
                None => text,
            };
            lp.push(&items, tokenizer);
            let (text, calls) = if shape.tools { tool_calls::parse(&text) } else { (text, Vec::new()) };
            let tool_calls = tool_calls::to_json(&calls, &shape.meta.id, false);
            Choice { text, finish, logprobs: shape.logprobs.then(|| lp.to_json(tokenizer)), tool_calls }
        })
        .collect();
    let usage = request_usage(&usage);
    log_finished(&shape.meta, 200, &usage, arrived, first_token, choices.len());
    Ok(json_response(StatusCode::OK, &shape.meta.response(&choices, &usage)))
}

fn failure(state: &AppState, message: String) -> ApiError {
    if state.shutting_down.load(Ordering::SeqCst) {
        ApiError::shutting_down()
    } else {
        ApiError::internal(message)
    }
}

fn observe_tokens(state: &AppState, last: &mut Option<Instant>, arrived: Instant, n: usize) {
    let now = Instant::now();
    match *last {
        None => state.metrics.first_token(now - arrived),
        Some(prev) => state.metrics.tokens_after(now - prev, n),
    }
    state.metrics.delivered(n);
    *last = Some(now);
}

fn sse(value: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// An SSE response fed by a task that turns engine events into chunks. When the client goes
/// away hyper drops the body, the task sees its channel close and returns, and dropping the
/// engine receivers cancels the request's choices.
fn stream_response(
    state: Arc<AppState>,
    receivers: Vec<UnboundedReceiver<EngineEvent>>,
    shape: ResponseShape,
    include_usage: bool,
    arrived: Instant,
) -> Response {
    let (tx, body_rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let meta = &shape.meta;
        let tokenizer = &state.engine.model().tokenizer;
        let n = receivers.len();
        // One stream of (choice, event) from all choices.
        let mut events = tokio_stream::StreamMap::new();
        for (i, rx) in receivers.into_iter().enumerate() {
            events.insert(i, tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
        }
        let mut last: Option<Instant> = None;
        let mut first_token: Option<Instant> = None;
        let mut logprobs: Vec<ChoiceLogprobs> = (0..n).map(|_| ChoiceLogprobs::new(meta.endpoint, 0)).collect();
        let mut started = vec![false; n];
        // With tools: each choice's text so far and how much of it went out as content.
        let mut texts: Vec<(String, usize)> = vec![(String::new(), 0); n];
        let mut usage: Vec<Option<Usage>> = vec![None; n.div_ceil(shape.n.max(1))];
        let mut finished = 0;
        if meta.endpoint == Endpoint::Chat {
            for i in 0..n {
                if tx.send(sse(&meta.chunk(i, "", None, None, None, true))).await.is_err() {
                    return;
                }
            }
        }
        loop {
            let event = tokio::select! {
                _ = tx.closed() => return,
                event = events.next() => event,
            };
            let mut out: Vec<Bytes> = Vec::new();
            // A choice's first event: the echoed prompt goes out before its output.
            if let Some((i, ev)) = &event {
                if !std::mem::replace(&mut started[*i], true) {
                    if let Some((prompt_text, ids)) = shape.echo.get(*i / shape.n.max(1)) {
                        let prompt_lps = match ev {
                            EngineEvent::Tokens(c) => c.prompt_logprobs.as_slice(),
                            EngineEvent::Done(d) => d.prompt_logprobs.as_slice(),
                            EngineEvent::Failed(_) => &[],
                        };
                        logprobs[*i].push_prompt(ids, prompt_lps, tokenizer);
                        let lp = shape.logprobs.then(|| logprobs[*i].take_json(tokenizer));
                        out.push(sse(&meta.chunk(*i, prompt_text, None, lp, None, false)));
                    }
                }
            }
            match event {
                Some((i, EngineEvent::Tokens(chunk))) => {
                    observe_tokens(&state, &mut last, arrived, chunk.ids.len());
                    first_token.get_or_insert_with(Instant::now);
                    logprobs[i].push(&chunk.logprobs, tokenizer);
                    let lp = shape.logprobs.then(|| logprobs[i].take_json(tokenizer));
                    let text = if shape.tools {
                        // Text that may start a tool call waits for the end.
                        let (all, shown) = &mut texts[i];
                        all.push_str(&chunk.text());
                        let safe = tool_calls::shown_len(all);
                        let delta = all[*shown..safe.max(*shown)].to_string();
                        *shown = safe.max(*shown);
                        delta
                    } else {
                        chunk.text()
                    };
                    out.push(sse(&meta.chunk(i, &text, Some(&chunk), lp, None, false)));
                }
                Some((i, EngineEvent::Done(done))) => {
                    let mut calls = Vec::new();
                    let tail = if shape.tools {
                        let (all, shown) = &mut texts[i];
                        all.push_str(&done.tail);
                        let (content, parsed) = tool_calls::parse(all);
                        calls = parsed;
                        let end = if calls.is_empty() { all.len() } else { content.len() };
                        all.get(*shown..end.max(*shown)).unwrap_or_default().to_string()
                    } else {
                        done.tail.clone()
                    };
                    if !tail.is_empty() {
                        out.push(sse(&meta.chunk(i, &tail, None, None, None, false)));
                    }
                    if calls.is_empty() {
                        out.push(sse(&meta.chunk(i, "", None, None, Some(done.finish), false)));
                    } else {
                        let id = format!("{}_{i}", meta.id);
                        out.push(sse(&meta.tool_calls_chunk(i, tool_calls::to_json(&calls, &id, true))));
                    }
                    add_usage(&mut usage[i / shape.n.max(1)], &done.usage);
                    finished += 1;
                    if finished == n {
                        let usage = request_usage(&usage);
                        log_finished(meta, 200, &usage, arrived, first_token, n);
                        if include_usage {
                            out.push(sse(&meta.usage_chunk(&usage)));
                        }
                        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                    }
                }
                Some((_, EngineEvent::Failed(message))) => {
                    tracing::warn!(target: "specula::request", id = meta.id.as_str(), "failed mid-stream: {message}");
                    out.push(sse(&failure(&state, message).body()));
                    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                }
                None => {
                    out.push(sse(&failure(&state, "the engine stopped".into()).body()));
                    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                }
            }
            let end = out.last().is_some_and(|b| b.as_ref() == b"data: [DONE]\n\n");
            for bytes in out {
                if tx.send(bytes).await.is_err() {
                    return;
                }
            }
            if end {
                return;
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(body_rx).map(Ok::<Bytes, Infallible>);
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}
