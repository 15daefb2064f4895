#!/bin/bash
# Alternating serving A/B at one client count: for each round and each binary, the prefill
# reference (`bench --mode ar`), then a fresh server, one warm-up round and one measured
# 8-client round (128 tokens per request, --ignore-eos, no speculation unless EXTRA is set).
# Prints completion and total (prompt + completion) tok/s and their ratio to that prefill.
# usage: OUT=dir [C=8] [ROUNDS=3] [EXTRA="--no-speculate"] tools/serve_ab.sh BIN_A BIN_B ...
set -u
OUT=${OUT:-runs/serve-ab}; C=${C:-8}; ROUNDS=${ROUNDS:-3}; EXTRA=${EXTRA-"--no-speculate"}
PORT=${PORT:-8091}
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  i=0
  for b in "$@"; do
    i=$((i+1))
    "$b" bench --mode ar -m smollm2-135m --repeats 1 --max-m 8 --prefill-tokens 512 --decode-tokens 64 2>/dev/null | tail -1 > "$OUT/ar-$i-r$r.txt"
    "$b" serve --port "$PORT" > "$OUT/server-$i-r$r.log" 2>&1 &
    SP=$!
    for k in $(seq 1 120); do curl -sf "127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
    "$b" loadtest --url "http://127.0.0.1:$PORT" --clients "$C" --requests "$C" --max-tokens 32 --ignore-eos $EXTRA --json > /dev/null 2>&1
    "$b" loadtest --url "http://127.0.0.1:$PORT" --clients "$C" --requests $((4*C)) --max-tokens 128 --ignore-eos $EXTRA --json > "$OUT/lt-$i-r$r.json" 2>>"$OUT/err.txt"
    kill $SP; wait $SP 2>/dev/null
    python3 - "$OUT/lt-$i-r$r.json" "$OUT/ar-$i-r$r.txt" "$b" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
d = d[0] if isinstance(d, list) else d
prefill = float(open(sys.argv[2]).read().split('|')[3])
c, t = d['tokens_per_s'], d['total_tokens_per_s']
print(f"{sys.argv[3]:32s} prefill {prefill:7.1f}  completion {c:7.1f} ({c/prefill:.2f})  total {t:7.1f} ({t/prefill:.2f})  errors {d['errors']}")
PY
  done
done
