//! `specula serve` as a child process, for the tests that drive the real binary.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStderr, Command, Stdio};

/// Runs `specula ARGS` (a `serve` command line) in `cwd` with JSON logs, and waits for the
/// address it announces once it serves. Returns the process, its stderr (kept open so the
/// server can go on writing), the address and what it wrote before that line.
pub fn spawn_command(args: &[&str], cwd: Option<&std::path::Path>) -> (Child, BufReader<ChildStderr>, String, String) {
    let mut early = String::new();
    let mut command = Command::new(env!("CARGO_BIN_EXE_specula"));
    if let Some(dir) = cwd {
        command.current_dir(dir);
    }
    let mut server = command
        .args(args)
        .env("SPECULA_LOG_FORMAT", "json")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(server.stderr.take().unwrap());
    let mut line = String::new();
    let addr = loop {
        line.clear();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "the server exited before listening: {early}");
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
        early.push_str(&line);
    };
    (server, stderr, addr, early)
}
