#!/usr/bin/env bash
# Seconds from `specula serve -m qwen2.5-coder-1.5b` (default drafter) starting to its first
# /health 200 (alive: the server listens while it loads) and its first /ready 200 (the engine is
# started and serves): cold step-cost cache (--remeasure-step-cost: the cache is not read, the quick curve
# is measured), warm cache, and --drafter none; ROUNDS rounds, the three alternating.
# With LLAMA_PY=<a python with xllamacpp==2026.10.11549>, llama.cpp's server (llama-server's
# code, llama_server.py) on the same file joins each round: seconds to its /health 200, which it
# answers once the model is loaded.
# Usage: docs/benchmarks/serve-start/run.sh [ROUNDS]   (from the repository root, after
# `cargo build --release`; SPECULA=path/to/specula to time another binary)
set -euo pipefail
ROUNDS=${1:-3}
BIN=${SPECULA:-target/release/specula}
MODEL=qwen2.5-coder-1.5b
PORT=${PORT:-18431}
LOG=$(mktemp)

# Seconds until /health and then /ready answer 200 on a server started with the given flags;
# then stops it.
time_to_ready() {
  local start health="" end pid path=/health
  start=$(date +%s.%N)
  "$BIN" serve -m "$MODEL" --port "$PORT" "$@" 2>"$LOG" &
  pid=$!
  while :; do
    if [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT$path" || true)" = 200 ]; then
      if [ -z "$health" ]; then health=$(date +%s.%N); path=/ready; continue; fi
      end=$(date +%s.%N); break
    fi
    kill -0 "$pid" 2>/dev/null || { echo "server exited:" >&2; cat "$LOG" >&2; exit 1; }
    sleep 0.05
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true
  echo "$(echo "$health - $start" | bc) $(echo "$end - $start" | bc)"
}

# Seconds until llama.cpp's server answers /health 200 on the same model file.
llama_time_to_health() {
  local start end pid gguf
  gguf=$("$BIN" fetch "$MODEL" 2>/dev/null | tail -1 | sed 's/^[^:]*: //')
  start=$(date +%s.%N)
  "$LLAMA_PY" "$(dirname "$0")/llama_server.py" "$gguf" "$PORT" >"$LOG" 2>&1 &
  pid=$!
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health" || true)" = 200 ]; do
    kill -0 "$pid" 2>/dev/null || { echo "llama-server exited:" >&2; cat "$LOG" >&2; exit 1; }
    sleep 0.05
  done
  end=$(date +%s.%N)
  kill "$pid"; wait "$pid" 2>/dev/null || true
  echo "$(echo "$end - $start" | bc)"
}

# Prime the cache: start once and wait until the full curve is timed and written.
"$BIN" serve -m "$MODEL" --port "$PORT" 2>"$LOG" &
pid=$!
until grep -q "step cost from the cache\|measured in full" "$LOG"; do
  kill -0 "$pid" 2>/dev/null || { cat "$LOG" >&2; exit 1; }
  sleep 1
done
grep "step cost" "$LOG"
kill "$pid"; wait "$pid" 2>/dev/null || true

echo "round mode health_200_s ready_200_s"
for round in $(seq "$ROUNDS"); do
  echo "$round cold $(time_to_ready --remeasure-step-cost)"; grep -h "step cost measured quickly" "$LOG" | sed 's/^/  # /'
  echo "$round warm $(time_to_ready)"; grep -h "step cost from the cache" "$LOG" | sed 's/^/  # /'
  echo "$round none $(time_to_ready --drafter none)"
  if [ -n "${LLAMA_PY:-}" ]; then echo "$round llama-server health=ready $(llama_time_to_health)"; fi
done
rm -f "$LOG"
