#!/usr/bin/env bash
# End to end after the AMX kernels, each drafter side by side with plain decoding in its own run:
# SmolLM2-135M with its DFlash drafter, alone and behind prompt lookup, on the four evaluation
# sets (10 prompts, 128 tokens, greedy and T = 1, --draft-len auto); Qwen2.5-Coder-1.5B with the
# 0.5B draft model on humaneval and gsm8k-100. Run on a quiet machine from the repository root:
#   PATH=$PWD/target/release:$PATH bash docs/benchmarks/spec-after-amx/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
{ grep -m1 "model name" /proc/cpuinfo; grep -o -w 'avx512_vnni\|amx_int8\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } > "$here/cpu.txt"
specula bench --mode spec -m smollm2-135m --drafter dflash:drafters/smollm2-135m-dflash \
  --drafter ngram+dflash:drafters/smollm2-135m-dflash --draft-len auto \
  --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 \
  --limit 10 --max-tokens 128 --temperatures 0,1 --out-dir "$here/smollm2"
specula bench --mode spec -m qwen2.5-coder-1.5b --drafter draft-model:qwen2.5-coder-0.5b --draft-len auto \
  --dataset humaneval --dataset gsm8k-100 --limit 10 --max-tokens 128 --temperatures 0,1 --out-dir "$here/qwen1.5b"
