#!/usr/bin/env bash
# The suffix cache's memory under a long stream of short requests: the server's resident
# memory and the cache's own count, sampled every 10 s while `specula loadtest` sends REQUESTS.
# usage: [DRAFTER=suffix] docs/benchmarks/suffix-decoding/memory.sh [REQUESTS] [CACHE_MB]
# Results: docs/benchmarks/suffix-decoding/memory[-DRAFTER]/{samples.csv,loadtest.json,cpu.txt} (no
# suffix for the suffix drafter; another drafter gives the baseline of the rest of the server)
set -euo pipefail
cd "$(dirname "$0")/../../.."
requests=${1:-100000} mb=${2:-16}
cargo build --release -q
tmp=$(mktemp -d); bin=$tmp/specula; cp target/release/specula "$bin"
drafter=${DRAFTER:-suffix}
out=docs/benchmarks/suffix-decoding/memory; [[ $drafter == suffix ]] || out=$out-$drafter; mkdir -p "$out"
{ grep -m1 "model name" /proc/cpuinfo; grep -o -w 'avx512_vnni\|amx_int8\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } > "$out/cpu.txt"
"$bin" serve -m smollm2-135m --drafter "$drafter" --suffix-cache-mb "$mb" --suffix-scope global --port 8301 2> "$tmp/server-$drafter.log" &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf localhost:8301/health > /dev/null; do sleep 1; done
# Sampled output (temperature 1), so that every request adds text the cache has not seen.
"$bin" loadtest --url http://127.0.0.1:8301 --clients 8 --requests "$requests" --max-tokens 4 \
  --temperature 1 --max-secs 7200 --json > "$out/loadtest.json" &
load=$!
echo "secs,rss_mib,cache_bytes,cache_requests,evicted_requests,finished_requests" > "$out/samples.csv"
start=$(date +%s)
while kill -0 $load 2> /dev/null; do
  rss=$(awk '/VmRSS/ {printf "%.1f", $2 / 1024}' /proc/$server/status)
  h=$(curl -sf localhost:8301/health || echo '{}')
  fin=$(curl -sf localhost:8301/metrics | awk '/^specula_requests_finished_total/ {print $2}')
  echo "$h" | python3 -c "import json,sys; h=json.load(sys.stdin).get('suffix_cache',{}); print(f\"$(( $(date +%s) - start )),$rss,{h.get('bytes')},{h.get('requests')},{h.get('evicted_requests')},$fin\")" >> "$out/samples.csv"
  sleep 10
done
wait $load
# The start of the server's log (one line per request follows).
head -n 40 "$tmp/server-$drafter.log" > "$out/server.log"
tail -3 "$out/samples.csv"
