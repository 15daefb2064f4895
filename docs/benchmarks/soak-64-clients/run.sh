#!/bin/sh
# 64 streaming clients for 10 minutes against one server with its default settings (32
# running, the rest queued), 20% of requests hung up mid-stream and 5% malformed; the
# server's RSS sampled every 15 s, /health read afterwards. Writes rss-kib.txt, loadtest.json and health.json here.
# Usage: SPECULA=target/release/specula docs/benchmarks/soak-64-clients/run.sh
set -eu
SPECULA=${SPECULA:-target/release/specula}
OUT=$(dirname "$0")
PORT=${PORT:-8097}
"$SPECULA" serve --port "$PORT" > "$OUT/serve.log" 2>&1 &
SP=$!
trap 'kill $SP 2>/dev/null' EXIT
until curl -sf "127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
START=$(date +%s)
( echo "t_s rss_kib"; while kill -0 $SP 2>/dev/null; do
    echo "$(( $(date +%s) - START )) $(awk '/VmRSS/ {print $2}' /proc/$SP/status)"; sleep 15; done ) > "$OUT/rss-kib.txt" &
"$SPECULA" loadtest --url "http://127.0.0.1:$PORT" --clients 64 --requests 1000000 --max-secs 600 \
    --max-tokens 64 --disconnect-fraction 0.2 --malformed-fraction 0.05 --json > "$OUT/loadtest.json"
sleep 2
curl -s "127.0.0.1:$PORT/health" > "$OUT/health.json"
kill $SP
