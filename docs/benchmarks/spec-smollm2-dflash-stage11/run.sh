# The eleventh-stage SmolLM2 DFlash drafter (runs/s11/drafter, made by the commands in
# docs/training.md; shipped as drafters/smollm2-135m-dflash) with prompt lookup, prompt lookup
# in front of it, and the eighth stage (`git show 8c77448:drafters/smollm2-135m-dflash/...`,
# here in /tmp/smollm2-dflash-stage8), greedy, at --draft-len auto and 7.
# Measured on a 2-core AMD EPYC (Zen 4, AVX-512); tok/s there, τ anywhere.
specula bench --mode spec -m smollm2-135m --drafter ngram --drafter ngram+dflash:runs/s11/drafter \
  --drafter dflash:runs/s11/drafter,max=7 --drafter dflash:/tmp/smollm2-dflash-stage8,max=7 \
  --draft-len auto --draft-len 7 --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 \
  --limit 20 --max-tokens 256 --temperatures 0 --out-dir docs/benchmarks/spec-smollm2-dflash-stage11
