//! The HTTP server end to end on the real SmolLM2-135M: greedy outputs equal `specula generate`
//! (alone, 8 at once, with speculation, with and without prefix caching, under preemption), stop sequences, seeds, usage,
//! every bad input, the queue limit, auth, cancellation on disconnect, graceful shutdown.

mod server_support;

use serde_json::{json, Value};
use server_support::*;
use specula::engine::EngineConfig;
use specula::server::http_client;
use specula::server::ServerConfig;
use std::time::Duration;

const GREEDY_TOKENS: usize = 16;

/// Prompts for the equality checks: chat and completion, plain and repetitive.
fn prompts() -> Vec<(bool, &'static str)> {
    vec![
        (true, "What is the capital of France?"),
        (false, "Once upon a time"),
        (true, "Repeat this sentence three times: the cat sat on the mat."),
        (false, "def fibonacci(n):"),
        (true, "List the days of the week."),
        (false, "The three primary colours are"),
        (true, "Write a haiku about the sea."),
        (false, "1, 2, 3, 4, 5,"),
    ]
}

fn body_for(chat: bool, text: &str, stream: bool) -> Value {
    if chat {
        chat_body(text, GREEDY_TOKENS, stream)
    } else {
        completion_body(text, GREEDY_TOKENS, stream)
    }
}

fn path_for(chat: bool) -> &'static str {
    if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

