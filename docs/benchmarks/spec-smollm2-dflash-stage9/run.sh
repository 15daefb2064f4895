# The ninth-stage SmolLM2 DFlash drafter (runs/smollm2-pos9/drafter, made by the command in
# docs/training.md) against the shipped eighth stage, greedy, 7 tokens per step.
# Measured on a 2-core AMD EPYC (Zen 1, AVX2); tok/s there, τ anywhere.
specula bench --mode spec -m smollm2-135m --drafter dflash:runs/smollm2-pos9/drafter,max=7 \
  --drafter dflash:drafters/smollm2-135m-dflash,max=7 --draft-len 7 \
  --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 \
  --limit 20 --max-tokens 256 --temperatures 0 --out-dir docs/benchmarks/spec-smollm2-dflash-stage9
