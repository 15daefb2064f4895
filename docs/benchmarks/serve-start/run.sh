#!/usr/bin/env bash
# Seconds from `specula serve -m qwen2.5-coder-1.5b` (default drafter) starting to its first
# /health 200: cold step-cost cache (--remeasure-step-cost: the cache is not read, the quick curve
# is measured), warm cache, and --drafter none; ROUNDS rounds, the three alternating.
# Usage: docs/benchmarks/serve-start/run.sh [ROUNDS]   (from the repository root, after
# `cargo build --release`; SPECULA=path/to/specula to time another binary)
set -euo pipefail
ROUNDS=${1:-3}
BIN=${SPECULA:-target/release/specula}
MODEL=qwen2.5-coder-1.5b
PORT=${PORT:-18431}
LOG=$(mktemp)

# Seconds until `path` answers 200 on a server started with the given flags; then stops it.
time_to() {
  local path=$1; shift
  local start end pid
  start=$(date +%s.%N)
  "$BIN" serve -m "$MODEL" --port "$PORT" "$@" 2>"$LOG" &
  pid=$!
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT$path" || true)" = 200 ]; do
    kill -0 "$pid" 2>/dev/null || { echo "server exited:" >&2; cat "$LOG" >&2; exit 1; }
    sleep 0.05
  done
  end=$(date +%s.%N)
  kill "$pid"; wait "$pid" 2>/dev/null || true
  echo "$end - $start" | bc
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

echo "round mode seconds_to_health_200"
for round in $(seq "$ROUNDS"); do
  echo "$round cold $(time_to /health --remeasure-step-cost)"; grep -h "step cost measured quickly" "$LOG" | sed 's/^/  # /'
  echo "$round warm $(time_to /health)"; grep -h "step cost from the cache" "$LOG" | sed 's/^/  # /'
  echo "$round none $(time_to /health --drafter none)"
done
rm -f "$LOG"
