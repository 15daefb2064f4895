#!/usr/bin/env bash
# Suffix decoding against prompt lookup (and plain decoding, with one client) on multi-request
# workloads, each server started fresh for each workload.
# usage: [DRAFTERS="none ngram suffix"] [TAG=name] docs/benchmarks/suffix-decoding/run.sh MODEL CLIENTS CONVERSATIONS [WORKLOAD...]
# Results: docs/benchmarks/suffix-decoding/MODEL-cCLIENTS[-TAG]/WORKLOAD.{txt,json}; speedups are
# against the first drafter (plain decoding with one client, prompt lookup with several).
set -euo pipefail
cd "$(dirname "$0")/../../.."
model=$1 clients=$2 n=$3; shift 3
workloads=("$@"); ((${#workloads[@]})) || workloads=(code-edit extraction agentic)
cargo build --release -q
bin=$(mktemp -d)/specula; cp target/release/specula "$bin"
out=docs/benchmarks/suffix-decoding/$model-c$clients${TAG:+-$TAG}; mkdir -p "$out"
{ grep -m1 "model name" /proc/cpuinfo; grep -o -w 'avx512_vnni\|amx_int8\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } > "$out/cpu.txt"
pids=()
trap 'kill ${pids[@]} 2>/dev/null || true' EXIT
drafters=(none ngram suffix); ((clients > 1)) && drafters=(ngram suffix)
[[ -n ${DRAFTERS:-} ]] && read -ra drafters <<< "$DRAFTERS"
for w in "${workloads[@]}"; do
  extra=()
  # SmolLM2's own chat template leaves tools out; a ChatML one that renders them.
  [[ $w == agentic && $model == smollm2-135m ]] && extra=(--chat-template tests/fixtures/chat-templates/qwen3.jinja)
  servers=(); port=8201
  for d in "${drafters[@]}"; do
    "$bin" serve -m "$model" --drafter "$d" --port $port --max-running 16 "${extra[@]}" 2> "$out/server-$w-${d%%:*}.log" &
    pids+=($!)
    until curl -sf localhost:$port/ready > /dev/null; do sleep 1; done
    name=${d%%:*}; [[ $d == none ]] && name=plain
    servers+=(--server "$name=http://127.0.0.1:$port")
    port=$((port + 1))
  done
  python3 docs/benchmarks/suffix-decoding/replay.py --workload "$w" "${servers[@]}" \
    --conversations "$n" --clients "$clients" --out "$out/$w.json" > "$out/$w.txt"
  cat "$out/$w.txt"
  kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null || true; pids=()
done
