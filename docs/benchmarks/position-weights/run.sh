#!/usr/bin/env bash
# Loss weights by block offset that follow serving, against γ's decay: both fine-tune the shipped
# SmolLM2 DFlash drafter for 240 steps on the same fresh answers, then decode the evaluation sets.
#   bash docs/benchmarks/position-weights/run.sh        (from the repository root, ~35 min on 2 cores)
set -euo pipefail
here=docs/benchmarks/position-weights
bin=target/release/specula
grep -m1 "model name" /proc/cpuinfo > "$here/cpu.txt"
grep -o -w 'avx2\|fma\|f16c\|avx512f\|avx512_vnni\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ' >> "$here/cpu.txt"
# 1. Serving use: how often the verifier reached each draft position, at --draft-len auto, on
#    ShareGPT prompts the drafter never saw (16,151-16,180).
$bin bench --mode spec -m smollm2-135m --drafter dflash:drafters/smollm2-135m-dflash --dataset sharegpt \
  --skip 16150 --limit 30 --max-tokens 128 --temperatures 0 --verify-curve cached --out-dir $here/serving-use > /dev/null
# 2. Fresh answers (ShareGPT 16,201-16,700), then two fine-tunes that differ only in the weights.
$bin train data --target smollm2-135m --prompts sharegpt --skip 16200 --limit 500 --max-new-tokens 256 \
  --out runs/pw-sharegpt-16200
common=(--target smollm2-135m --init-from drafters/smollm2-135m-dflash --draft-vocab keep
        --data runs/pw-sharegpt-16200 --steps 240)
$bin train dflash "${common[@]}" --out runs/pw-gamma2 2>&1 | tail -n 1 > $here/train-gamma2.txt
$bin train dflash "${common[@]}" --position-weights serving:$here/serving-use/report.json --out runs/pw-serving \
  2>&1 | grep -E '^position weights|^240 of 240' > $here/train-serving.txt
# 3. The evaluation sets: the shipped drafter and both fine-tunes, 7 drafted tokens per step and auto.
$bin bench --mode spec -m smollm2-135m --drafter dflash:drafters/smollm2-135m-dflash \
  --drafter dflash:runs/pw-gamma2/drafter --drafter dflash:runs/pw-serving/drafter --draft-len 7 --draft-len auto \
  --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 --limit 10 --max-tokens 128 \
  --temperatures 0 --verify-curve cached --out-dir $here/eval > /dev/null
