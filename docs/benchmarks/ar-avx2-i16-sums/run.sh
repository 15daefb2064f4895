#!/usr/bin/env bash
# Alternating rounds on one quiet AVX2 machine: two specula builds, BEFORE and AFTER, on the same
# model with `bench --mode ar` (prefill, decode, decode of 8 rows, and the verify curve).
#
#   BEFORE=path/to/old/specula AFTER=path/to/new/specula bash docs/benchmarks/ar-avx2-i16-sums/run.sh MODEL ROUNDS
set -euo pipefail
model=$1
rounds=${2:-3}
grep -m1 -o 'avx512[a-z_]*' /proc/cpuinfo && echo "note: this CPU has AVX-512; the AVX2 kernels do not run by default"
grep -m1 'model name' /proc/cpuinfo
grep -m1 'cpu family' /proc/cpuinfo
for round in $(seq 1 "$rounds"); do
  for build in BEFORE AFTER; do
    echo "== round $round: $build"
    "${!build}" bench --mode ar -m "$model" --repeats 1 --max-m 8 --prefill-tokens 512 --decode-tokens 64 2>&1 | grep -E '^\|'
  done
done
