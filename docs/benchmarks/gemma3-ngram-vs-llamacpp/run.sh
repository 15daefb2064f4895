#!/usr/bin/env bash
# Prompt lookup on gemma3-270m, side by side with llama.cpp's server, alternating, one quiet
# machine, 2 threads each, greedy, 256 tokens past end-of-sequence, the same prompt text
# (prompt.txt, sent as a completion: this GGUF carries no chat template):
#   llama.cpp plain, llama.cpp --spec-type ngram-simple, specula plain, specula --drafter ngram.
#
#   LLAMA_SERVER=/path/to/llama-server bash docs/benchmarks/gemma3-ngram-vs-llamacpp/run.sh ROUNDS
set -euo pipefail
here=$(dirname "$0")
rounds=${1:-3}
log=$(mktemp)
specula=${SPECULA:-target/release/specula}
model=$("$specula" fetch gemma3-270m 2>/dev/null | tail -1 | sed 's/^[^:]*: //')
prompt=$(cat "$here/prompt.txt")
body=$(python3 -c 'import json,sys; print(json.dumps({"prompt": sys.argv[1], "n_predict": 256, "temperature": 0, "ignore_eos": True, "cache_prompt": False}))' "$prompt")

llama() { # $1: label, rest: extra server flags
  local label=$1; shift
  "$LLAMA_SERVER" -m "$model" -t 2 -tb 2 -c 2048 --port 8091 "$@" > "$log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do curl -sf localhost:8091/health > /dev/null && break; sleep 0.5; done
  curl -s localhost:8091/completion -d "$body" > /dev/null  # warm-up
  curl -s localhost:8091/completion -d "$body" | python3 -c '
import json, sys
r = json.load(sys.stdin); t = r["timings"]
print(json.dumps({"engine": sys.argv[1], "tok_s": round(t["predicted_per_second"], 2), "tokens": t["predicted_n"],
  "drafted": t.get("draft_n"), "accepted": t.get("draft_n_accepted"), "text_sha": __import__("hashlib").sha256(r["content"].encode()).hexdigest()[:12]}))' "$label"
  kill $pid; wait $pid 2>/dev/null || true
}

ours() { # $1: label, rest: extra generate flags
  local label=$1; shift
  "$specula" generate -m gemma3-270m -p "$prompt" -n 256 --ignore-eos --json "$@" 2>/dev/null | python3 -c '
import json, sys, hashlib
j = json.load(sys.stdin); s = j.get("speculation") or {}
print(json.dumps({"engine": sys.argv[1], "tok_s": round(j["decode_tokens_per_s"], 2), "tokens": len(j["token_ids"]),
  "drafted": s.get("drafted"), "accepted": s.get("accepted"), "text_sha": hashlib.sha256(j["text"].encode()).hexdigest()[:12]}))' "$label"
}

for round in $(seq 1 "$rounds"); do
  echo "== round $round"
  llama "llama.cpp plain"
  llama "llama.cpp ngram-simple" --spec-type ngram-simple
  ours "specula plain"
  ours "specula ngram" --drafter ngram
done
