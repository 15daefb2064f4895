#!/usr/bin/env bash
# Sampling at temperature > 0: a build before and after, side by side, alternating, two rounds.
#   BEFORE=/path/to/old/specula AFTER=target/release/specula bash docs/benchmarks/sampling-zen3/run.sh
# SmolLM2-135M, plain decoding and the shipped DFlash drafter and suffix decoding at
# --draft-len auto, four evaluation sets, 10 prompts each, 128 tokens, T = 0 and 1
# (BUILD-ROUND/report.md); steps.py prints each report's time per step outside the forward.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${BEFORE:?a build of the commit before}" "${AFTER:=target/release/specula}"
grep -m1 "model name" /proc/cpuinfo > "$here/cpu.txt"
grep -o -w 'avx2\|fma\|f16c\|avx512f\|avx512_vnni\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ' >> "$here/cpu.txt"
for round in 1 2; do
  for build in before after; do
    bin=$BEFORE; [ "$build" = after ] && bin=$AFTER
    "$bin" bench --mode spec -m smollm2-135m --drafter dflash:drafters/smollm2-135m-dflash --drafter suffix \
      --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 --limit 10 --max-tokens 128 \
      --temperatures 0,1 --out-dir "$here/$build-$round" > /dev/null
  done
done
for d in "$here"/*-[12]; do echo "== $(basename "$d")"; python3 "$here/steps.py" "$d/report.json"; done | tee "$here/steps.txt"
