//! `specula serve` and `specula loadtest` as programs: the server binds a free port, the load
//! tool drives it and reports, SIGTERM shuts the server down gracefully mid-stream.

mod serve_process;

use serde_json::{json, Value};
use serve_process::spawn_command;
use specula::server::http_client;
use std::io::BufReader;
use std::process::Command;
use std::time::{Duration, Instant};

fn specula() -> Command {
    Command::new(env!("CARGO_BIN_EXE_specula"))
}

#[test]
fn serve_loadtest_and_sigterm() {
    let (mut server, mut stderr, addr) =
        spawn_server(&["--drafter", "ngram", "--shutdown-grace-secs", "1", "--kv-tokens", "2048"]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let health: Value = rt.block_on(http_client::request(&addr, "GET", "/health", &[], b"")).unwrap().json().unwrap();
    assert_eq!(health["status"], "ok");
    assert_eq!(health["drafter"], "ngram:3");
    assert!(health["step_cost_ms"].as_array().is_some_and(|a| !a.is_empty()), "{health}");

    // The load tool, with and without speculation, as JSON, with its chart.
    let chart_dir = tempfile::tempdir().unwrap();
    let chart = chart_dir.path().join("load.svg");
    for extra in [&["--chart", chart.to_str().unwrap()][..], &["--no-speculate"][..]] {
        let out = specula()
            .args([
                "loadtest",
                "--url",
                &format!("http://{addr}"),
                "--clients",
                "1,2",
                "--requests",
                "3",
                "--max-tokens",
                "8",
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let reports: Value = serde_json::from_slice(&out.stdout).unwrap();
        let reports = reports.as_array().unwrap();
        assert_eq!(reports.len(), 2);
        for (r, clients) in reports.iter().zip([1, 2]) {
            assert_eq!(r["clients"], clients);
            assert_eq!(r["requests_ok"], 3, "{r}");
            assert_eq!(r["errors"], 0, "{r}");
            assert!(r["completion_tokens"].as_u64().unwrap() > 0);
            assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
            // Prompt tokens count too: total throughput is above completion-only throughput.
            let total = r["total_tokens_per_s"].as_f64().unwrap();
            let wall = r["wall_secs"].as_f64().unwrap();
            let tokens = r["prompt_tokens"].as_u64().unwrap() + r["completion_tokens"].as_u64().unwrap();
            assert!((total * wall - tokens as f64).abs() < 1e-6 * tokens as f64, "{r}");
            assert!(total > r["tokens_per_s"].as_f64().unwrap(), "{r}");
            assert!(r["ttft_p50_ms"].as_f64().unwrap() > 0.0);
            // vLLM's serving benchmark keys.
            assert_eq!(r["output_throughput"], r["tokens_per_s"]);
            assert!(r["request_throughput"].as_f64().unwrap() > 0.0);
            assert!(r["median_ttft_ms"] == r["ttft_p50_ms"] && r["mean_ttft_ms"].as_f64().unwrap() > 0.0);
            assert!(r["mean_tpot_ms"].as_f64().unwrap() > 0.0 && r["p99_tpot_ms"].as_f64().is_some(), "{r}");
            assert!(r["median_itl_ms"] == r["itl_p50_ms"], "{r}");
            assert!(r["ttft_p99_ms"].as_f64().unwrap() >= r["ttft_p50_ms"].as_f64().unwrap());
            if extra[0] == "--chart" {
                assert!(r["draft_n"].as_u64().is_some());
            } else {
                assert_eq!(r["draft_n"], 0, "speculate: false turns the drafter off");
            }
        }
    }
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("output tokens/s"), "{svg}");
    // Only loopback targets.
    let out = specula().args(["loadtest", "--url", "http://10.1.2.3:8080", "--requests", "1"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback"));

    // SIGTERM mid-stream: the stream ends cleanly ([DONE] after an error event once the grace
    // period is over), and the server exits 0.
    let ended = rt.block_on(async {
        let body = json!({"prompt": "Write a long essay about clouds.", "max_tokens": 1500, "stream": true, "ignore_eos": true});
        let mut s = http_client::send(&addr, "POST", "/v1/completions", &[], body.to_string().as_bytes()).await.unwrap();
        assert!(s.next_event().await.unwrap().is_some());
        let status = Command::new("kill").args(["-TERM", &server.id().to_string()]).status().unwrap();
        assert!(status.success());
        let mut last = None;
        while let Some(data) = s.next_event().await.unwrap() {
            if data == "[DONE]" {
                return last;
            }
            last = Some(data);
        }
        panic!("stream ended without [DONE]");
    });
    let last: Value = serde_json::from_str(&ended.unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "server_shutting_down", "{last}");
    wait_for_clean_exit(&mut server);
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
    assert!(rest.contains("shutting down") && rest.contains("stopped"), "{rest}");
    // One JSON log line per finished request: the 12 of the load rounds.
    let finished: Vec<Value> = rest
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "finished" && v["target"] == "specula::request")
        .collect();
    assert!(finished.len() >= 12, "{rest}");
    for v in &finished {
        assert_eq!(v["status"], 200, "{v}");
        assert!(v["completion_tokens"].as_u64().unwrap() > 0 && v["latency_ms"].as_f64().unwrap() > 0.0, "{v}");
        assert!(v.get("drafted").is_some() && v.get("ttft_ms").is_some(), "{v}");
    }
}

/// Starts `specula serve` on a free port with `args` and JSON logs; returns the process, its
/// stderr and the address it announced (on stderr once the model is loaded).
fn spawn_server(args: &[&str]) -> (std::process::Child, BufReader<std::process::ChildStderr>, String) {
    let (server, stderr, addr, _) = spawn_server_logged(args);
    (server, stderr, addr)
}

/// [`spawn_server`], also returning what the server wrote before it listened.
fn spawn_server_logged(args: &[&str]) -> (std::process::Child, BufReader<std::process::ChildStderr>, String, String) {
    spawn_command(&[&["serve", "--port", "0"], args].concat(), None)
}

/// Sends SIGTERM and waits for a clean exit.
fn terminate(server: &mut std::process::Child) {
    assert!(Command::new("kill").args(["-TERM", &server.id().to_string()]).status().unwrap().success());
    wait_for_clean_exit(server);
}

/// Waits for the server to exit after SIGTERM, with status 0.
fn wait_for_clean_exit(server: &mut std::process::Child) {
    let start = Instant::now();
    let code = loop {
        if let Some(status) = server.try_wait().unwrap() {
            break status;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the server did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(code.success(), "exit status {code:?}");
}

/// SIGTERM under load drains: `/ready` turns 503 at once while `/health` stays 200, new
/// requests are refused, every admitted request finishes normally, then the process exits 0.
#[test]
fn sigterm_drains_admitted_requests_and_ready_fails_at_once() {
    let (mut server, _stderr, addr) =
        spawn_server(&["--drafter", "ngram", "--shutdown-grace-secs", "60", "--kv-tokens", "2048"]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let get = |path: &str| rt.block_on(http_client::request(&addr, "GET", path, &[], b"")).unwrap();
    assert_eq!(get("/ready").status, 200);
    let (ready_after_ms, finishes) = rt.block_on(async {
        let mut streams = Vec::new();
        for i in 0..3 {
            let body = json!({"prompt": format!("Story {i}: once upon a time"), "max_tokens": 48, "stream": true, "ignore_eos": true});
            let mut s = http_client::send(&addr, "POST", "/v1/completions", &[], body.to_string().as_bytes()).await.unwrap();
            assert!(s.next_event().await.unwrap().is_some(), "stream {i} started");
            streams.push(s);
        }
        let killed = Instant::now();
        assert!(Command::new("kill").args(["-TERM", &server.id().to_string()]).status().unwrap().success());
        let ready_after_ms = loop {
            let r = http_client::request(&addr, "GET", "/ready", &[], b"").await.unwrap();
            if r.status == 503 {
                break killed.elapsed().as_secs_f64() * 1e3;
            }
            assert!(killed.elapsed() < Duration::from_secs(10), "/ready still {} after SIGTERM", r.status);
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        let health = http_client::request(&addr, "GET", "/health", &[], b"").await.unwrap();
        assert_eq!(health.status, 200, "alive while draining");
        let refused = http_client::post_json(&addr, "/v1/completions", &[], &json!({"prompt": "hi", "max_tokens": 2}))
            .await
            .unwrap();
        assert_eq!(refused.status, 503);
        let mut finishes = Vec::new();
        for mut s in streams {
            let mut finish = None;
            while let Some(data) = s.next_event().await.unwrap() {
                if data == "[DONE]" {
                    break;
                }
                let v: Value = serde_json::from_str(&data).unwrap();
                assert!(v.get("error").is_none(), "an admitted request failed: {v}");
                if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                    finish = Some(f.to_string());
                }
            }
            finishes.push(finish);
        }
        (ready_after_ms, finishes)
    });
    println!("/ready answered 503 {ready_after_ms:.1} ms after SIGTERM");
    assert!(finishes.iter().all(|f| f.as_deref() == Some("length")), "{finishes:?}");
    wait_for_clean_exit(&mut server);
}

/// The command lines llama.cpp and vLLM users already type work as they expect, checked with
/// the official `openai` client (tests/python/test_familiar_commands.py): the served name, the
/// per-request context limit and its 400, `/tokenize` and `/detokenize`.
#[test]
fn llama_cpp_and_vllm_command_lines_serve_the_openai_client() {
    if !Command::new("python3").args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success()) {
        eprintln!(
            "SKIPPED: the `openai` Python package is not installed (`python3 -m pip install openai`; .ci/run does)"
        );
        return;
    }
    // llama-server's form names a GGUF file by path: give the cached model that name.
    let dir = tempfile::tempdir().unwrap();
    let gguf = specula::fetch::resolve_model("smollm2-135m", false).unwrap();
    std::os::unix::fs::symlink(&gguf, dir.path().join("model.gguf")).unwrap();
    let llama_cpp: &[&str] =
        &["serve", "./model.gguf", "-c", "4096", "-np", "4", "--alias", "foo", "--port", "0", "--api-key", "K"];
    let vllm: &[&str] = &[
        "serve",
        "smollm2-135m",
        "--max-model-len",
        "4096",
        "--served-model-name",
        "foo",
        "--speculative-config",
        r#"{"method":"ngram","num_speculative_tokens":5}"#,
        "--port",
        "0",
    ];
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/test_familiar_commands.py");
    for (args, key, drafter) in [(llama_cpp, Some("K"), "suffix"), (vllm, None, "ngram:3")] {
        let (mut server, _stderr, addr, _) = spawn_command(args, Some(dir.path()));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let health: Value =
            rt.block_on(http_client::request(&addr, "GET", "/health", &[], b"")).unwrap().json().unwrap();
        assert_eq!(health["model"], "foo", "{health}");
        assert_eq!(health["context_length"], 4096, "{health}");
        assert!(health["drafter"].as_str().is_some_and(|d| d.starts_with(drafter)), "{health}");
        let mut python = Command::new("python3");
        python.arg(&script).args([
            "--base-url",
            &format!("http://{addr}/v1"),
            "--name",
            "foo",
            "--max-model-len",
            "4096",
        ]);
        if let Some(key) = key {
            python.args(["--api-key", key]);
        }
        let out = python.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        println!("{}:\n{stdout}", args.join(" "));
        assert!(out.status.success(), "{}:\n{stdout}\n{}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
        terminate(&mut server);
    }
}

/// A llama.cpp or vLLM spelling that cannot be honoured is refused at start, with the reason.
#[test]
fn unsupported_speculative_configs_and_conflicting_flags_are_refused() {
    for (args, expected) in [
        (&["--speculative-config", r#"{"method":"medusa","model":"m"}"#][..], "not supported"),
        (&["--speculative-config", r#"{"method":"ngram"}"#, "--drafter", "ngram"][..], "cannot be used with"),
        (
            &["--speculative-config", r#"{"method":"ngram","num_speculative_tokens":4}"#, "--draft-max", "6"][..],
            "disagree",
        ),
        (&["--draft-max", "16"][..], "expected 0 to 15"),
        (&["-np", "0"][..], "≥ 1"),
        (&["smollm2-135m", "-m", "smollm2-135m"][..], "cannot be used with"),
    ] {
        let out = specula().args(["serve", "--port", "0"]).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// Many short requests through a small suffix cache: it stays within its budget by evicting
/// whole old requests, and every request succeeds.
#[test]
fn suffix_cache_stays_within_its_budget_under_load() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let args = ["--drafter", "suffix", "--suffix-cache-mb", "1", "--suffix-scope", "global", "--kv-tokens", "4096"];
    let (mut server, _stderr, addr) = spawn_server(&args);
    let out = specula()
        .args(["loadtest", "--url", &format!("http://{addr}"), "--clients", "4", "--requests", "160"])
        .args(["--max-tokens", "12", "--temperature", "1", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reports: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reports[0]["requests_ok"], 160, "{reports}");
    let start = Instant::now();
    let cache = loop {
        let health: Value =
            rt.block_on(http_client::request(&addr, "GET", "/health", &[], b"")).unwrap().json().unwrap();
        let cache = health["suffix_cache"].clone();
        if health["running"] == 0
            && cache["requests"].as_u64().unwrap() + cache["evicted_requests"].as_u64().unwrap() == 160
        {
            break cache;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{health}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(cache["bytes"].as_u64().unwrap() <= 1 << 20, "{cache}");
    assert!(cache["evicted_requests"].as_u64().unwrap() > 0, "{cache}");
    server.kill().unwrap();
    server.wait().unwrap();
}

/// The suffix drafter's cache file: a damaged one is reported and the server starts with an
/// empty cache and serves; a clean shutdown writes the cache; the next start reads it back.
#[test]
fn suffix_cache_file_is_validated_written_at_shutdown_and_read_back() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("suffix.cache");
    std::fs::write(&file, b"SPSUFX01 but then nothing that adds up").unwrap();
    let path = file.to_str().unwrap();
    let args = ["--drafter", "suffix", "--suffix-cache-file", path, "--suffix-cache-mb", "8", "--kv-tokens", "2048"];
    let (mut server, _stderr, addr, early) = spawn_server_logged(&args);
    assert!(early.contains("not a usable suffix cache") && early.contains("empty suffix cache"), "{early}");
    let suffix_cache = |addr: &str| -> Value {
        let health: Value =
            rt.block_on(http_client::request(addr, "GET", "/health", &[], b"")).unwrap().json().unwrap();
        health["suffix_cache"].clone()
    };
    assert_eq!(suffix_cache(&addr)["requests"], 0);
    for prompt in ["Count from one to twenty in words.", "List the days of the week."] {
        let body = json!({"prompt": prompt, "max_tokens": 24});
        let r = rt.block_on(http_client::post_json(&addr, "/v1/completions", &[], &body)).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // A finished request joins the cache when the engine lets go of it, just after the answer.
    let start = Instant::now();
    while suffix_cache(&addr)["requests"] != 2 {
        assert!(start.elapsed() < Duration::from_secs(30), "{}", suffix_cache(&addr));
        std::thread::sleep(Duration::from_millis(50));
    }
    let held = suffix_cache(&addr);
    assert!(held["bytes"].as_u64().unwrap() > 0 && held["max_bytes"] == 8 << 20, "{held}");
    terminate(&mut server);
    assert!(std::fs::read(&file).unwrap().starts_with(b"SPSUFX01"));
    assert!(!file.with_extension("tmp").exists(), "the temporary file was renamed into place");

    let (mut server, _stderr, addr, early) = spawn_server_logged(&args);
    assert!(early.contains("suffix cache: 2 requests from"), "{early}");
    assert_eq!(suffix_cache(&addr)["requests"], 2);
    let metrics = rt.block_on(http_client::request(&addr, "GET", "/metrics", &[], b"")).unwrap().text();
    assert!(metrics.contains("specula_suffix_cache_requests 2\n"), "{metrics}");
    server.kill().unwrap();
    server.wait().unwrap();
}

/// SIGKILL in the middle of streams, then a restart: the new server loads from the cache
/// (which holds no partial file), serves, and has every KV block free after its requests.
#[test]
fn sigkill_mid_stream_then_restart() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (mut server, _stderr, addr) = spawn_server(&["--drafter", "ngram", "--kv-tokens", "2048"]);
    let body =
        json!({"prompt": "Write a long essay about clouds.", "max_tokens": 1500, "stream": true, "ignore_eos": true});
    rt.block_on(async {
        let mut streams = Vec::new();
        for _ in 0..4 {
            let mut s =
                http_client::send(&addr, "POST", "/v1/completions", &[], body.to_string().as_bytes()).await.unwrap();
            assert!(s.next_event().await.unwrap().is_some());
            streams.push(s);
        }
        server.kill().unwrap(); // SIGKILL
        server.wait().unwrap();
        for mut s in streams {
            // Each stream ends, cut short: no [DONE].
            let mut done = false;
            while let Ok(Some(data)) = s.next_event().await {
                done |= data == "[DONE]";
            }
            assert!(!done, "a killed server cannot finish its streams");
        }
    });
    let models = specula::fetch::specula_home().join("models");
    let partial: Vec<_> = std::fs::read_dir(&models)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".partial"))
        .collect();
    assert!(partial.is_empty(), "partial files in the cache: {partial:?}");

    let (mut server, _stderr, addr) = spawn_server(&["--drafter", "ngram", "--kv-tokens", "2048"]);
    let r = rt
        .block_on(http_client::post_json(&addr, "/v1/completions", &[], &json!({"prompt": "Hello", "max_tokens": 8})))
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    // The request's blocks go back at the end of the engine's step, just after the answer.
    let start = Instant::now();
    loop {
        let health: Value =
            rt.block_on(http_client::request(&addr, "GET", "/health", &[], b"")).unwrap().json().unwrap();
        if health["kv"]["used_blocks"] == 0 && health["running"] == 0 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "blocks still held: {health}");
        std::thread::sleep(Duration::from_millis(50));
    }
    server.kill().unwrap();
    server.wait().unwrap();
}
