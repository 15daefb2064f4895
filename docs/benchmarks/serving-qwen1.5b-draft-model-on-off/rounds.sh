#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B served alone, 1 client, 8 requests of 128 tokens (loadtest's default prompts):
# alternating new build with the 0.5B draft model, new build without a drafter, base build with the draft model.
BASE=${BASE:?the build to compare with}; NEW=${NEW:-specula}; OUT=${OUT:-$(mktemp -d)}; mkdir -p $OUT
run() { local label=$1 port=$2; shift 2
  "$@" > $OUT/serve-$label.log 2>&1 & local pid=$!
  for i in $(seq 1 600); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 0.5; done
  $NEW loadtest --url http://127.0.0.1:$port --clients 1 --requests 8 --max-tokens 128 --json > $OUT/lt-$label.json 2>/dev/null
  kill $pid; wait $pid 2>/dev/null
  python3 -c "import json,sys; r=json.load(open('$OUT/lt-$label.json')); r=r[0] if isinstance(r,list) else r; print('$label', r['requests_ok'], r['errors'], r['completion_tokens'], round(r['tokens_per_s'],2), round(r['ttft_p50_ms'],1), r['draft_n'], r['draft_n_accepted'])"
}
for r in 1 2; do
  run newspec-$r 8111 $NEW serve --port 8111 -m qwen2.5-coder-1.5b --drafter draft-model:qwen2.5-coder-0.5b
  run newplain-$r 8112 $NEW serve --port 8112 -m qwen2.5-coder-1.5b --drafter none
  run basespec-$r 8113 $BASE serve --port 8113 -m qwen2.5-coder-1.5b --drafter draft-model:qwen2.5-coder-0.5b
  run baseplain-$r 8114 $BASE serve --port 8114 -m qwen2.5-coder-1.5b --drafter none
done
