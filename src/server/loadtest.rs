//! Load generator: N concurrent streaming clients against any OpenAI-compatible server on
//! this machine (specula, llama.cpp's, vLLM's), for a bounded number of requests and time.
//! Reports what vLLM's serving benchmark reports, under its names: request and output-token
//! throughput, TTFT, TPOT (time per output token after the first, per request) and ITL
//! (inter-token latency), mean, median and p99; plus errors and, from specula, drafted and
//! accepted tokens.
//!
//! Tokens per chunk: specula's `specula.token_ids` extension when present (a chunk brings
//! several tokens at once when a draft is accepted, and the gap since the previous chunk is
//! shared among them, as the server's `/metrics` histogram does); otherwise each chunk with
//! text counts as one token, as vLLM's benchmark counts them.

use super::http_client::{loopback_addr, send};
use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Prompts the clients cycle through: a mix of open questions and tasks that repeat text
/// (where prompt-lookup drafting shines).
pub const DEFAULT_PROMPTS: &[&str] = &[
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works, step by step, for a beginner programmer.",
    "List ten fruits, one per line, each with its colour.",
    "Repeat the following sentence five times: The quick brown fox jumps over the lazy dog.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "What are the main differences between TCP and UDP?",
    "Describe the water cycle in simple terms.",
    "Translate to French: Good morning, how are you today? I am fine, thank you.",
];

#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// `http://127.0.0.1:PORT` (loopback only).
    pub url: String,
    pub clients: usize,
    /// Requests in total (shared by the clients).
    pub requests: usize,
    /// Stop starting requests after this long.
    pub max_duration: Duration,
    pub max_tokens: usize,
    pub temperature: f64,
    pub api_key: Option<String>,
    /// Send `"speculate": false` (compare with and without the server's drafter).
    pub no_speculate: bool,
    /// Model id to send (None = the server's default).
    pub model: Option<String>,
    /// Send `"ignore_eos": true`: every request generates exactly `max_tokens`.
    pub ignore_eos: bool,
    pub prompts: Vec<LoadPrompt>,
    /// This fraction of requests hang up mid-stream, after a random number of tokens (a
    /// client that goes away): the server must free their KV blocks and carry on.
    pub disconnect_fraction: f64,
    /// This fraction of requests are malformed (broken JSON, wrong types, out-of-range
    /// values) and must get a 4xx OpenAI error.
    pub malformed_fraction: f64,
}

/// One prompt: a chat message, or raw text for `/v1/completions`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadPrompt {
    pub text: String,
    pub chat: bool,
}

impl LoadPrompt {
    pub fn chat(text: impl Into<String>) -> Self {
        Self { text: text.into(), chat: true }
    }
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            url: "http://127.0.0.1:8080".into(),
            clients: 4,
            requests: 16,
            max_duration: Duration::from_secs(300),
            max_tokens: 64,
            temperature: 0.0,
            api_key: None,
            no_speculate: false,
            model: None,
            ignore_eos: false,
            prompts: DEFAULT_PROMPTS.iter().map(|&s| LoadPrompt::chat(s)).collect(),
            disconnect_fraction: 0.0,
            malformed_fraction: 0.0,
        }
    }
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LoadReport {
    pub clients: usize,
    pub requests_ok: usize,
    pub errors: usize,
    /// Requests this client hung up on mid-stream (`disconnect_fraction`).
    pub disconnected: usize,
    /// Malformed requests the server refused with a 4xx OpenAI error (`malformed_fraction`).
    pub malformed_refused: usize,
    /// First few error messages.
    pub error_samples: Vec<String>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub wall_secs: f64,
    /// Completion tokens per second of wall time, all clients together.
    pub tokens_per_s: f64,
    /// Prompt and completion tokens per second (vLLM's "total token throughput"): the unit a
    /// prefill benchmark measures.
    pub total_tokens_per_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    pub draft_n: u64,
    pub draft_n_accepted: u64,
    // vLLM's serving benchmark names (`benchmark_serving.py --save-result`).
    /// Finished requests per second.
    pub request_throughput: f64,
    /// Completion tokens per second (the same as `tokens_per_s`).
    pub output_throughput: f64,
    /// Prompt and completion tokens per second (the same as `total_tokens_per_s`).
    pub total_token_throughput: f64,
    pub mean_ttft_ms: f64,
    pub median_ttft_ms: f64,
    pub p99_ttft_ms: f64,
    /// Per request: (last token − first token) / (completion tokens − 1).
    pub mean_tpot_ms: f64,
    pub median_tpot_ms: f64,
    pub p99_tpot_ms: f64,
    pub mean_itl_ms: f64,
    pub median_itl_ms: f64,
    pub p99_itl_ms: f64,
}

