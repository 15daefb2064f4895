# The shipped (eleventh-stage) SmolLM2 DFlash drafter at T = 1 (rejection sampling, seed 0), with
# prompt lookup, lookup in front of it, and the eighth stage (`git show
# 8c77448:drafters/smollm2-135m-dflash/...`, here in /tmp/smollm2-dflash-stage8), 7 tokens per step.
# Measured on a 2-core AMD EPYC (Zen 4, AVX-512); tok/s there, τ anywhere.
specula bench --mode spec -m smollm2-135m --drafter ngram --drafter ngram+dflash:drafters/smollm2-135m-dflash,max=7 \
  --drafter dflash:drafters/smollm2-135m-dflash,max=7 --drafter dflash:/tmp/smollm2-dflash-stage8,max=7 \
  --draft-len 7 --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 --limit 20 \
  --max-tokens 256 --temperatures 1 --seed 0 --out-dir docs/benchmarks/spec-smollm2-dflash-stage11-t1
