#!/usr/bin/env bash
# EAGLE-3 with EAGLE-2's dynamic trees against its chains: the shipped SmolLM2-135M drafter, 7 nodes
# per step and --draft-len auto, four evaluation sets, 10 prompts each, 128 tokens, greedy.
#   bash docs/benchmarks/eagle3-trees/run.sh        (from the repository root)
set -euo pipefail
here=docs/benchmarks/eagle3-trees
grep -m1 "model name" /proc/cpuinfo > "$here/cpu.txt"
grep -o -w 'avx2\|fma\|f16c\|avx512f\|avx512_vnni\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ' >> "$here/cpu.txt"
target/release/specula bench --mode spec -m smollm2-135m --drafter eagle3:drafters/smollm2-135m-eagle3 \
  --draft-len 7 --draft-len auto --draft-tree off,auto \
  --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 --limit 10 --max-tokens 128 \
  --temperatures 0 --verify-curve cached --out-dir $here > /dev/null
# The tree EAGLE-3 drafted before (runner-ups as leaves, the chain continuing from the best), at
# 7 nodes, from a build of the commit before (BEFORE=/path/to/old/specula).
if [ -n "${BEFORE:-}" ]; then
  "$BEFORE" bench --mode spec -m smollm2-135m --drafter eagle3:drafters/smollm2-135m-eagle3 \
    --draft-len 7 --draft-tree auto \
    --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 --limit 10 --max-tokens 128 \
    --temperatures 0 --verify-curve cached --out-dir $here/leaves-before > /dev/null
fi