#[derive(Default)]
struct Samples {
    ok: usize,
    disconnected: usize,
    malformed_refused: usize,
    errors: Vec<String>,
    prompt_tokens: u64,
    completion_tokens: u64,
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    itl: Vec<f64>,
    draft_n: u64,
    draft_n_accepted: u64,
}

/// One streamed request's measurements.
struct OneResult {
    ttft: Option<f64>,
    itl: Vec<f64>,
    /// From the first token to the last.
    decode_secs: f64,
    /// Tokens counted in the stream (for servers that send no usage).
    counted_tokens: u64,
    usage: Value,
}

/// How long requests still running when the time window closes get to finish.
const DRAIN: Duration = Duration::from_secs(120);

/// Runs the load and returns the report.
pub async fn run(cfg: &LoadConfig) -> Result<LoadReport> {
    let addr = loopback_addr(&cfg.url)?;
    if cfg.clients == 0 || cfg.requests == 0 {
        bail!("--clients and --requests must be at least 1");
    }
    if cfg.prompts.is_empty() {
        bail!("no prompts");
    }
    let next = Arc::new(AtomicUsize::new(0));
    let samples = Arc::new(Mutex::new(Samples::default()));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..cfg.clients {
        let (next, samples, cfg, addr) = (next.clone(), samples.clone(), cfg.clone(), addr.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= cfg.requests || started.elapsed() >= cfg.max_duration {
                    return;
                }
                let prompt = &cfg.prompts[i % cfg.prompts.len()];
                // A request started inside the window may finish after it: a slow server is
                // measured, not reported as failing, unless it stalls for DRAIN beyond the window.
                let deadline = cfg.max_duration.saturating_sub(started.elapsed()) + DRAIN;
                let kind = RequestKind::pick(&cfg, i);
                let result = tokio::time::timeout(deadline, async {
                    match kind {
                        RequestKind::Malformed => malformed_request(&addr, &cfg, i).await.map(|()| None),
                        RequestKind::HangUpAfter(n) => hang_up_after(&addr, &cfg, prompt, n).await.map(|()| None),
                        RequestKind::Normal => one_request(&addr, &cfg, prompt).await.map(Some),
                    }
                })
                .await;
                let mut s = samples.lock().unwrap_or_else(|e| e.into_inner());
                match result {
                    Ok(Ok(None)) if kind == RequestKind::Malformed => s.malformed_refused += 1,
                    Ok(Ok(None)) => s.disconnected += 1,
                    Ok(Ok(Some(r))) => {
                        s.ok += 1;
                        s.ttft.extend(r.ttft);
                        s.itl.extend(r.itl);
                        let u = |k: &str| r.usage.get(k).and_then(Value::as_u64).unwrap_or(0);
                        let completion =
                            r.usage.get("completion_tokens").and_then(Value::as_u64).unwrap_or(r.counted_tokens);
                        if completion > 1 {
                            s.tpot.push(r.decode_secs / (completion - 1) as f64);
                        }
                        s.prompt_tokens += u("prompt_tokens");
                        s.completion_tokens += completion;
                        s.draft_n += u("draft_n");
                        s.draft_n_accepted += u("draft_n_accepted");
                    }
                    Ok(Err(e)) => s.errors.push(format!("{e:#}")),
                    Err(_) => s.errors.push("timed out".into()),
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let wall = started.elapsed().as_secs_f64();
    let mut s = std::mem::take(&mut *samples.lock().unwrap_or_else(|e| e.into_inner()));
    s.ttft.sort_by(f64::total_cmp);
    s.itl.sort_by(f64::total_cmp);
    s.tpot.sort_by(f64::total_cmp);
    let ms = |v: &[f64], q: f64| percentile(v, q) * 1e3;
    let mean_ms = |v: &[f64]| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 * 1e3 };
    Ok(LoadReport {
        request_throughput: s.ok as f64 / wall.max(1e-9),
        output_throughput: s.completion_tokens as f64 / wall.max(1e-9),
        total_token_throughput: (s.prompt_tokens + s.completion_tokens) as f64 / wall.max(1e-9),
        mean_ttft_ms: mean_ms(&s.ttft),
        median_ttft_ms: ms(&s.ttft, 0.5),
        p99_ttft_ms: ms(&s.ttft, 0.99),
        mean_tpot_ms: mean_ms(&s.tpot),
        median_tpot_ms: ms(&s.tpot, 0.5),
        p99_tpot_ms: ms(&s.tpot, 0.99),
        mean_itl_ms: mean_ms(&s.itl),
        median_itl_ms: ms(&s.itl, 0.5),
        p99_itl_ms: ms(&s.itl, 0.99),
        clients: cfg.clients,
        requests_ok: s.ok,
        errors: s.errors.len(),
        disconnected: s.disconnected,
        malformed_refused: s.malformed_refused,
        error_samples: s.errors.iter().take(5).cloned().collect(),
        prompt_tokens: s.prompt_tokens,
        completion_tokens: s.completion_tokens,
        wall_secs: wall,
        tokens_per_s: s.completion_tokens as f64 / wall.max(1e-9),
        total_tokens_per_s: (s.prompt_tokens + s.completion_tokens) as f64 / wall.max(1e-9),
        ttft_p50_ms: percentile(&s.ttft, 0.50) * 1e3,
        ttft_p99_ms: percentile(&s.ttft, 0.99) * 1e3,
        itl_p50_ms: percentile(&s.itl, 0.50) * 1e3,
        itl_p99_ms: percentile(&s.itl, 0.99) * 1e3,
        draft_n: s.draft_n,
        draft_n_accepted: s.draft_n_accepted,
    })
}

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// What request `i` of a run is: decided by a hash of `i`, so runs are repeatable.
#[derive(Debug, Clone, Copy, PartialEq)]
enum RequestKind {
    Normal,
    /// Hang up after this many streamed chunks.
    HangUpAfter(usize),
    Malformed,
}

impl RequestKind {
    fn pick(cfg: &LoadConfig, i: usize) -> Self {
        let h = (i as u64 ^ 0x5DEE_CE66).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let u = (h >> 11) as f64 / (1u64 << 53) as f64;
        if u < cfg.malformed_fraction {
            Self::Malformed
        } else if u < cfg.malformed_fraction + cfg.disconnect_fraction {
            Self::HangUpAfter(1 + (h as usize >> 3) % cfg.max_tokens.max(1))
        } else {
            Self::Normal
        }
    }
}

/// The request body for `prompt` and its path.
fn request_body(cfg: &LoadConfig, prompt: &LoadPrompt) -> (Value, &'static str) {
    let mut body = json!({
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let path = if prompt.chat {
        body["messages"] = json!([{"role": "user", "content": prompt.text}]);
        "/v1/chat/completions"
    } else {
        body["prompt"] = json!(prompt.text);
        "/v1/completions"
    };
    if let Some(m) = &cfg.model {
        body["model"] = json!(m);
    }
    if cfg.no_speculate {
        body["speculate"] = json!(false);
    }
    if cfg.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    (body, path)
}

fn auth_header(cfg: &LoadConfig) -> Option<String> {
    cfg.api_key.as_ref().map(|k| format!("Bearer {k}"))
}

/// Streams `prompt` and hangs up after `chunks` chunks (or at the end, if it is shorter).
async fn hang_up_after(addr: &str, cfg: &LoadConfig, prompt: &LoadPrompt, chunks: usize) -> Result<()> {
    let (body, path) = request_body(cfg, prompt);
    let auth = auth_header(cfg);
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("Authorization", a.as_str()));
    }
    let mut stream = send(addr, "POST", path, &headers, body.to_string().as_bytes()).await?;
    if stream.status != 200 {
        let status = stream.status;
        bail!("HTTP {status}: {}", stream.into_response().await?.text());
    }
    for _ in 0..chunks {
        match stream.next_event().await? {
            Some(data) if data != "[DONE]" => {}
            _ => break,
        }
    }
    Ok(()) // Dropping the stream closes the connection.
}

/// Sends one of several malformed requests; succeeds when the server refuses it with a 4xx
/// OpenAI error.
async fn malformed_request(addr: &str, cfg: &LoadConfig, i: usize) -> Result<()> {
    const BODIES: &[&str] = &[
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}",
        "{\"messages\": \"not a list\"}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": -5}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": \"hot\"}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"n\": 1000000}",
        "{\"messages\": [], \"max_tokens\": 4}",
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
        "\u{0}\u{1}\u{2}",
    ];
    let auth = auth_header(cfg);
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("Authorization", a.as_str()));
    }
    let body = BODIES[i % BODIES.len()];
    let resp = send(addr, "POST", "/v1/chat/completions", &headers, body.as_bytes()).await?.into_response().await?;
    let error: Value = serde_json::from_slice(&resp.body).unwrap_or(Value::Null);
    if !(400..500).contains(&resp.status) || !error["error"]["message"].is_string() {
        bail!("malformed request {body:?} got HTTP {} {}", resp.status, resp.text());
    }
    Ok(())
}

