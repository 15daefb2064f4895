#!/usr/bin/env bash
# The SmolLM2 DFlash drafter's weights before its last run (run 11 of its lineage in docs/training.md,
# τ 1.76 at k = 7) with prompt lookup, prompt lookup in front of it, and run 8's weights, greedy,
# at --draft-len auto and 7.
# Both weights, restored from git into runs/ (the report names each by the commit that holds it):
for c in b246aaf 11abba0; do w=runs/smollm2-dflash-$c; mkdir -p $w
  for f in config.json model.safetensors; do git show $c:drafters/smollm2-135m-dflash/$f > $w/$f; done; done
# Measured on a 2-core AMD EPYC (Zen 4, AVX-512); tok/s there, τ anywhere.
specula bench --mode spec -m smollm2-135m --drafter ngram --drafter ngram+dflash:runs/smollm2-dflash-b246aaf \
  --drafter dflash:runs/smollm2-dflash-b246aaf,draft-max=7 --drafter dflash:runs/smollm2-dflash-11abba0,draft-max=7 \
  --draft-len auto --draft-len 7 --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 \
  --limit 20 --max-tokens 256 --temperatures 0 --out-dir docs/benchmarks/spec-smollm2-drafters
