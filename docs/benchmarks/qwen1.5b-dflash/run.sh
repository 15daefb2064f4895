#!/usr/bin/env bash
# A DFlash drafter for Qwen2.5-Coder-1.5B trained from scratch on the 1.5B's own answers with
# cached features, then measured on humaneval and gsm8k-100 beside the 0.5B draft model.
#   data1   the 1.5B's greedy answers to the first 900 reasoning-gym-math prompts and
#           codeio-completion prompts 66-965, its features (5 default taps) written on the same
#           pass (`train data --features dflash`);
#   train1  two layers of the 1.5B's attention shape, MLP 2,048, block 8, 96 anchors, batch 2:
#           800 steps of a 1,000-step schedule at peak 1e-3 (runs/q15-dflash);
#   data2   both directories continued to 1,200 prompts each;
#   train2  from train1's drafter, 1,000 steps at peak 6e-4 on all 2,400 answers
#           (runs/q15-dflash-2);
#   data3   the 1.5B's answers to the first 600 `word-problems` prompts (word problems it
#           wrote itself, tools/prompt_sets/make_word_problems.py), with their features;
#   train3  from train2's drafter, 1,000 steps at peak 4e-4 on all
#           three directories (runs/q15-dflash-3);
#   data4   the 1.5B's completions of the first 250 `function-stubs` prompts (Python function
#           stubs it wrote itself, tools/prompt_sets/make_function_stubs.py), with features;
#   train4  from train3's drafter, 600 steps at peak 3e-4 on the code,
#           word-problem and stub directories (runs/q15-dflash-4: the drafter measured);
#   data5   the 1.5B's answers to the word problems and function stubs it wrote next
#           (`word-problems` from 658 on, `function-stubs` from 276 on: instructions 720-1,199
#           of each script), with their features;
#   train5  from train4's drafter, 600 steps at peak 3e-4 on every code, word-problem and stub
#           directory (runs/q15-dflash-5: the drafter measured);
#   data6   the 1.5B's answers to the word problems and function stubs it wrote third
#           (`word-problems` from 1,096 on, `function-stubs` from 412 on: instructions
#           1,200-1,679 of each script), with their features;
#   train6  from train5's drafter, 600 steps at peak 3e-4 on every code, word-problem and stub
#           directory (runs/q15-dflash-6);
#   unseen-data  the 1.5B's answers to prompts of the four training kinds that no run reads
#           (word-problems 601-657, function-stubs 251-275, codeio-completion 1,301-1,330,
#           reasoning-gym-math 1,301-1,352), with features: the serving simulation on them is
#           checked against real speculative decoding of the same prompts;
#   bench   the drafter of train5 (DRAFTER= for another): τ at 7 drafted tokens per step
#           (chains) on the four evaluation sets, `--draft-len auto` speedups beside the 0.5B
#           draft model, and τ on the unseen prompts, against the validation estimate and the
#           simulation on their own answers; reports in $OUT/run5 (BENCH=).
# Every stage resumes: `train data` continues a directory, and with RESUME=1 `train dflash
# --resume` a run (--stop-after counts from the checkpoint: resuming train1 at step s, give
# STOP1=$((800 - s))).
# Usage: run.sh [data1] [train1] [data2] [train2] [data3] [train3] [data4] [train4] [data5] [train5]
#     [data6] [train6] [unseen-data] [bench]
# (default: all, in this order).
set -euo pipefail
SPECULA=${SPECULA:-target/release/specula}
OUT=${OUT:-$(dirname "$0")}
RUNS=${RUNS:-runs}
STAGES=${*:-data1 train1 data2 train2 data3 train3 data4 train4 data5 train5 data6 train6 unseen-data bench}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
D="$SPECULA train data --target qwen2.5-coder-1.5b --max-new-tokens 256 --max-prompt-tokens 320 --batch 16 --features dflash --max-tokens 640"
data() {
    $D --prompts reasoning-gym-math --limit "$1" --out data/qwen2.5-coder-1.5b-rgmath
    $D --prompts codeio-completion --skip 65 --limit "$1" --out data/qwen2.5-coder-1.5b-completion-65
}
DATA=data/qwen2.5-coder-1.5b-rgmath,data/qwen2.5-coder-1.5b-completion-65
T="$SPECULA train dflash --target qwen2.5-coder-1.5b --data $DATA --features offline --layers 2 --ffn 2048
   --n-taps 5 --attention-bias --block 8 --anchors 96 --batch 2 --gamma 2 --max-tokens 640
   --checkpoint-every 100 --log-every 20 --val-examples 32"
stage data1 && data 900
stage train1 && $T --out $RUNS/q15-dflash --steps 1000 --stop-after "${STOP1:-800}" --lr 1e-3 ${RESUME:+--resume}
stage data2 && data 1200
stage train2 && $T --out $RUNS/q15-dflash-2 --init-from $RUNS/q15-dflash/drafter --draft-vocab 16384 \
    --steps 1000 --lr 6e-4 ${RESUME:+--resume}
stage data3 && $D --prompts word-problems --limit 600 --out data/qwen2.5-coder-1.5b-wordproblems
WP=data/qwen2.5-coder-1.5b-wordproblems
stage train3 && ${T/--data $DATA/--data $DATA,$WP} --out $RUNS/q15-dflash-3 --init-from $RUNS/q15-dflash-2/drafter \
    --draft-vocab 16384 --steps 1000 --lr 4e-4 ${RESUME:+--resume}
