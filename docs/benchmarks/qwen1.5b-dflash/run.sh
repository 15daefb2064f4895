#!/usr/bin/env bash
# A DFlash drafter for Qwen2.5-Coder-1.5B trained from scratch on the 1.5B's own answers with
# cached features, then measured on humaneval and gsm8k-100 beside the 0.5B draft model.
#   data   the 1.5B's greedy answers to reasoning-gym-math and codeio-completion prompts, its
#          features (5 default taps) written on the same pass (`train data --features dflash`);
#   train  two layers of the 1.5B's attention shape, MLP 2,048, block 8, 96 anchors, batch 2;
#   bench  τ at 7 drafted tokens per step (chains), then `--draft-len auto` speedups.
# Every stage resumes: `train data` continues a directory, `train dflash --resume` a run.
# Usage: run.sh [data] [train] [bench] (default: all three).
set -euo pipefail
SPECULA=${SPECULA:-target/release/specula}
OUT=${OUT:-$(dirname "$0")}
RUNS=${RUNS:-runs}
LIMIT=${LIMIT:-900}
STEPS=${STEPS:-1000}
STAGES=${*:-data train bench}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
D="$SPECULA train data --target qwen2.5-coder-1.5b --max-new-tokens 256 --max-prompt-tokens 320 --batch 16 --features dflash --max-tokens 640"
stage data && $D --prompts reasoning-gym-math --limit "$LIMIT" --out data/qwen2.5-coder-1.5b-rgmath
stage data && $D --prompts codeio-completion --skip 65 --limit "$LIMIT" --out data/qwen2.5-coder-1.5b-completion-65
DATA=data/qwen2.5-coder-1.5b-rgmath,data/qwen2.5-coder-1.5b-completion-65
stage train && $SPECULA train dflash --target qwen2.5-coder-1.5b --data $DATA --out $RUNS/q15-dflash \
    --features offline --layers 2 --ffn 2048 --n-taps 5 --attention-bias --block 8 --anchors 96 --batch 2 \
    --steps "$STEPS" --lr 1e-3 --gamma 2 --max-tokens 640 --checkpoint-every 100 --log-every 20 \
    --val-examples 32 ${RESUME:+--resume}
# τ at 7 drafted tokens per step, chains (the goal's measure), 10 prompts per set.
DRAFTER=${DRAFTER:-$RUNS/q15-dflash/drafter}
stage bench || exit 0
$SPECULA bench --mode spec -m qwen2.5-coder-1.5b --drafter dflash:"$DRAFTER",draft-max=7 --draft-len 7 \
    --draft-tree off --dataset humaneval --dataset gsm8k-100 --limit 10 --max-tokens 128 --temperatures 0 \
    --out-dir "$OUT/tau-k7"
# Speed at `--draft-len auto` (trees where the drafter has them) beside the 0.5B draft model, and
# each behind prompt lookup, all planned with one verify-cost curve measured at the start.
DM=draft-model:qwen2.5-coder-0.5b,weights=q4_0,vocab=32768
$SPECULA bench --mode spec -m qwen2.5-coder-1.5b --drafter "$DM" --drafter "ngram+$DM" \
    --drafter dflash:"$DRAFTER" --drafter ngram+dflash:"$DRAFTER" --draft-len auto \
    --dataset humaneval --dataset gsm8k-100 --limit 10 --max-tokens 128 --temperatures 0 --out-dir "$OUT/auto"
# The validation estimate against τ measured on prompts of the training kind it never saw.
$SPECULA bench --mode spec -m qwen2.5-coder-1.5b --drafter dflash:"$DRAFTER",draft-max=7 --draft-len 7 \
    --draft-tree off --dataset codeio-completion --dataset reasoning-gym-math --skip 1200 --limit 5 \
    --max-tokens 256 --temperatures 0 --out-dir "$OUT/unseen-k7"
