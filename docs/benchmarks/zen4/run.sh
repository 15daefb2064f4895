#!/usr/bin/env bash
# The current build on an AMD Zen 4 (AVX-512 VNNI, no AMX): the verify-cost curve with its
# profile, and speculative decoding end to end, each mode side by side with plain decoding in
# the same run. From the repository root, on a quiet machine:
#   PATH=$PWD/target/release:$PATH bash docs/benchmarks/zen4/run.sh [ar|smollm2|qwen]...
# ar:      bench --mode ar with --profile, SmolLM2-135M and Qwen2.5-Coder-1.5B (ar-*.md, ar.json).
# smollm2: SmolLM2 with prompt lookup, the shipped DFlash drafter and lookup + DFlash at
#          --draft-len auto (trees where they pay), four evaluation sets, 10 prompts, 128 tokens,
#          T = 0 and 1 (smollm2/report.md).
# qwen:    Qwen2.5-Coder-1.5B with the 0.5B draft model at auto, humaneval and gsm8k-100,
#          10 prompts, 128 tokens, T = 0 and 1 (qwen1.5b/report.md).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
{ grep -m1 "model name" /proc/cpuinfo; grep -m1 "cpu family" /proc/cpuinfo; grep -m1 "^model\s" /proc/cpuinfo
  grep -o -w 'avx2\|avx512f\|avx512_vnni\|avx512_bf16\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } > "$here/cpu.txt"
dflash=drafters/smollm2-135m-dflash
for p in ${@:-ar smollm2 qwen}; do
  case $p in
    ar)
      specula bench --mode ar -m smollm2-135m --repeats 3 --max-m 16 --profile --out "$here/ar-smollm2.json" > "$here/ar-smollm2.md"
      specula bench --mode ar -m qwen2.5-coder-1.5b --repeats 3 --max-m 16 --profile --out "$here/ar-qwen1.5b.json" > "$here/ar-qwen1.5b.md" ;;
    smollm2)
      specula bench --mode spec -m smollm2-135m --drafter ngram --drafter dflash:$dflash --drafter ngram+dflash:$dflash \
        --draft-len auto --dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500 \
        --limit 10 --max-tokens 128 --temperatures 0,1 --out-dir "$here/smollm2" > /dev/null ;;
    qwen)
      specula bench --mode spec -m qwen2.5-coder-1.5b --drafter draft-model:qwen2.5-coder-0.5b --draft-len auto \
        --dataset humaneval --dataset gsm8k-100 --limit 10 --max-tokens 128 --temperatures 0,1 \
        --out-dir "$here/qwen1.5b" > /dev/null ;;
    *) echo "unknown part $p"; exit 1 ;;
  esac
done
