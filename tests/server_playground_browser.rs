//! The playground in a headless browser (Debian's chromium; `.ci/run` installs it, or this
//! test says it was skipped): the page sends a prompt over the streaming API and shows the
//! answer token by token, coloured by source. The browser is driven over the DevTools protocol
//! on a pipe (`--remote-debugging-pipe`: NUL-terminated JSON on fds 3 and 4).

mod server_support;

use serde_json::{json, Value};
use server_support::*;
use specula::server::ServerConfig;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

fn browser() -> Option<&'static str> {
    ["chromium-headless-shell", "chromium", "chromium-browser", "google-chrome"].into_iter().find(|b| {
        Command::new(b).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    })
}

#[test]
fn playground_streams_coloured_tokens_in_a_headless_browser() {
    let Some(browser) = browser() else {
        eprintln!("SKIPPED: no headless chromium found (apt-get install chromium-headless-shell; .ci/run does)");
        return;
    };
    let server = start(ngram_engine(), ServerConfig::new(MODEL_ID));
    // The page itself is served.
    let page = server.get("/");
    assert_eq!(page.status, 200);
    assert!(page.text().contains("specula playground"));

    let url = format!(
        "http://{}/?autosend=1&max_tokens=24&prompt=Repeat%20this%20sentence%20three%20times%3A%20the%20cat%20sat%20on%20the%20mat.",
        server.addr
    );
    let profile = tempfile::tempdir().unwrap();
    let mut chrome = Cdp::launch(browser, profile.path()).expect("starting the browser");
    let session = chrome.open(&url);
    // Poll the page until its stream has ended.
    let started = Instant::now();
    let state = loop {
        let state = chrome.eval(&session, "document.body ? (document.body.dataset.state || '') : ''");
        if state == "done" || state == "error" {
            break state;
        }
        assert!(started.elapsed() < Duration::from_secs(240), "the page never finished (state `{state}`)");
        std::thread::sleep(Duration::from_millis(200));
    };
    let dom = chrome.eval(&session, "document.documentElement.outerHTML");
    chrome.close();
    // For a look at the page: the finished DOM, to open or screenshot as a static file.
    if let Ok(path) = std::env::var("SPECULA_PLAYGROUND_DOM") {
        std::fs::write(path, dom.as_bytes()).unwrap();
    }
    assert_eq!(state, "done", "the page reported an error:\n{dom}");
    // The answer: between the assistant message's start and its stats line (the header's
    // legend has one span of each colour too).
    let answer = dom
        .split("class=\"msg assistant\"")
        .nth(1)
        .and_then(|rest| rest.split("class=\"stats\"").next())
        .unwrap_or_else(|| panic!("no assistant message:\n{dom}"));
    let targets = answer.matches("class=\"tok target\"").count();
    let drafts = answer.matches("class=\"tok draft\"").count();
    assert!(targets > 0, "no target-coloured tokens:\n{dom}");
    // The stats line reports the server's own count of accepted drafts: the page coloured
    // exactly those tokens as drafts.
    let stats = dom
        .split("class=\"stats\">")
        .nth(1)
        .and_then(|rest| rest.split("</span>").next())
        .unwrap_or_else(|| panic!("no stats line:\n{dom}"));
    let accepted: usize = stats
        .rsplit("accepted ")
        .next()
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no usage in the stats line `{stats}`"));
    assert!(stats.contains("tok/s") && stats.contains("acceptance length"), "{stats}");
    assert_eq!(drafts, accepted, "draft-coloured tokens vs accepted drafts");
    assert!(targets + drafts <= 24, "max_tokens 24");
    eprintln!("playground: {targets} target tokens, {drafts} accepted draft tokens");
}

/// A browser driven over the DevTools protocol on a pipe.
struct Cdp {
    child: Child,
    input: ChildStdin,
    messages: Receiver<Value>,
    next_id: u64,
}

impl Cdp {
    fn launch(browser: &str, profile: &std::path::Path) -> std::io::Result<Self> {
        // The shell hands the browser our pipes as fds 3 (commands) and 4 (replies).
        let script = format!(
            "exec {browser} --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --remote-debugging-pipe \
             --user-data-dir='{}' about:blank 3<&0 4>&1 </dev/null >/dev/null 2>/dev/null",
            profile.display()
        );
        let mut child =
            Command::new("sh").arg("-c").arg(script).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
        let input = child.stdin.take().expect("stdin");
        let output = child.stdout.take().expect("stdout");
        let (tx, messages) = channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(output);
            let mut buf = Vec::new();
            while reader.read_until(0, &mut buf).is_ok_and(|n| n > 0) {
                if buf.last() == Some(&0) {
                    buf.pop();
                }
                if let Ok(v) = serde_json::from_slice::<Value>(&buf) {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
                buf.clear();
            }
        });
        Ok(Self { child, input, messages, next_id: 1 })
    }

    /// Sends a command and waits for its reply (events in between are dropped).
    fn call(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = msg.to_string().into_bytes();
        bytes.push(0);
        self.input.write_all(&bytes).expect("writing to the browser");
        self.input.flush().expect("writing to the browser");
        loop {
            let v = self.messages.recv_timeout(Duration::from_secs(60)).expect("no reply from the browser");
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method} failed: {v}");
                return v["result"].clone();
            }
        }
    }

    /// Opens `url` in a new tab; returns the session attached to it.
    fn open(&mut self, url: &str) -> String {
        let target = self.call(None, "Target.createTarget", json!({"url": url}));
        let attached =
            self.call(None, "Target.attachToTarget", json!({"targetId": target["targetId"], "flatten": true}));
        attached["sessionId"].as_str().expect("session id").to_string()
    }

    /// Evaluates a JavaScript expression in the page; returns its value as a string.
    fn eval(&mut self, session: &str, expression: &str) -> String {
        let r = self.call(Some(session), "Runtime.evaluate", json!({"expression": expression, "returnByValue": true}));
        match &r["result"]["value"] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    }

    fn close(mut self) {
        // The browser exits without necessarily answering.
        let msg = json!({"id": self.next_id, "method": "Browser.close", "params": {}});
        let _ = self.input.write_all(format!("{msg}\0").as_bytes());
        let _ = self.input.flush();
        let _ = self.child.wait();
    }
}

impl Drop for Cdp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
