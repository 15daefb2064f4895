#!/usr/bin/env bash
# `specula loadtest` against specula's server and llama.cpp's, one after the other on one quiet
# machine, same model file, same load: the same metrics from both.
#
#   LLAMA_SERVER=/path/to/llama-server SPECULA=target/release/specula \
#     bash docs/benchmarks/loadtest-specula-vs-llamacpp/run.sh > docs/benchmarks/loadtest-specula-vs-llamacpp/results.json
set -euo pipefail
specula=${SPECULA:-target/release/specula}
model=$("$specula" fetch smollm2-135m 2>/dev/null | tail -1 | sed 's/^[^:]*: //')
load() { "$specula" loadtest --url "http://127.0.0.1:$1" --clients 1,4 --requests 8 --max-tokens 64 --ignore-eos --json; }
wait_up() { for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return; sleep 0.5; done; exit 1; }

"$specula" serve -m "$model" --port 8111 --drafter ngram 2> /dev/null & pid=$!
wait_up 8111
echo "{\"specula ngram\": $(load 8111),"
kill $pid; wait $pid 2> /dev/null || true

"$specula" serve -m "$model" --port 8112 --drafter none 2> /dev/null & pid=$!
wait_up 8112
echo "\"specula plain\": $(load 8112),"
kill $pid; wait $pid 2> /dev/null || true

"$LLAMA_SERVER" -m "$model" --port 8113 -t 2 -np 4 -c 4096 > /dev/null 2>&1 & pid=$!
wait_up 8113
echo "\"llama.cpp\": $(load 8113)}"
kill $pid; wait $pid 2> /dev/null || true
