#!/usr/bin/env bash
# Alternating rounds: base build (76708b4), new build with one-level activations, new build default (two levels).
BASE=${BASE:?the build to compare with}; NEW=${NEW:-specula}
ar() { "$@" bench --mode ar -m smollm2-135m --repeats 1 --max-m 8 --prefill-tokens 512 --decode-tokens 64 2>/dev/null | tail -1; }
for r in 1 2 3; do
  echo "base      $(ar $BASE)"
  echo "new-1lvl  $(SPECULA_ONE_LEVEL_ACTIVATIONS=1 ar $NEW)"
  echo "new-2lvl  $(ar $NEW)"
done
