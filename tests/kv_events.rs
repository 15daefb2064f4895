//! `specula serve --kv-events`: a subscriber written against vLLM's event schema
//! (tests/python/kv_events_subscriber.py, pyzmq and msgspec) receives what the prefix cache
//! did: prompts sharing prefixes, and more of them than a small pool holds, so blocks are
//! stored, shared and evicted. `.ci/run` installs the Python packages; without them the test
//! says so and does nothing.

mod serve_process;

use serde_json::{json, Value};
use serve_process::spawn_command;
use specula::server::http_client;
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BLOCK_SIZE: usize = 16;

fn subscriber_available() -> bool {
    Command::new("python3").args(["-c", "import zmq, msgspec"]).output().is_ok_and(|o| o.status.success())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Token ids from a small deterministic generator (ordinary vocabulary ids of SmolLM2).
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            1000 + (x % 20_000) as u32
        })
        .collect()
}

fn hashes(event: &Value) -> Vec<u64> {
    event["block_hashes"].as_array().unwrap().iter().map(|h| h.as_u64().expect("integer block hash")).collect()
}

#[test]
fn kv_events_follow_the_prefix_cache() {
    if !subscriber_available() {
        eprintln!(
            "SKIPPED: the `zmq` (pyzmq) and `msgspec` Python packages are not installed (`python3 -m pip install pyzmq msgspec`; .ci/run does)"
        );
        return;
    }
    let port = free_port();
    // 512 tokens: 32 blocks, far fewer than the prompts below publish.
    let kv_events = format!("tcp://*:{port}");
    let (mut server, _stderr, addr, early) = spawn_command(
        &["serve", "--port", "0", "--drafter", "none", "--kv-tokens", "512", "--kv-events", &kv_events],
        None,
    );
    assert!(early.contains(&format!("publishing KV-cache events on tcp://*:{port}")), "{early}");

    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/kv_events_subscriber.py");
    let mut subscriber = Command::new("python3")
        .arg(&script)
        .arg(format!("tcp://127.0.0.1:{port}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut sub_out = BufReader::new(subscriber.stdout.take().unwrap());
    let mut ready = String::new();
    sub_out.read_line(&mut ready).unwrap();
    assert_eq!(ready.trim(), "READY", "the subscriber did not start");

    // Four prompts sharing a 4-block prefix, then twelve unrelated 6-block prompts (72 more
    // blocks than the pool's 32: evictions), then the first prompt again (stored anew).
    let shared = tokens(1, 4 * BLOCK_SIZE);
    let mut prompts: Vec<Vec<u32>> =
        (0..4).map(|i| [shared.clone(), tokens(100 + i, 2 * BLOCK_SIZE + 5)].concat()).collect();
    prompts.extend((0..12).map(|i| tokens(200 + i, 6 * BLOCK_SIZE + 3)));
    prompts.push(prompts[0].clone());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let started = Instant::now();
    for prompt in &prompts {
        let body = json!({"prompt": prompt, "max_tokens": 2});
        let r = rt.block_on(http_client::post_json(&addr, "/v1/completions", &[], &body)).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let metrics = rt.block_on(http_client::request(&addr, "GET", "/metrics", &[], b"")).unwrap().text();
    let metric = |name: &str| -> u64 {
        let line = metrics.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    assert_eq!(metric("specula_kv_events_dropped_total"), 0);
    let cached_blocks = metric("specula_kv_blocks_cached") as usize;

    drop(subscriber.stdin.take()); // the subscriber drains what is still coming, then reports
    let mut report = String::new();
    sub_out.read_to_string(&mut report).unwrap();
    let status = subscriber.wait().unwrap();
    let mut sub_err = String::new();
    let _ = subscriber.stderr.take().unwrap().read_to_string(&mut sub_err);
    assert!(status.success(), "subscriber: {sub_err}");
    let messages: Vec<Value> = serde_json::from_str(&report).unwrap();
    eprintln!("{} requests in {:.1}s, {} messages", prompts.len(), started.elapsed().as_secs_f64(), messages.len());

    // Sequence numbers from 0 without gaps; vLLM's envelope values.
    for (i, m) in messages.iter().enumerate() {
        assert_eq!(m["seq"], i as u64, "{m}");
        assert_eq!(m["topic"], "");
        assert_eq!(m["data_parallel_rank"], 0);
        assert!(m["ts"].as_f64().unwrap() > 1.6e9);
    }

    // Replay the events: every stored block's hash chain spells a prefix of a prompt sent,
    // removals name only blocks stored and not yet removed, and what is left is what the
    // pool holds.
    let mut known: HashMap<u64, (Option<u64>, Vec<u32>)> = HashMap::new();
    let mut live: HashSet<u64> = HashSet::new();
    let (mut stored, mut removed) = (0, 0);
    for event in messages.iter().flat_map(|m| m["events"].as_array().unwrap()) {
        match event["type"].as_str().unwrap() {
            "BlockStored" => {
                assert_eq!(event["block_size"], BLOCK_SIZE, "{event}");
                assert_eq!(event["medium"], "GPU");
                assert!(event["lora_id"].is_null() && event["lora_name"].is_null());
                let block_tokens: Vec<u32> = serde_json::from_value(event["token_ids"].clone()).unwrap();
                let hashes = hashes(event);
                assert_eq!(block_tokens.len(), hashes.len() * BLOCK_SIZE, "{event}");
                let mut parent = event["parent_block_hash"].as_u64();
                assert!(event["parent_block_hash"].is_null() || parent.is_some(), "{event}");
                for (hash, chunk) in hashes.iter().zip(block_tokens.chunks(BLOCK_SIZE)) {
                    assert!(parent.is_none_or(|p| known.contains_key(&p)), "unknown parent in {event}");
                    assert!(live.insert(*hash), "block {hash} stored twice");
                    known.insert(*hash, (parent, chunk.to_vec()));
                    // The whole prefix this hash names, rebuilt through the parents.
                    let mut prefix = Vec::new();
                    let mut at = Some(*hash);
                    while let Some(h) = at {
                        let (p, t) = &known[&h];
                        prefix.splice(0..0, t.iter().copied());
                        at = *p;
                    }
                    assert!(prompts.iter().any(|p| p.starts_with(&prefix)), "block {hash} is no prompt's prefix");
                    parent = Some(*hash);
                    stored += 1;
                }
            }
            "BlockRemoved" => {
                assert_eq!(event["medium"], "GPU");
                for hash in hashes(event) {
                    assert!(live.remove(&hash), "removed block {hash} was not stored");
                    removed += 1;
                }
            }
            other => panic!("unexpected event {other}"),
        }
    }
    // Every full block of every prompt was stored at least once (the shared ones once while
    // they stayed cached: storing a live hash again fails above).
    let distinct_blocks: HashSet<&[u32]> =
        prompts.iter().flat_map(|p| p.chunks_exact(BLOCK_SIZE).map(|c| c as &[u32])).collect();
    assert!(stored >= distinct_blocks.len(), "{stored} blocks stored, {} distinct", distinct_blocks.len());
    eprintln!("{stored} blocks stored, {removed} removed, {} cached at the end", live.len());
    assert!(removed > 0, "the small pool evicted nothing");
    assert_eq!(live.len(), cached_blocks, "what the events leave is what the pool holds");

    assert!(Command::new("kill").args(["-TERM", &server.id().to_string()]).status().unwrap().success());
    let start = Instant::now();
    while server.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(30), "the server did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}
