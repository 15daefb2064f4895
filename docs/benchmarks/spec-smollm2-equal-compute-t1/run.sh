# DFlash against EAGLE-3 at equal training time on SmolLM2-135M, at T = 1 (rejection sampling, seed 0), 7 tokens per step.
# DFlash: the shipped drafter's first stage (1,000 steps), restored from git:
#   mkdir -p /tmp/smollm2-dflash-stage1 && for f in config.json model.safetensors; do
#     git show a7d10ca:drafters/smollm2-135m-dflash/$f > /tmp/smollm2-dflash-stage1/$f; done
# EAGLE-3: drafters/smollm2-135m-eagle3 (made by the command in docs/training.md).
# Measured on a 2-core AMD EPYC (Zen 4, AVX-512); tok/s there, τ anywhere.
specula bench --mode spec -m smollm2-135m --drafter ngram \
  --drafter dflash:/tmp/smollm2-dflash-stage1,max=7 --drafter eagle3:drafters/smollm2-135m-eagle3,max=7 \
  --draft-len 7 --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 \
  --limit 20 --max-tokens 256 --temperatures 1 --seed 0 --out-dir docs/benchmarks/spec-smollm2-equal-compute-t1
