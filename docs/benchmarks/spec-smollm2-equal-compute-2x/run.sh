#!/usr/bin/env bash
# DFlash against EAGLE-3 on SmolLM2-135M at one and at two equal training budgets, greedy, 7 tokens per step.
# DFlash: the shipped drafter's first 1,000 steps and 1,000 more (runs 1 and 2 of its lineage in docs/training.md), restored from git into runs/ (the report names each by the commit that holds it):
for c in 8e76d4d bc363be; do w=runs/smollm2-dflash-$c; mkdir -p $w
  for f in config.json model.safetensors; do git show $c:drafters/smollm2-135m-dflash/$f > $w/$f; done; done
# EAGLE-3: drafters/smollm2-135m-eagle3 (488 steps) and runs/smollm2-e3eq-2x/drafter (488 more),
# both made by the commands in docs/training.md.
# Measured on a 2-core AMD EPYC (Zen 4, AVX-512); tok/s there, τ anywhere.
specula bench --mode spec -m smollm2-135m \
  --drafter dflash:runs/smollm2-dflash-8e76d4d,draft-max=7 --drafter dflash:runs/smollm2-dflash-bc363be,draft-max=7 \
  --drafter eagle3:drafters/smollm2-135m-eagle3,draft-max=7 --drafter eagle3:runs/smollm2-e3eq-2x/drafter,draft-max=7 \
  --draft-len 7 --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 \
  --limit 20 --max-tokens 256 --temperatures 0 --out-dir docs/benchmarks/spec-smollm2-equal-compute-2x
