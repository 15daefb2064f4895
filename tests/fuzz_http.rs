//! The HTTP surface under fuzzing: mutated OpenAI requests (every field of real chat and
//! completion requests, set to extremes, wrong types, huge lists, deep nesting), random
//! methods, paths and headers, bodies that are invalid UTF-8, oversized, cut short, declared
//! longer than sent or sent slowly, over raw TCP from several clients at once, against the real
//! server on SmolLM2 with the n-gram drafter. Clients give up on a response after a deadline,
//! so long generations end in disconnects.
//!
//! Every response must be well-formed HTTP and either a valid answer (JSON, or an event
//! stream of JSON events ending in `[DONE]`) or an OpenAI error object with a 4xx status, or
//! the documented 503; no other 5xx. Afterwards the server is idle with every KV block free,
//! and still answers a greedy request exactly as `engine::generate` does.
//!
//! The long run:
//!
//! ```sh
//! SPECULA_FUZZ_REQUESTS=100000 SPECULA_FUZZ_SEED=1 cargo test --release --test fuzz_http -- --nocapture
//! ```

mod common;
mod server_support;

use common::fuzz::{mutate_bytes, mutate_json, Rng};
use serde_json::{json, Value};
use server_support::*;
use specula::engine::EngineConfig;
use specula::server::ServerConfig;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Requests in the test's own round.
const FUZZ_REQUESTS: usize = 1500;
/// Concurrent clients.
const CLIENTS: usize = 8;
/// A client reads a response for at most this long, then disconnects.
const RESPONSE_DEADLINE: Duration = Duration::from_millis(1500);
/// The server's body limit in this test (small, so oversized bodies are cheap to send).
const MAX_BODY: usize = 256 << 10;

