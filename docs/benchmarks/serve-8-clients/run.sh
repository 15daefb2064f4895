#!/usr/bin/env bash
# SmolLM2-135M served with prompt lookup (the default drafter) against --drafter none, 8 clients,
# 32 requests of 128 tokens on the built-in prompts, alternating, two rounds. Run on a quiet
# machine from the repository root:
#   PATH=$PWD/target/release:$PATH bash docs/benchmarks/serve-8-clients/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
{ grep -m1 "model name" /proc/cpuinfo; grep -o -w 'avx512_vnni\|amx_int8\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } > "$here/cpu.txt"
out="$here/results.txt"; : > "$out"
for round in 1 2; do
  for drafter in none ngram; do
    specula serve -m smollm2-135m --drafter "$drafter" --port 18091 > /dev/null 2>&1 &
    server=$!
    for _ in $(seq 120); do curl -s localhost:18091/health >/dev/null 2>&1 && break; sleep 0.5; done
    specula loadtest --url http://127.0.0.1:18091 --clients 8 --requests 32 --max-tokens 128 2>&1 | tail -1 \
      | sed "s/^/round $round --drafter $drafter: /" | tee -a "$out"
    kill "$server"; wait "$server" 2>/dev/null || true
  done
done
