#!/usr/bin/env bash
# Log-probabilities on a server: a build before and after, alternating, two rounds. Each build
# serves SmolLM2-135M (`--drafter none`) and answers 8 completions of 128 tokens (greedy,
# end-of-sequence ignored) without log-probs and with `logprobs: 5`, one at a time.
#   BEFORE=/path/to/old/specula AFTER=target/release/specula bash docs/benchmarks/sampling-zen3/logprobs.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${BEFORE:?a build of the commit before}" "${AFTER:=target/release/specula}"
out="$here/logprobs.txt"; : > "$out"
port=8231
for round in 1 2; do
  for build in before after; do
    bin=$BEFORE; [ "$build" = after ] && bin=$AFTER
    "$bin" serve -m smollm2-135m --drafter none --port $port 2> /dev/null &
    pid=$!
    until curl -sf localhost:$port/ready > /dev/null; do sleep 0.5; done
    for logprobs in null 5; do
      python3 - "$port" "$logprobs" "$build" "$round" >> "$out" <<'PY'
import json, sys, time, urllib.request
port, logprobs, build, round_ = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
prompts = ["def fibonacci(n):", "The history of the printing press", "Q: What is 17 * 23?\nA:",
           "Write a haiku about autumn.", "import numpy as np\n", "Once upon a time",
           "The three laws of thermodynamics are", "SELECT name FROM users WHERE"]
tokens, secs = 0, 0.0
for p in prompts:
    body = {"prompt": p, "max_tokens": 128, "temperature": 0, "ignore_eos": True, "logprobs": logprobs}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    reply = json.load(urllib.request.urlopen(req))
    secs += time.perf_counter() - t
    tokens += reply["usage"]["completion_tokens"]
    assert (logprobs is None) == (reply["choices"][0].get("logprobs") is None)
print(f"round {round_} {build:6} logprobs={logprobs}: {tokens} tokens in {secs:.2f} s, {tokens / secs:.1f} tok/s")
PY
    done
    kill $pid; wait $pid 2>/dev/null || true
  done
done
cat "$out"
