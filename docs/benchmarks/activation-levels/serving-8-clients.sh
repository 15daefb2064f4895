#!/usr/bin/env bash
# 8 streaming clients against `specula serve` (default ngram drafter), alternating the three
# activation settings of one build: completion tok/s, TTFT and ITL p50, drafted/accepted.
SPECULA=${SPECULA:-specula}; OUT=${OUT:-$(mktemp -d)}; mkdir -p $OUT
run() { local label=$1 port=$2 levels=$3
  SPECULA_ACTIVATION_LEVELS=$levels $SPECULA serve --port $port > $OUT/serve-$label.log 2>&1 & local pid=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 0.5; done
  $SPECULA loadtest --url http://127.0.0.1:$port --clients 8 --requests 32 --max-tokens 128 --ignore-eos --json > $OUT/lt-$label.json 2>/dev/null
  kill $pid; wait $pid 2>/dev/null
  python3 -c "import json,sys; r=json.load(open('$OUT/lt-$label.json')); r=r[0] if isinstance(r,list) else r; print('$label', r['requests_ok'], r['errors'], round(r['tokens_per_s'],1), round(r['ttft_p50_ms'],1), round(r['itl_p50_ms'],2), r['draft_n'], r['draft_n_accepted'])"
}
for r in 1 2; do
  run outliers-$r 8101 outliers
  run one-$r 8102 one
  run two-$r 8103 two
done
