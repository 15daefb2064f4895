#!/usr/bin/env bash
# Alternating rounds on one quiet machine: specula with the k-quant matrices on its own kernels
# (default), the same binary with its kernels off (SPECULA_NO_VNNI_KERNELS=1: candle's k-quant
# kernels, the previous default for these files), and llama.cpp's llama-bench on the same file.
#
#   LLAMA_BENCH=/path/to/llama-bench bash docs/benchmarks/ar-kquant-kernels/run.sh MODEL ROUNDS [OFF]
#
# MODEL is a key (`specula fetch MODEL` first); OFF=0 skips the kernels-off arm.
set -euo pipefail
model=$1
rounds=${2:-3}
off=${3:-1}
specula=${SPECULA:-target/release/specula}
file=$("$specula" fetch "$model" 2>/dev/null | tail -1 | sed 's/^[^:]*: //')
for round in $(seq 1 "$rounds"); do
  echo "== round $round"
  echo "-- specula default"
  "$specula" bench --mode ar -m "$model" --repeats 1 --max-m 8 --prefill-tokens 512 --decode-tokens 64 2>&1 | grep -E '^\|'
  if [ "$off" = 1 ]; then
    echo "-- specula SPECULA_NO_VNNI_KERNELS=1"
    SPECULA_NO_VNNI_KERNELS=1 "$specula" bench --mode ar -m "$model" --repeats 1 --max-m 8 --prefill-tokens 512 --decode-tokens 64 2>&1 | grep -E '^\|'
  fi
  echo "-- llama.cpp"
  "$LLAMA_BENCH" -m "$file" -t 2 -r 1 -p 512 -n 64 2>&1 | grep -E '^\|'
done
