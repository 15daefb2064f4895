# Two SmolLM2 DFlash drafters trained from run 8's weights of the shipped drafter's lineage on the
# same data, steps and seed, one with hard labels and one with `--distill` (runs/s10-hard and
# runs/s10-distill: run 10 of the lineage in docs/training.md, and the same with --distill), greedy, 7 tokens per step.
# Measured on a 2-core AMD EPYC (Zen 1, AVX2); tok/s there, τ anywhere.
specula bench --mode spec -m smollm2-135m --drafter dflash:runs/s10-distill/drafter,draft-max=7 \
  --drafter dflash:runs/s10-hard/drafter,draft-max=7 --draft-len 7 \
  --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 \
  --limit 20 --max-tokens 256 --temperatures 0 --out-dir docs/benchmarks/spec-smollm2-dflash-distill
