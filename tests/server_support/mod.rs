//! Helpers for the server tests: the real SmolLM2-135M loaded once per test binary, servers on
//! ephemeral loopback ports, a small blocking HTTP client, and greedy references computed
//! with `engine::generate` (what `specula generate` runs).
#![allow(dead_code)]

use serde_json::{json, Value};
use specula::engine::{generate, Engine, EngineConfig, GenerateOptions, LoadedModel};
use specula::sample::SamplingParams;
use specula::server::http_client::{self, Response};
use specula::server::{ServerConfig, ServerHandle};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

pub const MODEL_ID: &str = "smollm2-135m";

pub fn model() -> Arc<LoadedModel> {
    static MODEL: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let path =
                specula::fetch::fetch_once(MODEL_ID, true).unwrap_or_else(|e| panic!("fetching {MODEL_ID}: {e:#}"));
            Arc::new(LoadedModel::load(&path, None, &candle_core::Device::Cpu).expect("loading smollm2-135m"))
        })
        .clone()
}

pub struct TestServer {
    pub handle: Option<ServerHandle>,
    pub engine: Arc<Engine>,
    pub addr: String,
    rt: tokio::runtime::Runtime,
}

/// A server with `engine` settings (model: SmolLM2) on 127.0.0.1, any free port.
pub fn start(engine: EngineConfig, server: ServerConfig) -> TestServer {
    let engine = Arc::new(Engine::start(model(), engine).expect("engine"));
    let handle = ServerHandle::spawn(engine.clone(), server, "127.0.0.1:0".parse().unwrap()).expect("server");
    let addr = handle.addr().to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    TestServer { handle: Some(handle), engine, addr, rt }
}

/// Engine settings with the n-gram drafter. The step-cost curve is given instead of measured,
/// to keep the tests short (the measurement itself runs in the CLI test). It is flat up to 16
/// rows, like a GPU's or a small model's on wide SIMD, so that draft rows pay even in a batch
/// of 8 and the tests exercise speculation inside concurrent batches. On a CPU-like curve the
/// draft budget rightly switches speculation off at that size.
pub fn ngram_engine() -> EngineConfig {
    EngineConfig {
        drafter: Some(specula::speculative::DrafterSpec::parse("ngram").unwrap()),
        step_cost: Some(std::sync::Arc::new(specula::speculative::StepCost::from_points(vec![
            (1, 0.010),
            (2, 0.0102),
            (4, 0.0105),
            (8, 0.011),
            (16, 0.013),
            (32, 0.026),
            (64, 0.052),
        ]))),
        ..EngineConfig::default()
    }
}

pub fn start_default() -> TestServer {
    start(EngineConfig::default(), ServerConfig::new(MODEL_ID))
}

/// A streamed response, read to its end.
#[derive(Debug)]
pub struct Streamed {
    pub status: u16,
    /// Parsed `data:` payloads, `[DONE]` excluded.
    pub events: Vec<Value>,
    pub done: bool,
}

impl Streamed {
    /// Token ids from the `specula` extension of every chunk.
    pub fn token_ids(&self) -> Vec<u32> {
        self.events
            .iter()
            .filter_map(|e| e.pointer("/specula/token_ids").and_then(Value::as_array))
            .flatten()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    }

    pub fn sources(&self) -> Vec<String> {
        self.events
            .iter()
            .filter_map(|e| e.pointer("/specula/sources").and_then(Value::as_array))
            .flatten()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    }

    /// Concatenated text deltas (chat `delta.content` or completion `text`).
    pub fn text(&self) -> String {
        self.events
            .iter()
            .filter_map(|e| {
                e.pointer("/choices/0/delta/content").or_else(|| e.pointer("/choices/0/text")).and_then(Value::as_str)
            })
            .collect()
    }

    pub fn finish_reason(&self) -> Option<String> {
        self.events
            .iter()
            .filter_map(|e| e.pointer("/choices/0/finish_reason").and_then(Value::as_str))
            .last()
            .map(str::to_string)
    }

    pub fn usage(&self) -> Option<Value> {
        self.events.iter().filter_map(|e| e.get("usage").filter(|u| !u.is_null())).last().cloned()
    }
}

impl TestServer {
    pub fn get(&self, path: &str) -> Response {
        self.rt.block_on(http_client::request(&self.addr, "GET", path, &[], b"")).unwrap()
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        self.rt.block_on(http_client::post_json(&self.addr, path, &[], body)).unwrap()
    }

    pub fn post_with(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Response {
        self.rt.block_on(http_client::request(&self.addr, "POST", path, headers, body)).unwrap()
    }

    pub fn stream(&self, path: &str, body: &Value) -> Streamed {
        stream_blocking(&self.rt, &self.addr, path, body)
    }

    pub fn health(&self) -> Value {
        self.get("/health").json().unwrap()
    }

    pub fn kv_used(&self) -> u64 {
        self.health()["kv"]["used_blocks"].as_u64().unwrap()
    }

    /// Waits until no KV block is held and nothing runs (requests are freed at step ends).
    pub fn wait_idle(&self, within: Duration) -> Value {
        let start = Instant::now();
        loop {
            let h = self.health();
            if h["kv"]["used_blocks"] == 0 && h["running"] == 0 && h["waiting"] == 0 {
                return h;
            }
            assert!(start.elapsed() < within, "server not idle after {within:?}: {h}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }
}

pub fn stream_blocking(rt: &tokio::runtime::Runtime, addr: &str, path: &str, body: &Value) -> Streamed {
    rt.block_on(stream_async(addr, path, body))
}

pub async fn stream_async(addr: &str, path: &str, body: &Value) -> Streamed {
    let mut s =
        http_client::send(addr, "POST", path, &[("Content-Type", "application/json")], body.to_string().as_bytes())
            .await
            .unwrap();
    let status = s.status;
    let mut events = Vec::new();
    let mut done = false;
    if status == 200 {
        while let Some(data) = s.next_event().await.unwrap() {
            if data == "[DONE]" {
                done = true;
                break;
            }
            events.push(serde_json::from_str(&data).unwrap());
        }
    } else {
        let r = s.into_response().await.unwrap();
        events.push(r.json().unwrap());
    }
    Streamed { status, events, done }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            let _ = h.stop();
        }
        self.engine.shutdown();
    }
}

/// Prompt ids of a one-message chat, as the server renders it.
pub fn chat_ids(user: &str) -> Vec<u32> {
    model().encode_chat(&[specula::tokenize::ChatMessage::user(user)]).unwrap()
}

pub fn completion_ids(prompt: &str) -> Vec<u32> {
    model().encode_prompt(prompt).unwrap()
}

/// Greedy tokens from `engine::generate` alone (the `specula generate` path).
pub fn greedy_reference(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let m = model();
    let pool = m.model.new_kv_pool(4096);
    let params = SamplingParams { max_tokens: Some(max_tokens), ..SamplingParams::greedy() };
    let opts = GenerateOptions { stop_ids: m.stop_ids(), ..GenerateOptions::default() };
    let out = generate((&m.model).into(), &pool, prompt, params, None, &opts, &mut |_| {}).unwrap();
    out.tokens
}

pub fn chat_body(user: &str, max_tokens: usize, stream: bool) -> Value {
    json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
}

pub fn completion_body(prompt: &str, max_tokens: usize, stream: bool) -> Value {
    json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream})
}
