#!/usr/bin/env bash
# DFlash against EAGLE-3 at equal training time on SmolLM2-135M, greedy, at --draft-len auto and 7.
# DFlash: the shipped drafter's first 1,000 steps (run 1 of its lineage in docs/training.md), restored from git into runs/ (the report names each by the commit that holds it):
for c in 8e76d4d; do w=runs/smollm2-dflash-$c; mkdir -p $w
  for f in config.json model.safetensors; do git show $c:drafters/smollm2-135m-dflash/$f > $w/$f; done; done
# EAGLE-3: drafters/smollm2-135m-eagle3 (made by the command in docs/training.md).
# Measured on a 2-core AMD EPYC (Zen 4, AVX-512); tok/s there, τ anywhere.
specula bench --mode spec -m smollm2-135m --drafter ngram \
  --drafter dflash:runs/smollm2-dflash-8e76d4d,draft-max=7 --drafter eagle3:drafters/smollm2-135m-eagle3,draft-max=7 \
  --draft-len auto --draft-len 7 --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 \
  --limit 20 --max-tokens 256 --temperatures 0 --out-dir docs/benchmarks/spec-smollm2-equal-compute
