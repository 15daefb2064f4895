#!/usr/bin/env bash
# The verify-cost curve of SmolLM2-135M and Qwen2.5-Coder-1.5B, two builds side by side:
# BEFORE (a build of the commit before the AMX kernels) and AFTER (this one), alternating,
# two rounds, then AFTER with SPECULA_NO_AMX=1 and AFTER's --profile. Run on a quiet machine:
#   BEFORE=/path/to/old/specula AFTER=target/release/specula bash docs/benchmarks/verify-curve-amx/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${BEFORE:?a build of the commit before}" "${AFTER:=target/release/specula}"
grep -m1 "model name" /proc/cpuinfo | tee "$here/cpu.txt"
grep -o -w 'avx512_vnni\|amx_int8\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ' | tee -a "$here/cpu.txt"; echo | tee -a "$here/cpu.txt"
for model in smollm2-135m qwen2.5-coder-1.5b; do
  for round in 1 2; do
    for build in before after; do
      bin=$BEFORE; [ "$build" = after ] && bin=$AFTER
      "$bin" bench --mode ar -m "$model" --repeats 3 --max-m 16 2>/dev/null | tail -1 | sed "s/^/$build round $round: /" | tee -a "$here/curves.txt"
    done
  done
  SPECULA_NO_AMX=1 "$AFTER" bench --mode ar -m "$model" --repeats 3 --max-m 16 2>/dev/null | tail -1 | sed "s/^/after, SPECULA_NO_AMX=1: /" | tee -a "$here/curves.txt"
  "$AFTER" bench --mode ar -m "$model" --repeats 3 --max-m 16 --profile --out "$here/profile-$model.json" 2>/dev/null | tee "$here/profile-$model.md"
done
