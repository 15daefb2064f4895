#!/usr/bin/env bash
# The SmolLM2 DFlash drafter's draft vocabulary, and 1,200 steps on fresh answers, on the four
# evaluation sets (20 prompts each, 256 tokens, greedy, 7 drafted tokens per step, chains), in
# one run beside the weights it started from:
#   before       runs/smollm2-dflash-b246aaf, run 11's weights (8,192 tokens picked from the first
#                ShareGPT answers);
#   vocab-16k    the same weights with 16,384 tokens re-picked from today's training mix
#                (one step at a vanishing learning rate: the weights do not move);
#   trained      1,200 steps from those weights on the same mix, fresh ShareGPT answers
#                (prompts 13,201–16,000) included, with the 16,384-token vocabulary.
set -euo pipefail
SPECULA=${SPECULA:-target/release/specula}
OUT=${OUT:-$(dirname "$0")}
RUNS=${RUNS:-runs}
# The weights before this run (run 11 of the lineage in docs/training.md), from git: drafters/ now
# holds the trained ones.
BASE=${BASE:-$RUNS/smollm2-dflash-b246aaf}
[ -f "$BASE/model.safetensors" ] || { mkdir -p "$BASE"; for f in config.json model.safetensors; do
    git show b246aaf:drafters/smollm2-135m-dflash/$f > "$BASE/$f"; done; }
DATA=data/smollm2-sharegpt-13200,data/smollm2-rgmath,data/smollm2-codeio-completion,data/smollm2-sharegpt-12000
[ -d data/smollm2-sharegpt-13200 ] || $SPECULA train data --target smollm2-135m --prompts sharegpt --skip 13200 \
    --limit 2800 --max-new-tokens 256 --max-prompt-tokens 320 --batch 16 --features dflash \
    --out data/smollm2-sharegpt-13200
$SPECULA train dflash --target smollm2-135m --data $DATA --out $RUNS/vocab-16k \
    --init-from "$BASE" --draft-vocab 16384 --anchors 96 --batch 2 --steps 1 \
    --lr 1e-12 --weight-decay 0 --val-examples 64 --seed 12
$SPECULA train dflash --target smollm2-135m --data $DATA --out $RUNS/s12 \
    --init-from "$BASE" --draft-vocab 16384 --anchors 96 --batch 2 --steps 1200 \
    --lr 3e-4 --checkpoint-every 300 --log-every 20 --val-examples 64 --seed 12
$SPECULA bench --mode spec -m smollm2-135m --dataset gsm8k-100 --dataset humaneval --dataset mt-bench \
    --dataset math500 --limit 20 --max-tokens 256 --temperatures 0 --draft-len 7 --draft-tree off \
    --drafter dflash:"$BASE",draft-max=7 --drafter dflash:$RUNS/vocab-16k/drafter,draft-max=7 \
    --drafter dflash:$RUNS/s12/drafter,draft-max=7 --out-dir "$OUT"
# The trained weights (runs/s12/drafter) are what drafters/smollm2-135m-dflash holds. τ is the measure here: the run
# shared the machine with a test suite, so its tok/s and speedups are not comparable.
