#!/usr/bin/env bash
# One planner threshold: a build before and after, side by side, alternating, on a quiet machine.
#   BEFORE=/path/to/old/specula AFTER=target/release/specula bash docs/benchmarks/one-planner-zen3/run.sh
# 1. SmolLM2-135M with DFlash, prompt lookup + DFlash and suffix decoding at --draft-len auto,
#    four evaluation sets, 10 prompts each, T = 0 and 1, two rounds (smollm2-BUILD-ROUND/).
# 2. Qwen2.5-Coder-1.5B with the 0.5B draft model, 5 prompts each of humaneval and gsm8k-100,
#    greedy, each prompt starting with nothing known (cold) or from the acceptance of the set's
#    earlier prompts (warm), as on a running server (qwen-HISTORY-BUILD/).
# 3. Serving SmolLM2 with `suffix` (serve's default) and `ngram+dflash`, `specula loadtest` at
#    1, 4 and 8 clients, two rounds (serve.txt).
# Each report's speedups are against plain decoding run prompt by prompt in the same run.
# smollm2-ngram-dflash-*/ and serve-ngram-dflash.txt are parts 1 and 3 with --drafter ngram+dflash alone,
# run again on the final build (the verify excess kept per drafter).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${BEFORE:?a build of the commit before}" "${AFTER:=target/release/specula}"
dflash=drafters/smollm2-135m-dflash
grep -m1 "model name" /proc/cpuinfo > "$here/cpu.txt"
grep -o -w 'avx2\|fma\|f16c\|avx512f\|avx512_vnni\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ' >> "$here/cpu.txt"
for round in 1 2; do
  for build in before after; do
    bin=$BEFORE; [ "$build" = after ] && bin=$AFTER
    "$bin" bench --mode spec -m smollm2-135m --drafter dflash:$dflash --drafter ngram+dflash:$dflash --drafter suffix \
      --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 --limit 10 --max-tokens 128 \
      --temperatures 0,1 --out-dir "$here/smollm2-$build-$round" > /dev/null
  done
done
for history in warm cold; do
  for build in before after; do
    bin=$BEFORE; [ "$build" = after ] && bin=$AFTER
    "$bin" bench --mode spec -m qwen2.5-coder-1.5b --drafter draft-model:qwen2.5-coder-0.5b \
      --dataset humaneval --dataset gsm8k-100 --limit 5 --temperatures 0 --acceptance-history $history \
      --out-dir "$here/qwen-$history-$build" > /dev/null
  done
done
out="$here/serve.txt"; : > "$out"
for round in 1 2; do
  for drafter in suffix "ngram+dflash:$dflash"; do
    for clients in 1 4 8; do
      for build in before after; do
        bin=$BEFORE; [ "$build" = after ] && bin=$AFTER
        "$bin" serve -m smollm2-135m --drafter "$drafter" --port 18093 > /dev/null 2>&1 &
        server=$!
        for _ in $(seq 240); do curl -sf localhost:18093/ready > /dev/null 2>&1 && break; sleep 0.5; done
        "$AFTER" loadtest --url http://127.0.0.1:18093 --clients $clients --requests $((clients == 1 ? 24 : 64)) \
          --max-tokens 128 2>&1 | tail -1 | sed "s|^|round $round, $drafter, $build: |" >> "$out"
        kill "$server"; wait "$server" 2>/dev/null || true
      done
    done
  done
done
