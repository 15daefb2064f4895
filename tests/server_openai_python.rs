//! The official `openai` Python client against the server (tests/python/test_openai_client.py).
//! `.ci/run` installs the client; without it the test says so and does nothing.

mod server_support;

use serde_json::json;
use server_support::*;
use specula::engine::{EngineConfig, TextStream};
use specula::server::ServerConfig;
use std::process::Command;
use std::time::Duration;

fn openai_available() -> bool {
    Command::new("python3").args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success())
}

#[test]
fn official_openai_python_client() {
    if !openai_available() {
        eprintln!(
            "SKIPPED: the `openai` Python package is not installed (`python3 -m pip install openai`; .ci/run does)"
        );
        return;
    }
    // Main server: speculation on (n-gram drafter), a 1024-token context so over-long prompts
    // are cheap to send.
    let main = start(EngineConfig { kv_tokens: 1024, ..ngram_engine() }, ServerConfig::new(MODEL_ID));
    // Tiny server: one running and one waiting request at most, an API key.
    let tiny = start(
        EngineConfig { max_running: 1, max_waiting: 1, ..EngineConfig::default() },
        ServerConfig {
            api_key: Some("sekrit".into()),
            shutdown_grace: Duration::from_millis(500),
            ..ServerConfig::new(MODEL_ID)
        },
    );

    // Tools server: a chat template that offers tools (Qwen3's, which SmolLM2's ChatML shares).
    let template = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat-templates/qwen3.jinja"),
    )
    .unwrap();
    let tools = start(
        ngram_engine(),
        ServerConfig {
            chat_template: Some(std::sync::Arc::new(model().template_from_source(&template).unwrap())),
            ..ServerConfig::new(MODEL_ID)
        },
    );

    // Greedy references from engine::generate, decoded the way the server streams text.
    let m = model();
    let cases: Vec<serde_json::Value> = [
        (true, "What is the capital of France?"),
        (false, "Once upon a time"),
        (true, "Repeat this sentence three times: the cat sat on the mat."),
        (false, "def add(a, b):"),
        (true, "List three animals."),
        (false, "The sun is"),
        (true, "Say hello in French."),
        (false, "A, B, C, D,"),
    ]
    .iter()
    .map(|&(chat, prompt)| {
        let ids = if chat { chat_ids(prompt) } else { completion_ids(prompt) };
        let tokens = greedy_reference(&ids, 16);
        let mut text = TextStream::new(Vec::new());
        let mut expected = String::new();
        for &t in &tokens {
            expected.push_str(&text.push(&m.tokenizer, t));
        }
        expected.push_str(&text.finish());
        json!({"chat": chat, "prompt": prompt, "max_tokens": 16, "expected": expected,
               "completion_tokens": tokens.len(), "prompt_tokens": ids.len()})
    })
    .collect();
    let dir = tempfile::tempdir().unwrap();
    let cases_path = dir.path().join("cases.json");
    std::fs::write(&cases_path, serde_json::to_string_pretty(&cases).unwrap()).unwrap();

    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/test_openai_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg("--base-url")
        .arg(format!("http://{}/v1", main.addr))
        .arg("--tiny-url")
        .arg(format!("http://{}/v1", tiny.addr))
        .arg("--cases")
        .arg(&cases_path)
        .arg("--tools-url")
        .arg(format!("http://{}/v1", tools.addr))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(out.status.success(), "python client checks failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
    main.wait_idle(Duration::from_secs(10));
}
