#!/bin/bash
# Drafter training throughput, two builds alternating: the same 24 steps of the SmolLM2 recipe
# with cached (offline) target features, ROUNDS rounds.
# Usage: BEFORE=path/to/old/specula AFTER=path/to/new/specula DATA=data-dir bash run.sh [ROUNDS]
# Fill the feature cache first (one run with --stop-after 1 and the same --features-dir), so
# that no round computes features.
set -euo pipefail
ROUNDS=${1:-3}
FEATURES=${FEATURES:-$(mktemp -d)}
for round in $(seq "$ROUNDS"); do
  for build in "$BEFORE" "$AFTER"; do
    out=$(mktemp -d)
    "$build" train dflash --target smollm2-135m --data "$DATA" --out "$out" --features offline \
      --features-dir "$FEATURES" --init-from drafters/smollm2-135m-dflash --block 8 --anchors 96 \
      --batch 2 --steps 2000 --stop-after 24 --lr 4e-4 --gamma 2 --max-tokens 640 \
      --checkpoint-every 1000 --log-every 24 --val-examples 8 --seed 8 2>&1 |
      grep -E '^step|of 2000' | sed "s#^#$build round $round: #"
    rm -rf "$out"
  done
done
