//! OpenAI features on the real SmolLM2-135M server: log-probs (chat and completions, streamed
//! and not) that are the target's own whatever was drafted, `echo` with prompt log-probs,
//! `n` choices that share the prompt's blocks and sample on their own, and several prompts in
//! one completions request.

mod server_support;

use serde_json::{json, Value};
use server_support::*;
use specula::model::accuracy::teacher_forced_logprobs;
use specula::server::ServerConfig;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// A prompt the n-gram drafter gets accepted tokens on.
const REPETITIVE: &str = "Repeat this sentence three times: the cat sat on the mat.";

/// One token of a response's log-probs: id-free text, its log-prob, and the alternatives.
#[derive(Debug, Clone, PartialEq)]
struct Lp {
    token: String,
    logprob: f64,
    top: Vec<(String, f64)>,
}

/// The chat format's `logprobs.content` entries.
fn chat_lps(logprobs: &Value) -> Vec<Lp> {
    logprobs["content"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs.content in {logprobs}"))
        .iter()
        .map(|e| Lp {
            token: e["token"].as_str().unwrap().to_string(),
            logprob: e["logprob"].as_f64().unwrap(),
            top: e["top_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| (t["token"].as_str().unwrap().to_string(), t["logprob"].as_f64().unwrap()))
                .collect(),
        })
        .collect()
}

fn assert_close(a: &[Lp], b: &[Lp], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.token, y.token, "{what}: token {i}");
        assert!((x.logprob - y.logprob).abs() <= tol, "{what}: token {i}: {} vs {}", x.logprob, y.logprob);
        assert_eq!(x.top.len(), y.top.len(), "{what}: token {i} alternatives");
        for ((tx, lx), (ty, ly)) in x.top.iter().zip(&y.top) {
            assert_eq!(tx, ty, "{what}: token {i} alternatives");
            assert!((lx - ly).abs() <= tol, "{what}: token {i} alternative {tx:?}: {lx} vs {ly}");
        }
    }
}

/// The log-probs of a streamed chat response: every chunk's `logprobs.content`, in order.
fn streamed_chat_lps(s: &Streamed) -> Vec<Lp> {
    s.events
        .iter()
        .filter_map(|e| e.pointer("/choices/0/logprobs").filter(|v| !v.is_null()))
        .flat_map(chat_lps)
        .collect()
}

/// Independent reference: one teacher-forced forward over prompt + output, each row's
/// log-softmax at temperature `t` (greedy: 1).
fn reference_lps(prompt: &[u32], output: &[u32], t: f64) -> Vec<f64> {
    let m = model();
    let rows = teacher_forced_logprobs(&m.model, prompt, output).unwrap();
    rows.iter()
        .zip(output)
        .map(|(row, &tok)| {
            // log_softmax(l / t) from log_softmax(l): (lp − max)/t − logsumexp((lp − max)/t).
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let scaled = |lp: f32| (lp as f64 - max) / t;
            let lse = row.iter().map(|&lp| scaled(lp).exp()).sum::<f64>().ln();
            scaled(row[tok as usize]) - lse
        })
        .collect()
}

fn chat_request(stream: bool, temperature: f64, speculate: bool) -> Value {
    json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": REPETITIVE}],
        "max_tokens": 32,
        "temperature": temperature,
        "seed": 7,
        "stream": stream,
        "logprobs": true,
        "top_logprobs": 3,
        "speculate": speculate,
    })
}

