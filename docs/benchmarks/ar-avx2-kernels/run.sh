#!/usr/bin/env bash
# Alternating rounds on one quiet AVX2 machine (no AVX-512): specula on its own kernels (the
# default; on AVX2 they run as two 256-bit halves) against the same binary with its kernels off
# (SPECULA_NO_VNNI_KERNELS=1: candle's kernels and the weight format chosen for them), and
# llama.cpp's llama-bench on the same file when LLAMA_BENCH is set.
#
#   [LLAMA_BENCH=/path/to/llama-bench] bash docs/benchmarks/ar-avx2-kernels/run.sh MODEL ROUNDS
set -euo pipefail
model=$1
rounds=${2:-2}
specula=${SPECULA:-target/release/specula}
file=$("$specula" fetch "$model" 2>/dev/null | tail -1 | sed 's/^[^:]*: //')
grep -m1 -o 'avx512[a-z_]*' /proc/cpuinfo && echo "note: this CPU has AVX-512; the default runs the AVX-512 kernels"
for round in $(seq 1 "$rounds"); do
  echo "== round $round"
  echo "-- specula default"
  "$specula" bench --mode ar -m "$model" --repeats 1 --max-m 8 --prefill-tokens 512 --decode-tokens 64 2>&1 | grep -E '^\|'
  echo "-- specula SPECULA_NO_VNNI_KERNELS=1"
  SPECULA_NO_VNNI_KERNELS=1 "$specula" bench --mode ar -m "$model" --repeats 1 --max-m 8 --prefill-tokens 512 --decode-tokens 64 2>&1 | grep -E '^\|'
  if [ -n "${LLAMA_BENCH:-}" ]; then
    echo "-- llama.cpp"
    "$LLAMA_BENCH" -m "$file" -t 2 -r 1 -p 512 -n 64 2>&1 | grep -E '^\|'
  fi
done
