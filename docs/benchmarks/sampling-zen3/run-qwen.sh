#!/usr/bin/env bash
# The same comparison for Qwen2.5-Coder-1.5B (a 152k vocabulary) with the 0.5B draft model at
# --draft-len auto: humaneval and gsm8k-100, 5 prompts each, 128 tokens, T = 1, each prompt
# starting from the acceptance of the set's earlier ones (as on a running server), two rounds.
#   BEFORE=/path/to/old/specula AFTER=target/release/specula bash docs/benchmarks/sampling-zen3/run-qwen.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${BEFORE:?a build of the commit before}" "${AFTER:=target/release/specula}"
for round in 1 2; do
  for build in before after; do
    bin=$BEFORE; [ "$build" = after ] && bin=$AFTER
    "$bin" bench --mode spec -m qwen2.5-coder-1.5b --drafter draft-model:qwen2.5-coder-0.5b \
      --dataset humaneval --dataset gsm8k-100 --limit 5 --max-tokens 128 --temperatures 1 \
      --acceptance-history warm --out-dir "$here/qwen-$build-$round" > /dev/null
  done
done
for d in "$here"/qwen-*-[12]; do echo "== $(basename "$d")"; python3 "$here/steps.py" "$d/report.json"; done | tee "$here/steps-qwen.txt"