#[test]
fn logprobs_are_the_targets_own_with_and_without_speculation() {
    let server = start(ngram_engine(), ServerConfig::new(MODEL_ID));
    let prompt = chat_ids(REPETITIVE);
    let tokenizer = &model().tokenizer;
    for temperature in [0.0, 1.0] {
        let plain = server.post(CHAT, &chat_request(false, temperature, false)).json().unwrap();
        let plain_lps = chat_lps(&plain["choices"][0]["logprobs"]);
        let spec = server.stream(CHAT, &chat_request(true, temperature, true));
        assert_eq!(spec.status, 200);
        let spec_lps = streamed_chat_lps(&spec);
        let spec_ids = spec.token_ids();
        assert_eq!(spec_lps.len(), spec_ids.len(), "one log-prob per streamed token");
        for (lp, &id) in spec_lps.iter().zip(&spec_ids) {
            assert_eq!(lp.token, String::from_utf8_lossy(tokenizer.piece(id, false)));
            assert!(lp.top.len() == 3 && lp.top[0].1 >= lp.top[2].1, "{lp:?}");
        }
        if temperature == 0.0 {
            // Greedy: the same tokens with and without drafts, so the same log-probs to 1e-5,
            // and the chosen token is the most likely alternative.
            assert!(spec.sources().iter().any(|s| s == "draft"), "the drafter should get tokens accepted");
            assert_close(&spec_lps, &plain_lps, 1e-5, "greedy, speculative vs plain");
            assert!(spec_lps.iter().all(|l| l.token == l.top[0].0 && l.logprob == l.top[0].1));
        }
        // Whatever was sampled, each log-prob is the target's: the teacher-forced forward over
        // the same tokens gives it (a different batch shape: 1e-3).
        let t = if temperature == 0.0 { 1.0 } else { temperature };
        let reference = reference_lps(&prompt, &spec_ids, t);
        for (i, (lp, r)) in spec_lps.iter().zip(&reference).enumerate() {
            assert!((lp.logprob - r).abs() < 1e-3, "T={temperature} token {i}: {} vs teacher-forced {r}", lp.logprob);
        }
    }
}

#[test]
fn completions_logprobs_and_echo_with_prompt_logprobs() {
    let server = start_default();
    let text = "The three primary colours are";
    let prompt = completion_ids(text);
    let body = |echo: bool, logprobs: Option<u64>| json!({"model": MODEL_ID, "prompt": text, "max_tokens": 6, "temperature": 0, "echo": echo, "logprobs": logprobs});
    let v = server.post(COMPLETIONS, &body(false, Some(2))).json().unwrap();
    let choice = &v["choices"][0];
    let lp = &choice["logprobs"];
    let n = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n, "{v}");
    assert_eq!(
        lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect::<String>(),
        choice["text"]
    );
    let offsets: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    assert!(lp["top_logprobs"].as_array().unwrap().iter().all(|m| m.as_object().unwrap().len() <= 2));

    // Echo: the prompt first, its first token without a log-prob, the others the target's.
    let v = server.post(COMPLETIONS, &body(true, Some(1))).json().unwrap();
    let choice = &v["choices"][0];
    assert!(choice["text"].as_str().unwrap().starts_with(text), "{v}");
    let lp = &choice["logprobs"];
    let token_lps = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(token_lps.len(), prompt.len() + n, "{v}");
    assert!(token_lps[0].is_null() && lp["top_logprobs"][0].is_null());
    let output: Vec<u32> = greedy_reference(&prompt, 6);
    let all: Vec<u32> = prompt.iter().chain(&output).copied().collect();
    let reference = reference_lps(&all[..1], &all[1..], 1.0);
    for (i, r) in reference.iter().enumerate() {
        let got = token_lps[i + 1].as_f64().unwrap();
        assert!((got - r).abs() < 1e-3, "token {}: {got} vs teacher-forced {r}", i + 1);
    }
    // Echo alone: text, no log-probs; and streamed, the prompt comes first.
    let v = server.post(COMPLETIONS, &body(true, None)).json().unwrap();
    assert!(v["choices"][0]["text"].as_str().unwrap().starts_with(text) && v["choices"][0]["logprobs"].is_null());
    let mut streamed = body(true, Some(0));
    streamed["stream"] = json!(true);
    let s = server.stream(COMPLETIONS, &streamed);
    assert_eq!(s.events[0]["choices"][0]["text"], text);
    let streamed_lps: Vec<Value> = s
        .events
        .iter()
        .filter_map(|e| e.pointer("/choices/0/logprobs/token_logprobs").and_then(Value::as_array))
        .flatten()
        .cloned()
        .collect();
    assert_eq!(&streamed_lps, token_lps, "streamed echo log-probs equal the whole response's");
    // With n = 3, streamed: every choice echoes the prompt with its log-probs.
    streamed["n"] = json!(3);
    let s = server.stream(COMPLETIONS, &streamed);
    for i in 0..3 {
        let lps: Vec<Value> = s
            .events
            .iter()
            .flat_map(|e| e["choices"].as_array().cloned().unwrap_or_default())
            .filter(|c| c["index"] == i)
            .filter_map(|c| c.pointer("/logprobs/token_logprobs").and_then(Value::as_array).cloned())
            .flatten()
            .collect();
        assert_eq!(&lps, token_lps, "choice {i}: streamed echo log-probs");
    }
}

