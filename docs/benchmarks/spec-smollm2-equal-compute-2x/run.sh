# DFlash against EAGLE-3 on SmolLM2-135M at one and at two equal training budgets, greedy, 7 tokens per step.
# DFlash: the shipped drafter's first stage (1,000 steps) and second stage (1,000 more), restored from git:
#   for s in 1:a7d10ca 2:bc363be; do d=/tmp/smollm2-dflash-stage${s%%:*}; mkdir -p $d
#     for f in config.json model.safetensors; do git show ${s#*:}:drafters/smollm2-135m-dflash/$f > $d/$f; done; done
# EAGLE-3: drafters/smollm2-135m-eagle3 (488 steps) and runs/smollm2-e3eq-2x/drafter (488 more),
# both made by the commands in docs/training.md.
# Measured on a 2-core AMD EPYC (Zen 4, AVX-512); tok/s there, τ anywhere.
specula bench --mode spec -m smollm2-135m \
  --drafter dflash:/tmp/smollm2-dflash-stage1,max=7 --drafter dflash:/tmp/smollm2-dflash-stage2,max=7 \
  --drafter eagle3:drafters/smollm2-135m-eagle3,max=7 --drafter eagle3:runs/smollm2-e3eq-2x/drafter,max=7 \
  --draft-len 7 --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 \
  --limit 20 --max-tokens 256 --temperatures 0 --out-dir docs/benchmarks/spec-smollm2-equal-compute-2x
