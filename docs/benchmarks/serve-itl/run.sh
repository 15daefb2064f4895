#!/usr/bin/env bash
# The server's inter-token latency at 1 client against bench --mode ar's decode step on the same
# model and context length, alternating, two rounds: SmolLM2-135M, --drafter none, 16 requests of
# 128 tokens (--ignore-eos). The engine's debug log gives each step's forward and whole-step time,
# so the time outside the forward is measured directly. Run on a quiet machine:
#   PATH=$PWD/target/release:$PATH bash docs/benchmarks/serve-itl/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
{ grep -m1 "model name" /proc/cpuinfo; grep -o -w 'avx512_vnni\|amx_int8\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } > "$here/cpu.txt"
out="$here/results.txt"; : > "$out"
log=$(mktemp)
for round in 1 2; do
  specula bench --mode ar -m smollm2-135m --decode-tokens 128 --repeats 3 --max-m 2 --batch 0 2>/dev/null | tail -1 \
    | awk -F'|' -v r=$round '{printf "round %s bench ar: decode %s tok/s = %.2f ms per token\n", r, $5, 1000/$5}' | tee -a "$out"
  RUST_LOG=specula::engine=debug specula serve -m smollm2-135m --drafter none --port 18090 > "$log" 2>&1 &
  server=$!
  for _ in $(seq 120); do curl -s localhost:18090/health >/dev/null 2>&1 && break; sleep 0.5; done
  specula loadtest --url http://127.0.0.1:18090 --clients 1 --requests 16 --max-tokens 128 --ignore-eos 2>&1 | tail -1 \
    | grep -o "ITL median *[0-9.]* ms p99 *[0-9.]* ms" | sed "s/^/round $round serve: /" | tee -a "$out"
  kill "$server"; wait "$server" 2>/dev/null || true
  python3 - "$log" <<'PY' | sed "s/^/round $round serve engine: /" | tee -a "$out"
import re, statistics as st, sys
fw, step = [], []
for line in open(sys.argv[1]):
    m = re.search(r'rows=1 .*forward_ms=([\d.]+) step_ms=([\d.]+)', line)
    if m:
        fw.append(float(m.group(1))); step.append(float(m.group(2)))
f, s = st.median(fw), st.median(step)
print(f"{len(fw)} decode steps: forward median {f:.3f} ms, step median {s:.3f} ms, outside the forward {s - f:.3f} ms ({(s - f) / s:.1%})")
PY
done
rm -f "$log"
