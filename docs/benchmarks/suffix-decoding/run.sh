#!/usr/bin/env bash
# Suffix decoding against prompt lookup and plain decoding on multi-request workloads.
# usage: docs/benchmarks/suffix-decoding/run.sh MODEL CLIENTS CONVERSATIONS [WORKLOAD...] [-- EXTRA SERVE ARGS]
# Results: docs/benchmarks/suffix-decoding/MODEL-cCLIENTS/WORKLOAD.json
set -euo pipefail
cd "$(dirname "$0")/../../.."
model=$1 clients=$2 n=$3; shift 3
workloads=(); extra=()
while (($#)); do if [[ $1 == -- ]]; then shift; extra=("$@"); break; fi; workloads+=("$1"); shift; done
((${#workloads[@]})) || workloads=(code-edit extraction agentic)
cargo build --release -q
bin=/tmp/bench-bin/specula; mkdir -p /tmp/bench-bin; cp target/release/specula "$bin"
out=docs/benchmarks/suffix-decoding/$model-c$clients; mkdir -p "$out"
grep -m1 "model name" /proc/cpuinfo > "$out/cpu.txt"; grep -o -w 'avx512_vnni\|amx_int8\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ' >> "$out/cpu.txt"
pids=()
trap 'kill ${pids[@]} 2>/dev/null || true' EXIT
servers=()
port=8201
# plain first when one client (speedups against it); with several clients only the two drafters.
drafters=(none ngram suffix); ((clients > 1)) && drafters=(ngram suffix)
for d in "${drafters[@]}"; do
  # A tool-capable ChatML template, so that the agentic replay's tools reach the model.
  "$bin" serve -m "$model" --drafter "$d" --port $port --max-running 16 \
    --chat-template tests/fixtures/chat-templates/qwen3.jinja --chat-template-kwargs '{"enable_thinking": false}' \
    "${extra[@]}" 2> "$out/server-$d.log" &
  pids+=($!)
  until curl -sf localhost:$port/health > /dev/null; do sleep 1; done
  name=$d; [[ $d == none ]] && name=plain
  servers+=(--server "$name=http://127.0.0.1:$port")
  port=$((port + 1))
done
for w in "${workloads[@]}"; do
  python3 docs/benchmarks/suffix-decoding/replay.py --workload "$w" "${servers[@]}" \
    --conversations "$n" --clients "$clients" --out "$out/$w.json" > "$out/$w.txt"
  cat "$out/$w.txt"
done