/// Checks one server against the references: each prompt alone (streamed and not), then all
/// eight at once. Returns the streamed results of the concurrent round.
fn check_greedy_equality(server: &TestServer, references: &[Vec<u32>]) -> Vec<Streamed> {
    let prompts = prompts();
    for ((chat, text), reference) in prompts.iter().zip(references).take(2) {
        let streamed = server.stream(path_for(*chat), &body_for(*chat, text, true));
        assert_eq!(streamed.status, 200);
        assert!(streamed.done);
        assert_eq!(&streamed.token_ids(), reference, "streamed greedy output differs for {text:?}");
        let whole = server.post(path_for(*chat), &body_for(*chat, text, false));
        assert_eq!(whole.status, 200, "{}", whole.text());
        let v = whole.json().unwrap();
        let content = v.pointer("/choices/0/message/content").or_else(|| v.pointer("/choices/0/text")).unwrap();
        assert_eq!(content.as_str().unwrap(), streamed.text(), "non-streamed text differs for {text:?}");
        assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap() as usize, reference.len());
    }
    // Eight at once: they are batched into the same forwards.
    let addr = server.addr.clone();
    let results: Vec<Streamed> = server.block_on(async {
        let tasks: Vec<_> = prompts
            .iter()
            .map(|&(chat, text)| {
                let addr = addr.clone();
                tokio::spawn(async move { stream_async(&addr, path_for(chat), &body_for(chat, text, true)).await })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    for ((_, text), (streamed, reference)) in prompts.iter().zip(results.iter().zip(references)) {
        assert_eq!(&streamed.token_ids(), reference, "concurrent greedy output differs for {text:?}");
    }
    server.wait_idle(Duration::from_secs(10));
    results
}

fn references() -> Vec<Vec<u32>> {
    prompts()
        .iter()
        .map(|&(chat, text)| greedy_reference(&if chat { chat_ids(text) } else { completion_ids(text) }, GREEDY_TOKENS))
        .collect()
}

#[test]
fn greedy_outputs_equal_generate_with_and_without_speculation() {
    let refs = references();
    {
        let server = start_default();
        let results = check_greedy_equality(&server, &refs);
        assert!(results.iter().all(|r| r.sources().iter().all(|s| s == "target")), "no drafter, no draft tokens");
        let metrics = server.get("/metrics").text();
        assert!(metrics.contains("specula_draft_tokens_total 0\n"), "{metrics}");
        // The chat prompts share the template's system-prompt block: later ones attach it
        // from the prefix cache, and their outputs above are still exactly generate's.
        assert!(!metrics.contains("specula_prefix_cache_hit_tokens_total 0\n"), "{metrics}");
        // Usage says so, as OpenAI's `prompt_tokens_details.cached_tokens`: whole blocks, and
        // never the last prompt token.
        let again = server.post(path_for(true), &body_for(true, prompts()[0].1, false)).json().unwrap();
        let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        let prompt = again["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(cached >= 16 && cached % 16 == 0 && cached < prompt, "cached {cached} of {prompt}: {again}");
    }
    {
        let server =
            start(EngineConfig { prefix_caching: false, ..EngineConfig::default() }, ServerConfig::new(MODEL_ID));
        check_greedy_equality(&server, &refs);
        let metrics = server.get("/metrics").text();
        assert!(metrics.contains("specula_prefix_cache_hit_tokens_total 0\n"), "{metrics}");
        let again = server.post(path_for(true), &body_for(true, prompts()[0].1, false)).json().unwrap();
        assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{again}");
    }
    let server = start(ngram_engine(), ServerConfig::new(MODEL_ID));
    let results = check_greedy_equality(&server, &refs);
    let drafts = results.iter().map(|r| r.sources().iter().filter(|s| *s == "draft").count()).sum::<usize>();
    assert!(drafts > 0, "the n-gram drafter should get tokens accepted on the repetitive prompts");
    let metrics = server.get("/metrics").text();
    assert!(!metrics.contains("specula_draft_tokens_accepted_total 0\n"), "{metrics}");
}

#[test]
fn preemption_recomputes_and_keeps_outputs_exact() {
    // 8 blocks of 16 tokens: three ~40-token prompts growing by 40 tokens cannot all fit.
    let config = EngineConfig { kv_tokens: 128, ..EngineConfig::default() };
    let server = start(config, ServerConfig::new(MODEL_ID));
    let users = [
        "Tell me about the moon and the stars.",
        "Explain what a computer is to a child.",
        "Describe your favourite food and why.",
    ];
    let refs: Vec<Vec<u32>> = users.iter().map(|u| greedy_reference(&chat_ids(u), 40)).collect();
    let addr = server.addr.clone();
    let results: Vec<Streamed> = server.block_on(async {
        let tasks: Vec<_> = users
            .iter()
            .map(|u| {
                let addr = addr.clone();
                let body = chat_body(u, 40, true);
                tokio::spawn(async move { stream_async(&addr, "/v1/chat/completions", &body).await })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    for ((u, r), reference) in users.iter().zip(&results).zip(&refs) {
        assert_eq!(r.status, 200);
        assert_eq!(&r.token_ids(), reference, "output after preemption differs for {u:?}");
    }
    let metrics = server.get("/metrics").text();
    assert!(!metrics.contains("specula_preemptions_total 0\n"), "expected preemptions: {metrics}");
    server.wait_idle(Duration::from_secs(10));
}

#[test]
fn stop_sequences_seeds_and_usage() {
    let server = start_default();
    let user = "Write a short poem about autumn leaves.";
    let prompt_len = chat_ids(user).len() as u64;

    // Usage and finish by length.
    let r = server.post("/v1/chat/completions", &chat_body(user, 20, false)).json().unwrap();
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["model"], MODEL_ID);
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    assert_eq!(r["usage"]["prompt_tokens"].as_u64().unwrap(), prompt_len);
    let completion = r["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(r["usage"]["total_tokens"].as_u64().unwrap(), prompt_len + completion);
    assert_eq!(r["usage"]["draft_n"], 0);
    assert_eq!(r["usage"]["draft_n_accepted"], 0);
    if r["choices"][0]["finish_reason"] == "length" {
        assert_eq!(completion, 20);
    }
    let full = r["choices"][0]["message"]["content"].as_str().unwrap().to_string();

    // A stop string from the middle of that text cuts it there, streamed or not.
    let words: Vec<&str> = full.split_whitespace().collect();
    assert!(words.len() >= 4, "{full:?}");
    let stop = words[2].to_string();
    let cut = full.find(&stop).unwrap();
    let mut body = chat_body(user, 20, false);
    body["stop"] = json!([stop.clone(), "\u{1F600}never"]);
    let r = server.post("/v1/chat/completions", &body).json().unwrap();
    assert_eq!(r["choices"][0]["message"]["content"].as_str().unwrap(), &full[..cut]);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    body["stream"] = json!(true);
    body["stop"] = json!(stop);
    body["stream_options"] = json!({"include_usage": true});
    let s = server.stream("/v1/chat/completions", &body);
    assert_eq!(s.text(), &full[..cut]);
    assert_eq!(s.finish_reason().as_deref(), Some("stop"));
    // include_usage: exactly one usage chunk, last, with no choices.
    let usage_chunks: Vec<&Value> = s.events.iter().filter(|e| e.get("usage").is_some_and(|u| !u.is_null())).collect();
    assert_eq!(usage_chunks.len(), 1);
    assert_eq!(usage_chunks[0]["choices"], json!([]));
    assert!(std::ptr::eq(usage_chunks[0], s.events.last().unwrap()));
    assert_eq!(usage_chunks[0]["usage"]["prompt_tokens"].as_u64().unwrap(), prompt_len);
    assert_eq!(usage_chunks[0]["usage"]["completion_tokens"].as_u64().unwrap() as usize, s.token_ids().len());
    // The first chat chunk announces the role.
    assert_eq!(s.events[0]["choices"][0]["delta"]["role"], "assistant");

    // Seeds: the same seed gives the same sample, streamed or not; another seed another one.
    let sampled = |seed: u64, stream: bool| {
        let body = json!({"prompt": "My favourite animal is", "max_tokens": 24, "temperature": 1.0, "seed": seed, "stream": stream});
        if stream {
            server.stream("/v1/completions", &body).text()
        } else {
            server.post("/v1/completions", &body).json().unwrap()["choices"][0]["text"].as_str().unwrap().to_string()
        }
    };
    let a = sampled(42, false);
    assert_eq!(a, sampled(42, false));
    assert_eq!(a, sampled(42, true));
    assert_ne!(a, sampled(4242, false), "different seeds should give different samples");

    // Completions default to 16 tokens (OpenAI's default) and accept token-id prompts.
    let ids = completion_ids("The sky is");
    let r = server.post("/v1/completions", &json!({"prompt": ids, "temperature": 0})).json().unwrap();
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["usage"]["prompt_tokens"].as_u64().unwrap() as usize, ids.len());
    assert!(r["usage"]["completion_tokens"].as_u64().unwrap() <= 16);

    // /v1/models lists the model.
    let m = server.get("/v1/models").json().unwrap();
    assert_eq!(m["data"][0]["id"], MODEL_ID);
    server.wait_idle(Duration::from_secs(10));
}

/// Asserts an OpenAI-style error with `status`, and `param` when given.
fn assert_error(resp: &http_client::Response, status: u16, param: Option<&str>, needle: &str) -> Value {
    assert_eq!(resp.status, status, "expected {status}, got {}: {}", resp.status, resp.text());
    assert_eq!(resp.header("content-type"), Some("application/json"));
    let v = resp.json().unwrap();
    let e = &v["error"];
    assert!(e["message"].as_str().unwrap().to_lowercase().contains(&needle.to_lowercase()), "{needle:?} not in {v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("code").is_some() && e.get("param").is_some(), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
    v
}

#[test]
fn bad_inputs_get_openai_errors_and_the_server_keeps_serving() {
    // A 512-token context makes "prompt longer than the context" cheap to send.
    let config = EngineConfig { kv_tokens: 512, ..EngineConfig::default() };
    let server = start(config, ServerConfig::new(MODEL_ID));
    let chat = "/v1/chat/completions";
    let json_h = [("Content-Type", "application/json")];
    let raw = |path: &str, body: &[u8]| server.post_with(path, &json_h, body);
    let msg = |extra: &str| format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);

    assert_error(&raw(chat, b"{\"messages\": [}"), 400, None, "parse the JSON");
    assert_error(&raw(chat, b"[1, 2]"), 400, None, "JSON object");
    assert_error(&raw(chat, b""), 400, None, "empty");
    assert_error(&raw(chat, b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}"), 400, None, "UTF-8");
    assert_error(&raw(chat, msg(r#","temperature":"warm""#).as_bytes()), 400, Some("temperature"), "number");
    assert_error(&raw(chat, msg(r#","max_tokens":"ten""#).as_bytes()), 400, Some("max_tokens"), "integer");
    assert_error(&raw(chat, msg(r#","stream":1"#).as_bytes()), 400, Some("stream"), "boolean");
    assert_error(&raw(chat, msg(r#","stop":{"a":1}"#).as_bytes()), 400, Some("stop"), "string");
    assert_error(&raw(chat, msg(r#","n":17"#).as_bytes()), 400, Some("n"), "between 1 and 16");
    assert_error(&raw(chat, msg(r#","n":0"#).as_bytes()), 400, Some("n"), "between 1 and 16");
    assert_error(&raw(chat, msg(r#","best_of":3"#).as_bytes()), 400, Some("best_of"), "use n");
    assert_error(
        &raw(chat, msg(r#","logprobs":true,"top_logprobs":21"#).as_bytes()),
        400,
        Some("top_logprobs"),
        "0 and 20",
    );
    assert_error(&raw(chat, msg(r#","top_logprobs":2"#).as_bytes()), 400, Some("top_logprobs"), "logprobs");
    assert_error(&raw(chat, msg(r#","logprobs":3"#).as_bytes()), 400, Some("logprobs"), "boolean");
    assert_error(&raw(chat, msg(r#","echo":true"#).as_bytes()), 400, Some("echo"), "completions");
    assert_error(&raw("/v1/completions", br#"{"prompt":"hi","logprobs":"yes"}"#), 400, Some("logprobs"), "integer");
    assert_error(&raw(chat, msg(r#","top_p":1.5"#).as_bytes()), 400, Some("top_p"), "top_p");
    let v = assert_error(&raw(chat, msg(r#","model":"gpt-9""#).as_bytes()), 404, Some("model"), "gpt-9");
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_error(&raw(chat, br#"{"messages":[]}"#), 400, Some("messages"), "at least one");
    assert_error(&raw(chat, br#"{"model":"smollm2-135m"}"#), 400, Some("messages"), "messages");
    assert_error(
        &raw(chat, br#"{"messages":[{"role":"user","content":5}]}"#),
        400,
        Some("messages[0].content"),
        "string",
    );
    assert_error(&raw(chat, msg(r#","max_tokens":0"#).as_bytes()), 400, Some("max_tokens"), "at least 1");
    assert_error(&raw(chat, msg(r#","max_tokens":-4"#).as_bytes()), 400, Some("max_tokens"), "at least 1");
    assert_error(
        &raw(chat, msg(r#","max_completion_tokens":0"#).as_bytes()),
        400,
        Some("max_completion_tokens"),
        "at least 1",
    );
    let v = assert_error(
        &raw(chat, msg(r#","max_tokens":100000"#).as_bytes()),
        400,
        Some("max_tokens"),
        "maximum context length",
    );
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let long_prompt = "word ".repeat(700);
    let v = assert_error(
        &server.post("/v1/completions", &json!({"prompt": long_prompt, "max_tokens": 1})),
        400,
        Some("prompt"),
        "maximum context length",
    );
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert_error(&server.post("/v1/completions", &json!({"prompt": [999_999]})), 400, Some("prompt"), "vocabulary");
    let many: Vec<&str> = vec!["a"; 65];
    assert_error(&server.post("/v1/completions", &json!({"prompt": many})), 400, Some("prompt"), "at most 64");
    assert_error(&server.post("/v1/completions", &json!({"prompt": ["a", 3]})), 400, Some("prompt"), "must be");
    // Over the 1 MiB limit: 413.
    let huge = format!(r#"{{"prompt":"{}"}}"#, "a".repeat((1 << 20) + 10));
    let v = assert_error(&raw("/v1/completions", huge.as_bytes()), 413, None, "larger than");
    assert_eq!(v["error"]["code"], "request_too_large");
    // Unknown route and wrong method.
    assert_error(&server.get("/v1/nothing"), 404, None, "unknown endpoint");
    assert_error(&server.get(chat), 405, None, "method not allowed");
    // A streamed request with a bad field fails before the stream starts.
    let mut bad_stream = chat_body("hi", 4, true);
    bad_stream["temperature"] = json!(-1);
    assert_eq!(server.stream(chat, &bad_stream).status, 400);

    // Still serving.
    let ok = server.post(chat, &chat_body("Say hello.", 4, false));
    assert_eq!(ok.status, 200, "{}", ok.text());
    let metrics = server.get("/metrics").text();
    assert!(metrics.contains("specula_http_requests_total{endpoint=\"chat\",status=\"400\"}"), "{metrics}");
    assert!(metrics.contains("specula_http_requests_total{endpoint=\"chat\",status=\"200\"} 1\n"), "{metrics}");
    server.wait_idle(Duration::from_secs(10));
}

#[test]
fn disconnecting_clients_cancel_and_free_their_kv_at_once() {
    let server = start_default();
    let addr = server.addr.clone();
    // Streamed: read a few chunks, then hang up.
    server.block_on(async {
        let mut body = completion_body("Write a very long essay about the history of the sea.", 2000, true);
        body["ignore_eos"] = json!(true);
        let mut s =
            http_client::send(&addr, "POST", "/v1/completions", &[], body.to_string().as_bytes()).await.unwrap();
        for _ in 0..3 {
            assert!(s.next_event().await.unwrap().is_some());
        }
        drop(s);
    });
    let h = server.wait_idle(Duration::from_secs(10));
    assert_eq!(h["kv"]["free_blocks"], h["kv"]["total_blocks"]);
    // Not streamed: the client gives up while the request runs.
    server.block_on(async {
        let mut body = completion_body("Write a very long essay about mountains.", 2000, false);
        body["ignore_eos"] = json!(true);
        let req = http_client::post_json(&addr, "/v1/completions", &[], &body);
        assert!(
            tokio::time::timeout(Duration::from_millis(1500), req).await.is_err(),
            "a 2000-token answer cannot be that fast"
        );
    });
    server.wait_idle(Duration::from_secs(10));
    let metrics = server.get("/metrics").text();
    assert!(metrics.contains("specula_requests_cancelled_total 2\n"), "{metrics}");
}

#[test]
fn queue_limit_auth_and_graceful_shutdown() {
    let engine = EngineConfig { max_running: 1, max_waiting: 1, ..EngineConfig::default() };
    let server_cfg = ServerConfig {
        api_key: Some("sekrit".into()),
        shutdown_grace: Duration::from_millis(1500),
        ..ServerConfig::new(MODEL_ID)
    };
    let mut server = start(engine, server_cfg);
    let addr = server.addr.clone();
    let key = [("Authorization", "Bearer sekrit")];

    // Auth on the API, not on health.
    let v = assert_error(&server.get("/v1/models"), 401, None, "API key");
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let wrong = server
        .block_on(http_client::request(&addr, "GET", "/v1/models", &[("Authorization", "Bearer nope")], b""))
        .unwrap();
    assert_eq!(wrong.status, 401);
    let right = server.block_on(http_client::request(&addr, "GET", "/v1/models", &key, b"")).unwrap();
    assert_eq!(right.status, 200);
    assert_eq!(server.get("/health").status, 200);
    assert_eq!(server.post("/v1/chat/completions", &chat_body("hi", 2, false)).status, 401);

    // One running, one waiting, the third is refused with 503.
    let mut long = completion_body("Write a very long essay about rivers.", 3000, true);
    long["ignore_eos"] = json!(true);
    let (mut first, mut second) = server.block_on(async {
        let mut a =
            http_client::send(&addr, "POST", "/v1/completions", &key, long.to_string().as_bytes()).await.unwrap();
        assert_eq!(a.status, 200);
        assert!(a.next_event().await.unwrap().is_some(), "the first request is running");
        let b = http_client::send(&addr, "POST", "/v1/completions", &key, long.to_string().as_bytes()).await.unwrap();
        (a, b)
    });
    let start = std::time::Instant::now();
    while server.health()["waiting"] != 1 {
        assert!(start.elapsed() < Duration::from_secs(10), "second request never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    let third = server
        .block_on(http_client::request(&addr, "POST", "/v1/completions", &key, long.to_string().as_bytes()))
        .unwrap();
    let v = assert_error(&third, 503, None, "overloaded");
    assert_eq!(v["error"]["code"], "server_overloaded");
    assert_eq!(third.header("retry-after"), Some("1"));

    // Shutdown: both streams end cleanly (an error event, then [DONE]) after the grace period.
    let handle = server.handle.take().unwrap();
    let stopper = std::thread::spawn(move || handle.stop());
    let ends: Vec<(Option<Value>, bool)> = server.block_on(async {
        let mut out = Vec::new();
        for s in [&mut first, &mut second] {
            let mut last = None;
            let mut done = false;
            while let Ok(Some(data)) = s.next_event().await {
                if data == "[DONE]" {
                    done = true;
                    break;
                }
                last = serde_json::from_str::<Value>(&data).ok();
            }
            out.push((last, done));
        }
        out
    });
    for (last, done) in &ends {
        assert!(done, "stream must end with [DONE]");
        let last = last.as_ref().unwrap();
        assert_eq!(last["error"]["code"], "server_shutting_down", "{last}");
    }
    stopper.join().unwrap().unwrap();
    assert!(http_client_connect_fails(&addr), "the listener is closed after shutdown");
}

fn http_client_connect_fails(addr: &str) -> bool {
    std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_millis(500)).is_err()
}

/// One sample of a Prometheus text exposition: the metric name, its labels and value.
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// Parses the exposition text: `# TYPE` lines into name → type, and every sample line.
fn parse_exposition(text: &str) -> (std::collections::HashMap<String, String>, Vec<Sample>) {
    let mut types = std::collections::HashMap::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("a TYPE line names a metric and a type");
            assert!(types.insert(name.to_string(), kind.to_string()).is_none(), "{name} typed twice");
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("a sample has a value");
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => {
                let inner = rest.strip_suffix('}').expect("labels close");
                let mut labels = Vec::new();
                let mut chars = inner.chars().peekable();
                while chars.peek().is_some() {
                    let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
                    assert_eq!(chars.next(), Some('"'), "{line}");
                    let mut value = String::new();
                    while let Some(c) = chars.next() {
                        match c {
                            '\\' => value.push(chars.next().expect("an escape has a character")),
                            '"' => break,
                            c => value.push(c),
                        }
                    }
                    labels.push((key, value));
                    if chars.peek() == Some(&',') {
                        chars.next();
                    }
                }
                (name.to_string(), labels)
            }
            None => (series.to_string(), Vec::new()),
        };
        samples.push(Sample { name, labels, value: value.parse().expect("a numeric value") });
    }
    (types, samples)
}

/// The metrics the Gateway API Inference Extension's model-server protocol names (queue,
/// running requests, KV-cache utilisation, block size) and the ones the vLLM router and
/// dashboards read, under vLLM's names with its `model_name` label, with the right types and
/// values that follow the engine's own.
#[test]
fn metrics_speak_the_model_server_protocol() {
    let server = start(ngram_engine(), ServerConfig::new(MODEL_ID));
    let mut generated = 0;
    for i in 0..3 {
        let r = server.post("/v1/completions", &completion_body(&format!("Count: 1, 2, 3, 4, {i}"), 12, false));
        assert_eq!(r.status, 200);
        generated += r.json().unwrap()["usage"]["completion_tokens"].as_u64().unwrap();
    }
    server.wait_idle(Duration::from_secs(10));
    let (types, samples) = parse_exposition(&server.get("/metrics").text());
    let sample = |name: &str| -> &Sample {
        samples.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no sample of {name}"))
    };
    let expected = [
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:num_requests_running", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:gpu_cache_usage_perc", "gauge"),
        ("vllm:cache_config_info", "gauge"),
        ("vllm:prefix_cache_queries_total", "counter"),
        ("vllm:prefix_cache_hits_total", "counter"),
        ("vllm:prompt_tokens_total", "counter"),
        ("vllm:generation_tokens_total", "counter"),
        ("vllm:spec_decode_num_drafts_total", "counter"),
        ("vllm:spec_decode_num_draft_tokens_total", "counter"),
        ("vllm:spec_decode_num_accepted_tokens_total", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:inter_token_latency_seconds", "histogram"),
    ];
    for (name, kind) in expected {
        assert_eq!(types.get(name).map(String::as_str), Some(kind), "{name}");
        let series = if kind == "histogram" { format!("{name}_count") } else { name.to_string() };
        let s = sample(&series);
        assert!(s.labels.iter().any(|(k, v)| k == "model_name" && v == MODEL_ID), "{name}: {:?}", s.labels);
    }
    // Values follow the engine: idle now, three requests' tokens counted.
    assert_eq!(sample("vllm:num_requests_waiting").value, 0.0);
    assert_eq!(sample("vllm:num_requests_running").value, 0.0);
    let usage = sample("vllm:kv_cache_usage_perc").value;
    assert!((0.0..=1.0).contains(&usage), "{usage}");
    assert_eq!(sample("vllm:generation_tokens_total").value, sample("specula_generated_tokens_total").value);
    assert_eq!(sample("vllm:generation_tokens_total").value, generated as f64);
    assert_eq!(sample("vllm:time_to_first_token_seconds_count").value, 3.0);
    assert_eq!(sample("vllm:spec_decode_num_draft_tokens_total").value, sample("specula_draft_tokens_total").value);
    assert!(sample("vllm:spec_decode_num_drafts_total").value <= sample("specula_verify_steps_total").value);
    let info = sample("vllm:cache_config_info");
    assert!(info.labels.iter().any(|(k, v)| k == "block_size" && v == "16"), "{:?}", info.labels);
    // Histogram buckets are cumulative and end at the count.
    let buckets: Vec<&Sample> =
        samples.iter().filter(|s| s.name == "vllm:inter_token_latency_seconds_bucket").collect();
    assert!(buckets.windows(2).all(|w| w[0].value <= w[1].value));
    assert_eq!(buckets.last().unwrap().value, sample("vllm:inter_token_latency_seconds_count").value);
}

/// While the model loads, the listener already answers: alive on `/health`, 503 on `/ready`
/// and on the API, with `Retry-After`.
#[test]
fn a_loading_server_is_alive_but_not_ready() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(specula::server::serve_while_loading(listener, "foo".into(), async move {
        let _ = done_rx.await;
    }));
    let get = |path: &str| rt.block_on(http_client::request(&addr, "GET", path, &[], b"")).unwrap();
    let health = get("/health");
    assert_eq!(health.status, 200);
    assert_eq!(health.json().unwrap()["status"], "loading");
    let ready = get("/ready");
    assert_eq!(ready.status, 503);
    assert_eq!(ready.json().unwrap()["status"], "loading");
    let models = get("/v1/models");
    assert_eq!(models.status, 503);
    assert_eq!(models.header("retry-after"), Some("1"));
    assert_eq!(models.json().unwrap()["error"]["code"], "model_loading");
    done_tx.send(()).unwrap();
    rt.block_on(server).unwrap().unwrap();
}

/// `/ready` is 200 while requests are admitted; after the shutdown signal it is 503 at once while
/// `/health` stays 200 (alive, draining), and new requests are refused.
#[test]
fn ready_turns_away_traffic_while_draining() {
    let server = start_default();
    let ready = server.get("/ready");
    assert_eq!(ready.status, 200);
    assert_eq!(ready.json().unwrap()["status"], "ready");
    server.handle.as_ref().unwrap().state().shutting_down.store(true, std::sync::atomic::Ordering::SeqCst);
    let ready = server.get("/ready");
    assert_eq!(ready.status, 503);
    assert_eq!(ready.json().unwrap()["status"], "draining");
    let health = server.get("/health");
    assert_eq!(health.status, 200);
    assert_eq!(health.json().unwrap()["status"], "draining");
    let refused = server.post("/v1/completions", &completion_body("Hello", 4, false));
    assert_eq!(refused.status, 503);
    assert_eq!(refused.json().unwrap()["error"]["code"], "server_shutting_down");
}
