#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B served without a drafter, with the 0.5B draft model as in its file, and with
# it in Q4_0 cut to its first 32,768 token ids; one client, 8 requests of 128 tokens on
# loadtest's built-in prompts, the three servers in turn, two rounds (serve.txt). From the
# repository root on a quiet machine:
#   PATH=$PWD/target/release:$PATH bash docs/benchmarks/draft-model-settings-zen4/serve.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/serve.txt"; : > "$out"
for round in 1 2; do
  for drafter in none draft-model:qwen2.5-coder-0.5b draft-model:qwen2.5-coder-0.5b,weights=q4_0,vocab=32768; do
    specula serve qwen2.5-coder-1.5b --drafter "$drafter" --port 18093 > /dev/null 2>&1 &
    server=$!
    for _ in $(seq 240); do curl -sf localhost:18093/ready >/dev/null 2>&1 && break; sleep 0.5; done
    specula loadtest --url http://127.0.0.1:18093 --clients 1 --requests 8 --max-tokens 128 2>&1 \
      | tail -1 | sed "s/^/round $round, --drafter $drafter: /" | tee -a "$out"
    kill "$server"; wait "$server" 2>/dev/null || true
  done
done
