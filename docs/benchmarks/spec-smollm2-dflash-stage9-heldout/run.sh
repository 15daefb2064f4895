# The same two drafters on ten codeio-completion prompts that no training stage used
# (the stages used the first 2,200 prompts' records at most).
specula bench --mode spec -m smollm2-135m --drafter dflash:runs/smollm2-pos9/drafter,max=7 \
  --drafter dflash:drafters/smollm2-135m-dflash,max=7 --draft-len 7 \
  --dataset codeio-completion --skip 2400 --limit 10 --max-tokens 256 --temperatures 0 \
  --out-dir docs/benchmarks/spec-smollm2-dflash-stage9-heldout
