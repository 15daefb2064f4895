#!/usr/bin/env bash
# A probe priced whole: a build before and after, side by side, alternating, two rounds.
#   BEFORE=/path/to/old/specula AFTER=target/release/specula bash docs/benchmarks/probe-cost-zen3/run.sh
# SmolLM2-135M with the shipped DFlash drafter at --draft-len auto, each prompt starting cold and
# warm, against plain decoding; four evaluation sets, 10 prompts each, 128 tokens, T = 0 and 1
# (BUILD-ROUND/report.md). Both builds plan with one cached verify-cost curve (the first run
# measures it). summary.py tabulates the reports.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${BEFORE:?a build of the commit before}" "${AFTER:=target/release/specula}"
grep -m1 "model name" /proc/cpuinfo > "$here/cpu.txt"
grep -o -w 'avx2\|fma\|f16c\|avx512f\|avx512_vnni\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ' >> "$here/cpu.txt"
for round in 1 2; do
  for build in before after; do
    bin=$BEFORE; [ "$build" = after ] && bin=$AFTER
    "$bin" bench --mode spec -m smollm2-135m --drafter dflash:drafters/smollm2-135m-dflash \
      --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 --limit 10 --max-tokens 128 \
      --temperatures 0,1 --acceptance-history cold,warm --verify-curve cached --out-dir "$here/$build-$round" > /dev/null
  done
done
python3 "$here/summary.py" "$here" | tee "$here/summary.md"
