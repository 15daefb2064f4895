#!/usr/bin/env bash
# Six alternating rounds of `specula bench --mode ar` on SmolLM2, default activations
# (`outliers`) against one level: prefill / decode / ×8 decode tok/s (compare within a round).
SPECULA=${SPECULA:-specula}
ar() { SPECULA_ACTIVATION_LEVELS=$1 $SPECULA bench --mode ar -m smollm2-135m --repeats 3 --max-m 8 --prefill-tokens 512 --decode-tokens 32 2>/dev/null | grep "^| smollm2"; }
for r in 1 2 3 4 5 6; do for l in outliers one; do echo "$r $l $(ar $l)"; done; done