#[test]
fn n_choices_share_the_prompt_and_sample_on_their_own() {
    let server = start_default();
    let user = "List the days of the week, one per line, with a short note on each.";
    let prompt = chat_ids(user);
    // Greedy: every choice is the greedy output.
    let reference = greedy_reference(&prompt, 12);
    assert_eq!(reference.len(), 12, "the reference should run to max_tokens");
    let body = |n: usize, temperature: f64, seed: u64, stream: bool| {
        json!({"model": MODEL_ID, "messages": [{"role": "user", "content": user}], "max_tokens": 12,
               "temperature": temperature, "seed": seed, "n": n, "stream": stream})
    };
    let single = server.post(CHAT, &body(1, 0.0, 1, false)).json().unwrap();
    let reference_text = single["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let v = server.post(CHAT, &body(3, 0.0, 1, false)).json().unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"].as_str().unwrap(), reference_text);
    }
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, prompt.len());
    assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap() as usize, 3 * reference.len());
    // The choices after the first reuse its prompt blocks.
    assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() >= 16, "{v}");

    // Sampled: choice i is the single request with seed + i.
    let v = server.post(CHAT, &body(3, 1.0, 40, false)).json().unwrap();
    let texts: Vec<&str> =
        v["choices"].as_array().unwrap().iter().map(|c| c["message"]["content"].as_str().unwrap()).collect();
    for (i, text) in texts.iter().enumerate() {
        let alone = server.post(CHAT, &body(1, 1.0, 40 + i as u64, false)).json().unwrap();
        assert_eq!(alone["choices"][0]["message"]["content"].as_str().unwrap(), *text, "choice {i}");
    }
    // Streamed: each index's deltas make its text; one [DONE] after all.
    let s = server.stream(CHAT, &body(3, 1.0, 40, true));
    assert!(s.done);
    for (i, text) in texts.iter().enumerate() {
        let streamed: String = s
            .events
            .iter()
            .filter(|e| e.pointer("/choices/0/index").and_then(Value::as_u64) == Some(i as u64))
            .filter_map(|e| e.pointer("/choices/0/delta/content").and_then(Value::as_str))
            .collect();
        assert_eq!(streamed, *text, "streamed choice {i}");
        let finishes = s
            .events
            .iter()
            .filter(|e| e.pointer("/choices/0/index").and_then(Value::as_u64) == Some(i as u64))
            .filter(|e| e.pointer("/choices/0/finish_reason").is_some_and(|f| !f.is_null()))
            .count();
        assert_eq!(finishes, 1, "choice {i} ends once");
    }
    server.wait_idle(std::time::Duration::from_secs(10));
}

