#!/usr/bin/env bash
# Both directions of the hand-off with the packages' own training, on CPU, offline:
#   specula `train data` (the tiny target answers prompts) -> `train export` (JSONL)
#   -> speculators `prepare-data` -> hidden states -> `speculators train` (DFlash and EAGLE-3,
#   a few steps each) -> the checkpoints it wrote -> tests/fixtures/interop/speculators-*-trained
#   (drafter + the package's own forward, by make_speculators_fixtures.py --trained-*).
#
#   VENV=~/.venvs/interop bash tools/interop/make_trained_fixtures.sh   # from the repository root
#
# Needs a release build (target/release/specula), the venv of README.md (speculators 0.9.0; the
# unpacked SpecForge wheel in SPECFORGE_SRC adds its cross-check of the DFlash forward) and
# the prompt set (`codeio-completion`: completion prompts, since the tiny target has no chat template; fetched by specula on first use).
set -euo pipefail
: "${VENV:=$HOME/.venvs/interop}"
PY=$VENV/bin/python
here=tools/interop
work=${WORK:-runs/interop-trained}
target=tests/fixtures/dflash/random/target
[ -f "$target/config.json" ] || { echo "run from the repository root" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work"

# 1. specula: the tiny target writes its own answers; one JSONL file of input_ids + loss_mask.
target/release/specula train data --target "$target" --prompts codeio-completion --limit 64 \
    --max-new-tokens 48 --out "$work/data" -t 1
target/release/specula train export --data "$work/data" --out "$work/export.jsonl"

# 2. speculators: its own data preparation (the rows pass through as pre-tokenized) and the
# target's hidden states in the files vLLM's extraction writes.
cp -r "$target" "$work/target"
echo '{"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512}' > "$work/target/tokenizer_config.json"
$VENV/bin/speculators prepare-data --model "$work/target" --data "$work/export.jsonl" \
    --output "$work/prepared" --seq-length 512 --num-preprocessing-workers 1
$VENV/bin/speculators prepare-data --model "$work/target" --data "$work/export.jsonl" \
    --output "$work/prepared-freq" --seq-length 512 --num-preprocessing-workers 1 --no-skip-token-freq
$PY $here/speculators_cpu_train_demo.py hidden-states "$work/target" "$work/prepared" --layers 1 3
$PY $here/speculators_cpu_train_demo.py hidden-states "$work/target" "$work/prepared-freq" --layers 1 2 3

# 3. speculators' own training, a few steps each (seeded by the package's defaults).
common=(--verifier-name-or-path "$work/target" --on-missing raise --hidden-states-dtype float32
        --loss-implementation eager --num-workers 0 --epochs 1 --max-steps 8 --total-seq-len 1024
        --train-data-ratio 0.9 --mask-token-id 255 --draft-attn-impl sdpa)
$PY $here/speculators_cpu_train_demo.py train --speculator-type dflash --data-path "$work/prepared" \
    --target-layer-ids 1 3 --num-layers 1 --block-size 4 --full-attention-indices 0 --max-anchors 16 \
    --save-path "$work/dflash" --log-dir "$work/dflash-logs" "${common[@]}"
$PY $here/speculators_cpu_train_demo.py train --speculator-type eagle3 --data-path "$work/prepared-freq" \
    --target-layer-ids 1 2 3 --draft-vocab-size 128 \
    --save-path "$work/eagle3" --log-dir "$work/eagle3-logs" "${common[@]}"

# 4. The fixtures: the checkpoints as written, and the package's forward on them.
TORCHDYNAMO_DISABLE=1 PYTHONPATH=${SPECFORGE_SRC:-$HOME/.venvs/specforge-src} $PY $here/make_speculators_fixtures.py \
    --trained-dflash "$work/dflash/0" --trained-eagle3 "$work/eagle3/0"
