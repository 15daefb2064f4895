#!/usr/bin/env bash
# How good the trainer's τ estimate is: the shipped SmolLM2 DFlash drafter on ShareGPT prompts
# 16,001–16,150, which no training run of it read. `train validate` simulates greedy verify
# steps on SmolLM2's own answers (validate.txt); `bench --mode spec` measures τ by real
# speculative decoding of the same prompts at 7 drafted tokens per step (report.md).
set -euo pipefail
SPECULA=${SPECULA:-target/release/specula}
OUT=${OUT:-$(dirname "$0")}
DATA=${DATA:-data/smollm2-sharegpt-16000}
$SPECULA train data --target smollm2-135m --prompts sharegpt --skip 16000 --limit 150 --max-new-tokens 256 \
    --max-prompt-tokens 320 --batch 16 --out "$DATA"
$SPECULA train validate --target smollm2-135m --drafter dflash:drafters/smollm2-135m-dflash --data "$DATA" \
    --all --val-examples 200 | tee "$OUT/validate.txt"
$SPECULA bench --mode spec -m smollm2-135m --dataset sharegpt --skip 16000 --limit 150 \
    --drafter dflash:drafters/smollm2-135m-dflash --draft-len 7 --draft-tree off --temperatures 0 \
    --max-tokens 256 --out-dir "$OUT"