async fn one_request(addr: &str, cfg: &LoadConfig, prompt: &LoadPrompt) -> Result<OneResult> {
    let (body, path) = request_body(cfg, prompt);
    let auth = auth_header(cfg);
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("Authorization", a.as_str()));
    }
    let sent = Instant::now();
    let mut stream = send(addr, "POST", path, &headers, body.to_string().as_bytes()).await?;
    if stream.status != 200 {
        let status = stream.status;
        let resp = stream.into_response().await?;
        bail!("HTTP {status}: {}", resp.text());
    }
    let mut ttft = None;
    let mut first = sent;
    let mut counted = 0u64;
    let mut last = sent;
    let mut itl = Vec::new();
    let mut usage = Value::Null;
    let mut finished = false;
    while let Some(data) = stream.next_event().await? {
        if data == "[DONE]" {
            finished = true;
            break;
        }
        let v: Value = serde_json::from_str(&data)?;
        if let Some(e) = v.get("error") {
            bail!("stream error: {e}");
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            usage = u.clone();
        }
        let tokens = chunk_tokens(&v);
        if tokens == 0 {
            continue;
        }
        counted += tokens as u64;
        let now = Instant::now();
        if ttft.is_none() {
            ttft = Some((now - sent).as_secs_f64());
            first = now;
        } else {
            let each = (now - last).as_secs_f64() / tokens as f64;
            itl.extend(std::iter::repeat_n(each, tokens));
        }
        last = now;
    }
    if !finished {
        bail!("the stream ended without [DONE]");
    }
    Ok(OneResult { ttft, itl, decode_secs: (last - first).as_secs_f64(), counted_tokens: counted, usage })
}