/// `prompt` as a list: each prompt gets `n` choices, prompt p's choice i at index p·n + i, each
/// what the prompt alone with seed + index gives; usage sums the prompts.
#[test]
fn several_completion_prompts_each_get_n_choices() {
    let server = start_default();
    let prompts = ["The three primary colours are", "Once upon a time, in a small village,"];
    let body = |prompt: Value, n: usize, seed: u64, stream: bool| {
        json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": seed,
               "n": n, "echo": true, "logprobs": 1, "stream": stream})
    };
    let v = server.post(COMPLETIONS, &body(json!(prompts), 2, 7, false)).json().unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "{v}");
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for (c, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], c);
        let prompt = prompts[c / 2];
        let alone = server.post(COMPLETIONS, &body(json!(prompt), 1, 7 + c as u64, false)).json().unwrap();
        assert_eq!(choice["text"], alone["choices"][0]["text"], "choice {c}");
        assert!(choice["text"].as_str().unwrap().starts_with(prompt));
        assert_eq!(
            choice["logprobs"]["token_logprobs"], alone["choices"][0]["logprobs"]["token_logprobs"],
            "choice {c}"
        );
        if c % 2 == 0 {
            prompt_tokens += alone["usage"]["prompt_tokens"].as_u64().unwrap();
        }
        completion_tokens += alone["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap(), prompt_tokens, "{v}");
    assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap(), completion_tokens, "{v}");
    // Streamed: each index's text pieces make the same text, its prompt first.
    let s = server.stream(COMPLETIONS, &body(json!(prompts), 2, 7, true));
    assert!(s.done);
    for (c, choice) in choices.iter().enumerate() {
        let text: String = s
            .events
            .iter()
            .flat_map(|e| e["choices"].as_array().cloned().unwrap_or_default())
            .filter(|x| x["index"] == c)
            .filter_map(|x| x["text"].as_str().map(str::to_string))
            .collect();
        assert_eq!(text, choice["text"].as_str().unwrap(), "streamed choice {c}");
    }
    // Token-id prompts too; a bad one refuses the whole request.
    let ids = json!([completion_ids(prompts[0]), completion_ids(prompts[1])]);
    let v = server.post(COMPLETIONS, &body(ids, 1, 7, false)).json().unwrap();
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{v}");
    let r = server.post(COMPLETIONS, &body(json!(["fine", [999_999_999u64]]), 1, 7, false));
    assert_eq!(r.status, 400);
    server.wait_idle(std::time::Duration::from_secs(10));
}

#[test]
fn structured_outputs_through_the_api() {
    let server = start(ngram_engine(), ServerConfig::new(MODEL_ID));
    let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                        "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": false});
    let body = |format: Value, stream: bool| {
        json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "A person as JSON, please."}],
               "max_tokens": 64, "temperature": 0, "response_format": format, "stream": stream})
    };
    let format = json!({"type": "json_schema", "json_schema": {"name": "person", "schema": schema}});
    let v = server.post(CHAT, &body(format.clone(), false)).json().unwrap();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let person: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{content:?} is not JSON: {e}"));
    assert!(person["name"].is_string() && person["age"].is_i64() && person.as_object().unwrap().len() == 2);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Streamed, the same text; without speculation, the same text.
    assert_eq!(server.stream(CHAT, &body(format.clone(), true)).text(), content);
    let mut plain = body(format, false);
    plain["speculate"] = json!(false);
    assert_eq!(server.post(CHAT, &plain).json().unwrap()["choices"][0]["message"]["content"], content);
    // Any JSON object; a choice; a regex on completions.
    let v = server.post(CHAT, &body(json!({"type": "json_object"}), false)).json().unwrap();
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(text).unwrap().is_object(), "{text:?}");
    }
    let mut choice = body(Value::Null, false);
    choice["structured_outputs"] = json!({"choice": ["red", "green", "blue"]});
    let v = server.post(CHAT, &choice).json().unwrap();
    assert!(["red", "green", "blue"].contains(&v["choices"][0]["message"]["content"].as_str().unwrap()), "{v}");
    let v = server
        .post(
            COMPLETIONS,
            &json!({"prompt": "The year was", "max_tokens": 8, "temperature": 1, "seed": 3,
                    "structured_outputs": {"regex": " (19|20)[0-9]{2}"}}),
        )
        .json()
        .unwrap();
    let year = v["choices"][0]["text"].as_str().unwrap();
    assert!(year.len() == 5 && (year.starts_with(" 19") || year.starts_with(" 20")), "{year:?}");
    // Errors name the field.
    let bad = json!({"type": "json_schema", "json_schema": {"schema": {"properties": {"a": {"$ref": "#/x"}}}}});
    let r = server.post(CHAT, &body(bad, false));
    assert_eq!(r.status, 400);
    assert_eq!(r.json().unwrap()["error"]["param"], "response_format");
    let mut both = body(json!({"type": "json_object"}), false);
    both["structured_outputs"] = json!({"regex": "a"});
    let r = server.post(CHAT, &both);
    assert_eq!((r.status, r.json().unwrap()["error"]["param"].clone()), (400, json!("structured_outputs")));
    server.wait_idle(std::time::Duration::from_secs(10));
}
