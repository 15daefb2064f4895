#!/usr/bin/env bash
# The same drafters as spec-smollm2-drafters at T = 1 (rejection sampling, seed 0), 7 tokens per step.
# Both weights, restored from git into runs/ (the report names each by the commit that holds it):
for c in b246aaf 11abba0; do w=runs/smollm2-dflash-$c; mkdir -p $w
  for f in config.json model.safetensors; do git show $c:drafters/smollm2-135m-dflash/$f > $w/$f; done; done
# Measured on a 2-core AMD EPYC (Zen 4, AVX-512); tok/s there, τ anywhere.
specula bench --mode spec -m smollm2-135m --drafter ngram --drafter ngram+dflash:runs/smollm2-dflash-b246aaf,draft-max=7 \
  --drafter dflash:runs/smollm2-dflash-b246aaf,draft-max=7 --drafter dflash:runs/smollm2-dflash-11abba0,draft-max=7 \
  --draft-len 7 --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 --limit 20 \
  --max-tokens 256 --temperatures 1 --seed 0 --out-dir docs/benchmarks/spec-smollm2-drafters-t1
