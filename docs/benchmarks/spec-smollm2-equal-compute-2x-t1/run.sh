#!/usr/bin/env bash
# DFlash against EAGLE-3 on SmolLM2-135M at the second equal training budget, T = 1 (rejection sampling,
# seed 0), 7 tokens per step.
# DFlash: the shipped drafter after 2,000 steps (run 2 of its lineage in docs/training.md), restored from git into runs/ (the report names each by the commit that holds it):
for c in bc363be; do w=runs/smollm2-dflash-$c; mkdir -p $w
  for f in config.json model.safetensors; do git show $c:drafters/smollm2-135m-dflash/$f > $w/$f; done; done
# EAGLE-3: runs/smollm2-e3eq-2x/drafter, made by the command in docs/training.md.
# Measured on a 2-core AMD EPYC (Zen 4, AVX-512); tok/s there, τ anywhere.
specula bench --mode spec -m smollm2-135m \
  --drafter dflash:runs/smollm2-dflash-bc363be,draft-max=7 --drafter eagle3:runs/smollm2-e3eq-2x/drafter,draft-max=7 \
  --draft-len 7 --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 \
  --limit 20 --max-tokens 256 --temperatures 1 --seed 0 --out-dir docs/benchmarks/spec-smollm2-equal-compute-2x-t1
