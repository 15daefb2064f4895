# Qwen2.5-Coder-1.5B: the DFlash and EAGLE-3 drafters at one and at two equal training budgets on the
# same codeio answers (runs/q15-dflash, runs/q15-eagle3 and their continuations runs/q15-dflash-2x,
# runs/q15-eagle3-2x, made by the commands in docs/training.md), 4 tokens per step, greedy, against
# plain decoding in one run.
# Measured on a 2-core AMD EPYC (Zen 4, AVX-512); tok/s there, τ anywhere.
specula bench --mode spec -m qwen2.5-coder-1.5b \
  --drafter dflash:runs/q15-dflash/drafter --drafter dflash:runs/q15-dflash-2x/drafter \
  --drafter eagle3:runs/q15-eagle3/drafter --drafter eagle3:runs/q15-eagle3-2x/drafter --draft-len 4 \
  --dataset humaneval --dataset gsm8k-100 --dataset mt-bench --dataset math500 \
  --limit 5 --max-tokens 128 --temperatures 0 --out-dir docs/benchmarks/spec-qwen1.5b-learned-k4-2x