/// Real requests of every kind the server takes, the seeds of the mutations.
fn seeds() -> Vec<(&'static str, Value)> {
    let chat = |extra: Value| {
        let mut body = json!({
            "model": MODEL_ID,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}],
            "max_tokens": 8
        });
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        ("/v1/chat/completions", body)
    };
    let completion = |extra: Value| {
        let mut body = json!({"model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 8});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        ("/v1/completions", body)
    };
    vec![
        chat(json!({})),
        chat(json!({"stream": true, "stream_options": {"include_usage": true}})),
        chat(json!({"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7, "n": 2})),
        chat(json!({"logprobs": true, "top_logprobs": 3, "stop": ["\n", "."], "presence_penalty": 0.5})),
        chat(json!({"logit_bias": {"42": -100, "17": 5}, "frequency_penalty": 0.3, "repetition_penalty": 1.1})),
        chat(json!({"response_format": {"type": "json_object"}})),
        chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
            "type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}}, "required": ["colour"]}}}})),
        chat(json!({"structured_outputs": {"regex": "[a-z]{1,5}"}})),
        chat(json!({"structured_outputs": {"choice": ["yes", "no"]}})),
        chat(json!({"tools": [{"type": "function", "function": {"name": "add", "description": "Adds",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}], "tool_choice": "auto"})),
        chat(json!({"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "add"}}})),
        chat(json!({"chat_template_kwargs": {"enable_thinking": false}, "ignore_eos": true})),
        completion(json!({})),
        completion(json!({"stream": true, "echo": true, "logprobs": 2})),
        completion(json!({"prompt": [1, 2, 3, 4], "temperature": 1.0, "n": 3, "seed": 1})),
        completion(json!({"prompt": ["a b c"], "stop": "x", "best_of": 1, "suffix": null})),
        completion(json!({"min_tokens": 2, "max_tokens": 4, "stream": true})),
    ]
}

/// Values that have broken servers: extreme sizes in the fields that size work.
fn hostile_field(rng: &mut Rng, body: &mut Value) {
    let Some(obj) = body.as_object_mut() else { return };
    let huge_list = |n: usize, f: &dyn Fn(usize) -> Value| Value::Array((0..n).map(f).collect());
    let (key, value) = match rng.below(12) {
        0 => ("max_tokens", json!(*rng.pick(&[u64::MAX, 1 << 31, 1 << 53, 0, 100_000]))),
        1 => ("n", json!(*rng.pick(&[0u64, 17, 1000, 1 << 40]))),
        2 => ("logit_bias", {
            let n = *rng.pick(&[1000usize, 20_000]);
            Value::Object((0..n).map(|i| ((i * 7919).to_string(), json!(-100))).collect())
        }),
        3 => ("logit_bias", json!({"4294967296": 1, "-1": 2, "1e3": 3, "49151": 1e300})),
        4 => ("stop", huge_list(*rng.pick(&[5usize, 100, 10_000]), &|i| json!(format!("s{i}")))),
        5 => ("stop", json!("x".repeat(100_000))),
        6 => ("top_logprobs", json!(*rng.pick(&[21u64, 1000, u64::MAX]))),
        7 => (
            "messages",
            huge_list(*rng.pick(&[0usize, 2000]), &|i| json!({"role": "user", "content": format!("m{i}")})),
        ),
        8 => ("prompt", json!("word ".repeat(*rng.pick(&[3000usize, 20_000])))),
        9 => ("seed", json!(*rng.pick(&[u64::MAX, 0]))),
        10 => {
            ("structured_outputs", json!({"regex": *rng.pick(&["(a+)+$", "(a|aa)*b{1000,}", "[", "\\p{L}{100000}"])}))
        }
        _ => (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "r", "schema":
            {"$ref": "#", "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}),
        ),
    };
    obj.insert(key.to_string(), value);
}

/// One raw request.
struct RawRequest {
    bytes: Vec<u8>,
    /// Send the body this many bytes at a time with a pause (a slow client).
    slow: bool,
    /// The request is not meant to get a response before the client gives up (it declares
    /// more body than it sends).
    may_hang: bool,
    /// Not valid HTTP/1.1 framing (a method that is not a token, a bad `Content-Length`, a
    /// control character in a header, too many or too large headers, broken chunks): the HTTP
    /// layer answers a bare 400 or 431 and closes, before any handler runs.
    bad_framing: bool,
}

fn raw_request(rng: &mut Rng, seeds: &[(&'static str, Value)], addr: &str) -> RawRequest {
    let (mut path, mut body) = {
        let (p, b) = rng.pick(seeds);
        (p.to_string(), b.clone())
    };
    let mut method = "POST".to_string();
    // The body: JSON mutations, hostile fields, or bytes.
    let mut body_bytes = match rng.below(10) {
        0..=4 => {
            for _ in 0..1 + rng.below(3) {
                mutate_json(rng, &mut body);
            }
            serde_json::to_vec(&body).unwrap()
        }
        5 | 6 => {
            hostile_field(rng, &mut body);
            serde_json::to_vec(&body).unwrap()
        }
        7 => {
            let mut b = serde_json::to_vec(&body).unwrap();
            for _ in 0..1 + rng.below(4) {
                mutate_bytes(rng, &mut b);
            }
            b
        }
        8 => match rng.below(4) {
            0 => vec![b'['; 100_000],
            1 => [&b"{\"a\":"[..], &vec![b'['; 5000], &vec![b']'; 5000], b"}"].concat(),
            2 => vec![0xFF, 0xFE, b'{', 0xC3, b'}'],
            _ => vec![b'x'; MAX_BODY + 1 + rng.below(1000)],
        },
        _ => serde_json::to_vec(&body).unwrap(),
    };
    // Method and path.
    if rng.chance(0.1) {
        method = rng.pick(&["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "BREW", "G\u{e9}T"]).to_string();
    }
    if rng.chance(0.1) {
        path = rng
            .pick(&[
                "/",
                "/health",
                "/metrics",
                "/v1/models",
                "/v1/embeddings",
                "/v1/chat/completions/",
                "/v1/../v1/completions",
                "/%00%ff",
                "/v1/chat/completions?x=1&&=",
                "//",
                "*",
            ])
            .to_string();
        if rng.chance(0.1) {
            path = format!("/{}", "a".repeat(20_000));
        }
    }
    // Headers.
    let mut headers: Vec<(String, String)> = vec![("Host".into(), addr.into()), ("Connection".into(), "close".into())];
    if !rng.chance(0.1) {
        headers.push((
            "Content-Type".into(),
            rng.pick(&["application/json", "application/json", "text/plain", "application/json; charset=latin1", ""])
                .to_string(),
        ));
    }
    let mut may_hang = false;
    let mut chunked = false;
    let mut bad_framing = !method.bytes().all(|b| b.is_ascii_alphabetic());
    match rng.below(20) {
        0 => headers.push(("Content-Length".into(), (body_bytes.len() + 1 + rng.below(100)).to_string())),
        1 => headers.push(("Content-Length".into(), rng.below(body_bytes.len() + 1).to_string())),
        2 => {
            headers.push((
                "Content-Length".into(),
                rng.pick(&["-1", "18446744073709551616", "1e3", "", "0x10"]).to_string(),
            ));
            bad_framing = true;
        }
        3 => chunked = true,
        4 => {
            headers.push(("Authorization".into(), "Bearer \u{7f}".into()));
            bad_framing = true;
        }
        5 => {
            let n = *rng.pick(&[100usize, 70_000]);
            headers.push(("X-Junk".into(), "v".repeat(n)));
            bad_framing |= n > 16 << 10;
        }
        6 => {
            for i in 0..200 {
                headers.push((format!("X-H{i}"), "1".into()));
            }
            bad_framing = true;
        }
        _ => headers.push(("Content-Length".into(), body_bytes.len().to_string())),
    }
    if matches!(headers.last(), Some((k, v)) if k == "Content-Length" && v.parse::<usize>().is_ok_and(|n| n > body_bytes.len()))
    {
        may_hang = true;
    }
    if chunked {
        headers.push(("Transfer-Encoding".into(), "chunked".into()));
        let mut c = Vec::new();
        for part in body_bytes.chunks(1 + rng.below(64)) {
            c.extend(format!("{:x}\r\n", part.len()).bytes());
            c.extend_from_slice(part);
            c.extend(b"\r\n");
        }
        if rng.chance(0.3) {
            mutate_bytes(rng, &mut c);
            may_hang = true;
            bad_framing = true;
        } else {
            c.extend(b"0\r\n\r\n");
        }
        body_bytes = c;
    }
    let mut bytes = format!("{method} {path} HTTP/1.1\r\n").into_bytes();
    for (k, v) in &headers {
        bytes.extend(format!("{k}: {v}\r\n").bytes());
    }
    bytes.extend(b"\r\n");
    bytes.extend(&body_bytes);
    bad_framing |= path.contains(' ');
    RawRequest { bytes, slow: rng.chance(0.02), may_hang, bad_framing }
}

/// What came back for one request.
enum Outcome {
    /// A complete response and whether it is valid.
    Response { status: u16, problem: Option<String> },
    /// The deadline passed (a long generation, or a request that waits for body bytes).
    GaveUp,
    /// The server closed the connection without a response (allowed for malformed HTTP).
    Closed,
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Decodes a chunked body; `None` when it is malformed or incomplete.
fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line = find(b, b"\r\n")?;
        let size = usize::from_str_radix(std::str::from_utf8(&b[..line]).ok()?.split(';').next()?.trim(), 16).ok()?;
        b = &b[line + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}

/// Checks a complete response: status, and a body that is an OpenAI error or a valid answer.
fn check_response(raw: &[u8], method: &str, bad_framing: bool) -> Outcome {
    let Some(head_end) = find(raw, b"\r\n\r\n") else {
        return if raw.is_empty() {
            Outcome::Closed
        } else {
            Outcome::Response {
                status: 0,
                problem: Some(format!("no header end: {:?}", String::from_utf8_lossy(&raw[..raw.len().min(200)]))),
            }
        };
    };
    let head = String::from_utf8_lossy(&raw[..head_end]).to_string();
    let mut lines = head.lines();
    let status: u16 = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':').map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string())))
        .collect();
    let header = |k: &str| headers.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let mut body = raw[head_end + 4..].to_vec();
    if header("transfer-encoding") == Some("chunked") {
        match dechunk(&body) {
            Some(b) => body = b,
            None => return Outcome::Response { status, problem: Some("malformed chunked body".into()) },
        }
    }
    let problem = (|| -> Option<String> {
        if status == 0 {
            return Some(format!("no status line: {head:?}"));
        }
        if status >= 500 && status != 503 {
            return Some(format!("status {status}: {}", String::from_utf8_lossy(&body)));
        }
        if method == "HEAD" {
            return None;
        }
        let content_type = header("content-type").unwrap_or("");
        if content_type.starts_with("text/event-stream") {
            let text = String::from_utf8_lossy(&body);
            let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
            if events.last() != Some(&"[DONE]") {
                return Some(format!("event stream does not end in [DONE]: {text:.300}"));
            }
            for e in &events[..events.len() - 1] {
                if serde_json::from_str::<Value>(e).is_err() {
                    return Some(format!("event is not JSON: {e:.200}"));
                }
            }
            return None;
        }
        if bad_framing && body.is_empty() && matches!(status, 400 | 413 | 431) {
            return None;
        }
        if status >= 400 {
            let v: Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(_) => {
                    return Some(format!(
                        "status {status} without a JSON error: {:.200}",
                        String::from_utf8_lossy(&body)
                    ))
                }
            };
            if !v["error"]["message"].is_string() || !v["error"]["type"].is_string() {
                return Some(format!("status {status}: not an OpenAI error object: {v:.300}"));
            }
            return None;
        }
        if content_type.starts_with("application/json") && serde_json::from_slice::<Value>(&body).is_err() {
            return Some(format!("status {status}: body is not JSON: {:.200}", String::from_utf8_lossy(&body)));
        }
        None
    })();
    Outcome::Response { status, problem }
}

fn send(addr: &str, req: &RawRequest) -> Outcome {
    let method =
        String::from_utf8_lossy(&req.bytes[..req.bytes.iter().position(|&b| b == b' ').unwrap_or(0)]).to_string();
    let Ok(mut stream) = TcpStream::connect(addr) else { return Outcome::Closed };
    let deadline = Instant::now() + RESPONSE_DEADLINE;
    stream.set_write_timeout(Some(RESPONSE_DEADLINE)).unwrap();
    stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let written = if req.slow {
        req.bytes.chunks(req.bytes.len().div_ceil(20).max(1)).try_for_each(|c| {
            std::thread::sleep(Duration::from_millis(20));
            stream.write_all(c)
        })
    } else {
        stream.write_all(&req.bytes)
    };
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 << 10];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if Instant::now() > deadline {
                    return if raw.is_empty() || req.may_hang { Outcome::GaveUp } else { check_partial(&raw) };
                }
            }
            // A reset after the server answered early (an oversized body) still has its answer.
            Err(_) => break,
        }
    }
    if raw.is_empty() && written.is_err() {
        return Outcome::Closed;
    }
    check_response(&raw, &method, req.bad_framing)
}

/// A response cut off by the client's deadline: its status line must still be acceptable.
fn check_partial(raw: &[u8]) -> Outcome {
    let status: u16 =
        String::from_utf8_lossy(&raw[..raw.len().min(64)]).split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    if status == 200 {
        Outcome::GaveUp
    } else {
        Outcome::Response {
            status,
            problem: Some(format!("a non-200 response did not finish: {:.200}", String::from_utf8_lossy(raw))),
        }
    }
}

#[test]
fn the_server_survives_fuzzed_requests() {
    let requests: usize =
        std::env::var("SPECULA_FUZZ_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(FUZZ_REQUESTS);
    let seed: u64 = std::env::var("SPECULA_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut config = ServerConfig::new(MODEL_ID);
    config.max_body_bytes = MAX_BODY;
    let server = start(EngineConfig { ..ngram_engine() }, config);
    let seeds = seeds();
    // The seeds themselves are valid requests.
    for (path, body) in &seeds {
        let r = server.post(path, body);
        assert_eq!(r.status, 200, "seed request to {path} failed: {}", String::from_utf8_lossy(&r.body));
    }

    let next = AtomicUsize::new(0);
    let statuses = Mutex::new(std::collections::BTreeMap::<u16, usize>::new());
    let (gave_up, closed) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let problems = Mutex::new(Vec::<String>::new());
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..CLIENTS {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= requests {
                    break;
                }
                let mut rng = Rng(seed.wrapping_mul(0x100_0000_01B3) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let req = raw_request(&mut rng, &seeds, &server.addr);
                match send(&server.addr, &req) {
                    Outcome::Response { status, problem } => {
                        *statuses.lock().unwrap().entry(status).or_default() += 1;
                        if let Some(p) = problem {
                            let head = String::from_utf8_lossy(&req.bytes[..req.bytes.len().min(300)]).to_string();
                            problems.lock().unwrap().push(format!("request {i}: {p}\n    request: {head:?}"));
                        }
                    }
                    Outcome::GaveUp => drop(gave_up.fetch_add(1, Ordering::SeqCst)),
                    Outcome::Closed => drop(closed.fetch_add(1, Ordering::SeqCst)),
                }
                if (i + 1) % 5000 == 0 {
                    eprintln!("{} requests, {:.0} s", i + 1, started.elapsed().as_secs_f64());
                }
            });
        }
    });
    let statuses = statuses.into_inner().unwrap();
    eprintln!(
        "{requests} requests (seed {seed}) in {:.0} s; by status {statuses:?}; client gave up {}; closed without a response {}",
        started.elapsed().as_secs_f64(),
        gave_up.load(Ordering::SeqCst),
        closed.load(Ordering::SeqCst)
    );
    let problems = problems.into_inner().unwrap();
    assert!(
        problems.is_empty(),
        "{} bad responses:\n{}",
        problems.len(),
        problems[..problems.len().min(20)].join("\n")
    );

    // The server is idle, every KV block is back, and it still answers exactly.
    let health = server.wait_idle(Duration::from_secs(60));
    assert_eq!(health["kv"]["used_blocks"], 0, "{health}");
    let prompt = "The capital of France is";
    let r = server.post("/v1/completions", &completion_body(prompt, 16, false));
    assert_eq!(r.status, 200);
    let text = r.json().unwrap()["choices"][0]["text"].as_str().unwrap().to_string();
    let expected = model().tokenizer.decode(&greedy_reference(&completion_ids(prompt), 16), true);
    assert_eq!(text, expected, "greedy output after the fuzzing differs from engine::generate's");
}
