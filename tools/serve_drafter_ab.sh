#!/bin/bash
# Alternating serving A/B of two drafters on one binary: for each round, a fresh server per
# drafter, one warm-up request, then 16 requests of 256 tokens (--ignore-eos) from each data set
# at 1, 4 and 8 clients. Writes the loadtest JSON per drafter, data set and round to $OUT.
# usage: [B=target/release/specula] [OUT=dir] [ROUNDS=3] tools/serve_drafter_ab.sh ngram auto
set -u
B=${B:-target/release/specula}; OUT=${OUT:-runs/serve-drafter-ab}; ROUNDS=${ROUNDS:-3}; PORT=${PORT:-8093}
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
  for d in "$@"; do
    "$B" serve --port "$PORT" --drafter "$d" > "$OUT/server-$d-r$r.log" 2>&1 &
    SP=$!
    for k in $(seq 1 120); do curl -sf "127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
    "$B" loadtest --url "http://127.0.0.1:$PORT" --clients 1 --requests 2 --max-tokens 32 > /dev/null 2>&1
    for ds in humaneval mt-bench; do
      "$B" loadtest --url "http://127.0.0.1:$PORT" --clients 1,4,8 --requests 16 --max-tokens 256 --ignore-eos \
        --dataset "$ds" --json > "$OUT/lt-$d-$ds-r$r.json" 2>> "$OUT/err.txt"
    done
    kill $SP; wait $SP 2>/dev/null
  done
done
