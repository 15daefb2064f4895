#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B with the 0.5B draft model at --draft-len auto, greedy, on a 2-core CPU with
# AVX2 only (measured on an AMD EPYC, Zen 3): 5 prompts each of humaneval and gsm8k-100.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
specula bench --mode spec -m qwen2.5-coder-1.5b --drafter draft-model:qwen2.5-coder-0.5b \
    --dataset humaneval --dataset gsm8k-100 --limit 5 --temperatures 0 --out-dir "$here"
# The same with each prompt starting from the acceptance of the set's earlier prompts, as on a
# running server (report-warm.md):
specula bench --mode spec -m qwen2.5-coder-1.5b --drafter draft-model:qwen2.5-coder-0.5b \
    --dataset humaneval --dataset gsm8k-100 --limit 5 --temperatures 0 --acceptance-history warm \
    --out-dir "$here/warm" && mv "$here/warm/report.md" "$here/report-warm.md" \
    && mv "$here/warm/report.json" "$here/report-warm.json" && rm -r "$here/warm"
