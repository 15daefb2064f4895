#!/usr/bin/env bash
# Alternating rounds of the three activation settings of one build, per model:
# prefill / decode / ×8 decode tok/s and the verify-cost curve (compare within a round).
SPECULA=${SPECULA:-specula}
ar() { SPECULA_ACTIVATION_LEVELS=$1 $SPECULA bench --mode ar -m $2 --repeats 1 --max-m 8 --prefill-tokens $3 --decode-tokens $4 2>/dev/null | grep "^| $2"; }
for r in 1 2 3 4; do for l in selective one two; do echo "$r $l $(ar $l smollm2-135m 512 64)"; done; done
for r in 1 2 3; do for l in selective one two; do echo "$r $l $(ar $l qwen2.5-coder-1.5b 256 16)"; done; done
