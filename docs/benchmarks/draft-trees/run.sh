#!/usr/bin/env bash
# Draft trees against chains, each side by side with plain decoding in the same run (10 prompts
# per set, 128 tokens). Run on a quiet machine from the repository root:
#   PATH=$PWD/target/release:$PATH bash docs/benchmarks/draft-trees/run.sh [tau|auto|qwen|serve]...
# tau:   SmolLM2's DFlash drafter, τ of a 15-node tree (16 verified rows) against its chain at k = 7,
#        greedy, the four evaluation sets.
# auto:  SmolLM2 with DFlash, prompt lookup + DFlash and EAGLE-3 at --draft-len auto, chains
#        against trees (--draft-tree off,auto), greedy and T = 1, the four evaluation sets.
# qwen:  Qwen2.5-Coder-1.5B with the 0.5B draft model at auto, chains against trees, humaneval
#        and gsm8k-100, greedy and T = 1.
# pays:  after the planner asks for a tree only when its best draft of the size has a runner-up
#        in it: chains against trees for SmolLM2 (DFlash, lookup + DFlash; gsm8k-100, humaneval,
#        T = 0 and 1) and Qwen2.5-Coder-1.5B's draft model (5 prompts, greedy).
# serve: SmolLM2 served with prompt lookup + DFlash, --draft-tree off against auto, 1 client
#        (16 requests) and 8 clients (32 requests) of 128 tokens, alternating, two rounds.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
{ grep -m1 "model name" /proc/cpuinfo; grep -o -w 'avx512_vnni\|amx_int8\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } > "$here/cpu.txt"
sets="--dataset gsm8k-100 --dataset humaneval --dataset mt-bench --dataset math500"
dflash=drafters/smollm2-135m-dflash
for part in "${@:-tau auto qwen serve}"; do
  for p in $part; do
    case $p in
      tau)
        specula bench --mode spec -m smollm2-135m --drafter dflash:$dflash --draft-len 7 --draft-len 15 \
          --draft-tree off,15 $sets --limit 10 --max-tokens 128 --temperatures 0 --out-dir "$here/tau" ;;
      auto)
        specula bench --mode spec -m smollm2-135m --drafter dflash:$dflash --drafter ngram+dflash:$dflash \
          --drafter eagle3:drafters/smollm2-135m-eagle3 --draft-len auto --draft-tree off,auto $sets \
          --limit 10 --max-tokens 128 --temperatures 0,1 --out-dir "$here/smollm2-auto" ;;
      qwen)
        specula bench --mode spec -m qwen2.5-coder-1.5b --drafter draft-model:qwen2.5-coder-0.5b --draft-len auto \
          --draft-tree off,auto --dataset humaneval --dataset gsm8k-100 --limit 10 --max-tokens 128 \
          --temperatures 0,1 --out-dir "$here/qwen1.5b" ;;
      pays)
        specula bench --mode spec -m smollm2-135m --drafter dflash:$dflash --drafter ngram+dflash:$dflash \
          --draft-len auto --draft-tree off,auto --dataset gsm8k-100 --dataset humaneval --limit 10 \
          --max-tokens 128 --temperatures 0,1 --out-dir "$here/tree-when-it-pays/smollm2"
        specula bench --mode spec -m qwen2.5-coder-1.5b --drafter draft-model:qwen2.5-coder-0.5b --draft-len auto \
          --draft-tree off,auto --dataset humaneval --dataset gsm8k-100 --limit 5 --max-tokens 128 \
          --temperatures 0 --out-dir "$here/tree-when-it-pays/qwen1.5b" ;;
      serve)
        out="$here/serve.txt"; : > "$out"
        for round in 1 2; do
          for clients in 1 8; do
            for tree in off auto; do
              specula serve -m smollm2-135m --drafter ngram+dflash:$dflash --draft-tree $tree --port 18092 > /dev/null 2>&1 &
              server=$!
              for _ in $(seq 240); do curl -s localhost:18092/health >/dev/null 2>&1 && break; sleep 0.5; done
              specula loadtest --url http://127.0.0.1:18092 --clients $clients --requests $((clients == 1 ? 16 : 32)) --max-tokens 128 2>&1 \
                | tail -1 | sed "s/^/round $round, $clients clients, --draft-tree $tree: /" | tee -a "$out"
              curl -s localhost:18092/metrics | grep -E '^specula_(draft|acceptance|verify_steps)' \
                | sed "s/^/  /" >> "$out"
              kill "$server"; wait "$server" 2>/dev/null || true
            done
          done
        done ;;
      *) echo "unknown part $p"; exit 1 ;;
    esac
  done
done
