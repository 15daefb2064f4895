#!/usr/bin/env bash
# The verify-cost curve and the profile of a verify block of SmolLM2-135M and Qwen2.5-Coder-1.5B
# on a CPU with AVX2 but no AVX-512: two builds side by side, BEFORE and AFTER, alternating, three
# rounds, each with --profile. Run on a quiet machine:
#   BEFORE=/path/to/old/specula AFTER=target/release/specula bash docs/benchmarks/verify-curve-avx2/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${BEFORE:?a build of the commit before}" "${AFTER:=target/release/specula}"
grep -m1 "model name" /proc/cpuinfo | tee "$here/cpu.txt"
grep -o -w 'avx2\|fma\|f16c\|avx512f\|avx512_vnni\|avx_vnni\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ' | tee -a "$here/cpu.txt"; echo | tee -a "$here/cpu.txt"
: > "$here/curves.txt"
for model in smollm2-135m qwen2.5-coder-1.5b; do
  for round in 1 2 3; do
    for build in before after; do
      bin=$BEFORE; [ "$build" = after ] && bin=$AFTER
      out="$here/profile-$model-$build-$round.md"
      "$bin" bench --mode ar -m "$model" --repeats 3 --max-m 16 --profile 2>/dev/null > "$out"
      grep "^| $model" "$out" | sed "s/^/$build round $round: /" | tee -a "$here/curves.txt"
    done
  done
done