FS=data/qwen2.5-coder-1.5b-stubs
stage data4 && ${D/--max-new-tokens 256/--max-new-tokens 192} --prompts function-stubs --limit 250 --out $FS
# The vocabulary is re-picked from this run's data (16,384 tokens, train3's size; shared rows
# carried over); the exercises' directory is left out, so that code and word problems take
# the steps.
stage train4 && ${T/--data $DATA/--data data/qwen2.5-coder-1.5b-completion-65,$WP,$FS} \
    --out $RUNS/q15-dflash-4 --init-from $RUNS/q15-dflash-3/drafter --steps 600 --lr 3e-4 ${RESUME:+--resume}
WP5=data/qwen2.5-coder-1.5b-wordproblems-657
FS5=data/qwen2.5-coder-1.5b-stubs-275
stage data5 && $D --prompts word-problems --skip 657 --out $WP5 &&
    ${D/--max-new-tokens 256/--max-new-tokens 192} --prompts function-stubs --skip 275 --out $FS5
stage train5 && ${T/--data $DATA/--data data/qwen2.5-coder-1.5b-completion-65,$WP,$FS,$WP5,$FS5} \
    --out $RUNS/q15-dflash-5 --init-from $RUNS/q15-dflash-4/drafter --steps 600 --lr 3e-4 ${RESUME:+--resume}
WP6=data/qwen2.5-coder-1.5b-wordproblems-1095
FS6=data/qwen2.5-coder-1.5b-stubs-411
stage data6 && $D --prompts word-problems --skip 1095 --out $WP6 &&
    ${D/--max-new-tokens 256/--max-new-tokens 192} --prompts function-stubs --skip 411 --out $FS6
stage train6 && ${T/--data $DATA/--data data/qwen2.5-coder-1.5b-completion-65,$WP,$FS,$WP5,$FS5,$WP6,$FS6} \
    --out $RUNS/q15-dflash-6 --init-from $RUNS/q15-dflash-5/drafter --steps 600 --lr 3e-4 ${RESUME:+--resume}
U=data/qwen2.5-coder-1.5b-unseen
stage unseen-data && $D --prompts word-problems --skip 600 --limit 57 --out $U-wordproblems-600 &&
    ${D/--max-new-tokens 256/--max-new-tokens 192} --prompts function-stubs --skip 250 --limit 25 --out $U-stubs-250 &&
    $D --prompts codeio-completion --skip 1300 --limit 30 --out $U-completion-1300 &&
    $D --prompts reasoning-gym-math --skip 1300 --limit 52 --out $U-rgmath-1300
DRAFTER=${DRAFTER:-$RUNS/q15-dflash-5/drafter}
stage bench || exit 0
# Reports of the drafter measured go to $BENCH (run 2's are in $OUT itself, runs 3 and 4's in
# run3/ and run4/).
BENCH=${BENCH:-$OUT/run5}
mkdir -p "$BENCH"
# τ at 7 drafted tokens per step, chains (the goal's measure), 10 prompts per set.
$SPECULA bench --mode spec -m qwen2.5-coder-1.5b --drafter dflash:"$DRAFTER",draft-max=7 --draft-len 7 \
    --draft-tree off --dataset humaneval --dataset gsm8k-100 --dataset mt-bench --dataset math500 --limit 10 \
    --max-tokens 128 --temperatures 0 --out-dir "$BENCH/tau-k7"
# Speed at `--draft-len auto` (trees where the drafter has them) beside the 0.5B draft model, all
# planned with one verify-cost curve measured at the start.
DM=draft-model:qwen2.5-coder-0.5b,weights=q4_0,vocab=32768
$SPECULA bench --mode spec -m qwen2.5-coder-1.5b --drafter "$DM" --drafter dflash:"$DRAFTER" \
    --drafter ngram+dflash:"$DRAFTER" --draft-len auto \
    --dataset humaneval --dataset gsm8k-100 --limit 10 --max-tokens 128 --temperatures 0 --out-dir "$BENCH/auto"
# The validation estimate against τ measured on prompts of the training kinds it never saw
# (the data directories hold reasoning-gym-math 1-1,200, codeio-completion 1-1,265,
# word-problems 1-600 and 658 on, and function-stubs 1-250 and 276 on; reasoning-gym-math lists
# its 26 generators in turn, so 52 prompts take two questions of each). The estimate: each
# kind's whole held-out split (one example in 20 of its directories), in $BENCH/validation.txt;
# the same simulation on the 1.5B's answers to the unseen prompts themselves (stage
# unseen-data), in $BENCH/validation-unseen.txt.
Q=data/qwen2.5-coder-1.5b
for dir in $Q-completion-65 $Q-rgmath $Q-wordproblems,$Q-wordproblems-657 $Q-stubs,$Q-stubs-275; do
    echo "$dir" && $SPECULA train validate --target qwen2.5-coder-1.5b --drafter dflash:"$DRAFTER" \
        --data "$dir" --val-examples 200 --max-tokens 640
done > "$BENCH/validation.txt"
for dir in $U-{completion-1300,rgmath-1300,wordproblems-600,stubs-250}; do
    echo "$dir" && $SPECULA train validate --target qwen2.5-coder-1.5b --drafter dflash:"$DRAFTER" \
        --data "$dir" --all --val-examples 200 --max-tokens 640
done > "$BENCH/validation-unseen.txt"
# Each kind is generated as long as its data's answers were (the stubs' at most 192 tokens).
unseen() {
    $SPECULA bench --mode spec -m qwen2.5-coder-1.5b --drafter dflash:"$DRAFTER",draft-max=7 --draft-len 7 \
        --draft-tree off --dataset "$1" --skip "$2" --limit "$3" --max-tokens "${4:-256}" --temperatures 0 \
        --out-dir "$BENCH/unseen-k7-$1"
}
unseen codeio-completion 1300 30
unseen reasoning-gym-math 1300 52
unseen word-problems 600 57
unseen function-stubs 250 25 192