/// Tokens one streamed chunk brings: specula's `token_ids`, or one for a chunk with text
/// (chat `delta.content` or completion `text`) from any other server.
fn chunk_tokens(chunk: &Value) -> usize {
    match chunk.pointer("/specula/token_ids").and_then(Value::as_array) {
        Some(ids) => ids.len(),
        None => {
            let text = chunk.pointer("/choices/0/delta/content").or_else(|| chunk.pointer("/choices/0/text"));
            usize::from(text.and_then(Value::as_str).is_some_and(|t| !t.is_empty()))
        }
    }
}

impl LoadReport {
    /// A one-line summary and a small table.
    pub fn render(&self) -> String {
        let accept = if self.draft_n > 0 { self.draft_n_accepted as f64 / self.draft_n as f64 } else { 0.0 };
        let mut s = format!(
            "clients {:>3} | ok {:>4} | errors {:>3} | hung up {} | malformed refused {} | {:.2} req/s | {:>8.1} tok/s ({:.1} with prompts) | TTFT median {:>8.1} ms p99 {:>8.1} ms | TPOT median {:>7.1} ms | ITL median {:>7.1} ms p99 {:>7.1} ms | drafted {} accepted {} ({:.0}%) | {} tokens in {:.1} s",
            self.clients,
            self.requests_ok,
            self.errors,
            self.disconnected,
            self.malformed_refused,
            self.request_throughput,
            self.tokens_per_s,
            self.total_tokens_per_s,
            self.ttft_p50_ms,
            self.ttft_p99_ms,
            self.median_tpot_ms,
            self.itl_p50_ms,
            self.itl_p99_ms,
            self.draft_n,
            self.draft_n_accepted,
            accept * 100.0,
            self.completion_tokens,
            self.wall_secs,
        );
        for e in &self.error_samples {
            s.push_str(&format!("\n  error: {e}"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn chunks_count_tokens_from_specula_or_from_their_text() {
        let specula = json!({"choices": [{"delta": {"content": " the cat"}}], "specula": {"token_ids": [1, 2]}});
        assert_eq!(chunk_tokens(&specula), 2);
        // llama.cpp's and vLLM's chunks: one token each.
        assert_eq!(chunk_tokens(&json!({"choices": [{"delta": {"content": " the"}}]})), 1);
        assert_eq!(chunk_tokens(&json!({"choices": [{"text": "x", "index": 0}]})), 1);
        assert_eq!(chunk_tokens(&json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]})), 0);
        assert_eq!(chunk_tokens(&json!({"choices": [], "usage": {"completion_tokens": 3}})), 0);
    }

    #[test]
    fn refuses_non_loopback_targets() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let cfg = LoadConfig { url: "http://192.168.1.10:8080".into(), ..LoadConfig::default() };
        let err = rt.block_on(run(&cfg)).unwrap_err();
        assert!(err.to_string().contains("loopback"), "{err}");
    }
}
