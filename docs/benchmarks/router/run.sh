#!/usr/bin/env bash
# Three specula replicas behind vllm-router, against one replica served directly.
#
#   python3 -m venv ~/.venvs/router && ~/.venvs/router/bin/pip install vllm-router==0.1.17
#   docs/benchmarks/router/run.sh [OUTDIR] [SCENARIO...]
#
# Scenarios (all by default): single, single_t1, cache_aware, round_robin, session_hash,
# fault_cache_aware, fault_round_robin. Every scenario starts fresh replicas
# (empty prefix caches) and, behind the router, a fresh router.
# Environment: SPECULA (binary, default `specula` on PATH), ROUTER (default
# ~/.venvs/router/bin/vllm-router), MTBENCH (MT-Bench question.jsonl, default
# specula's data cache), BASE_PORT (default 18200), CONVS, TURNS, CONC, MAXTOK,
# CB_TIMEOUT (the router's --cb-timeout-duration-secs, default 10; its own default is 60).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE/results}; shift || true
SCENARIOS=${*:-single single_t1 cache_aware round_robin session_hash fault_cache_aware fault_round_robin}
SPECULA=${SPECULA:-specula}
ROUTER=${ROUTER:-$HOME/.venvs/router/bin/vllm-router}
MTBENCH=${MTBENCH:-${SPECULA_HOME:-$HOME/.cache/specula}/data/mt-bench/question.jsonl}
BASE=${BASE_PORT:-18200}
CONVS=${CONVS:-32}; TURNS=${TURNS:-4}; CONC=${CONC:-6}; MAXTOK=${MAXTOK:-48}
CB_TIMEOUT=${CB_TIMEOUT:-10}
RPORT=$BASE; PROM=$((BASE + 9)); PORTS="$((BASE + 1)) $((BASE + 2)) $((BASE + 3))"
WORK=$(mktemp -d)
mkdir -p "$OUT"
PIDS=()

cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  PIDS=()
}
trap 'cleanup; rm -rf "$WORK"' EXIT

wait_ready() { # url path seconds
  for _ in $(seq 1 $(($3 * 10))); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$1$2")" = 200 ] && return 0
    sleep 0.1
  done
  echo "not ready: $1$2" >&2; return 1
}

start_replica() { # port threads logfile -> pid in REPLICA_PID
  "$SPECULA" serve smollm2-135m --port "$1" --drafter none -t "$2" >"$3" 2>&1 &
  REPLICA_PID=$!; PIDS+=("$REPLICA_PID")
  wait_ready "http://127.0.0.1:$1" /ready 120
}

start_router() { # policy logfile extra-args...
  local policy=$1 log=$2; shift 2
  local urls=(); for p in $PORTS; do urls+=("http://127.0.0.1:$p"); done
  echo "vllm-router --host 127.0.0.1 --port $RPORT --prometheus-port $PROM --worker-urls ${urls[*]}" \
       "--policy $policy $*" >"$log.cmd"
  "$ROUTER" --host 127.0.0.1 --port "$RPORT" --prometheus-port "$PROM" \
    --worker-urls "${urls[@]}" --policy "$policy" "$@" >"$log" 2>&1 &
  PIDS+=("$!")
  wait_ready "http://127.0.0.1:$RPORT" /v1/models 60
}

snapshot() { # dir label ports...
  local d=$1 label=$2; shift 2
  for p in "$@"; do curl -s "http://127.0.0.1:$p/metrics" >"$d/metrics-$label-$p.txt" || true; done
}

drive() { # url outdir extra-args...
  local url=$1 d=$2; shift 2
  python3 "$HERE/multiturn.py" --url "$url" --conversations "$CONVS" --turns "$TURNS" \
    --concurrency "$CONC" --max-tokens "$MAXTOK" --mt-bench "$MTBENCH" \
    --log "$d/requests.jsonl" "$@" >"$d/driver.json"
}

summarise() { # dir ports...
  local d=$1; shift
  python3 "$HERE/summarise.py" "$d" "$@" >"$d/summary.json"
  cat "$d/summary.json"
}

router_args=(--request-timeout-secs 60 --health-check-interval-secs 1
             --health-failure-threshold 2 --health-success-threshold 1
             --worker-startup-check-interval 1 --cb-timeout-duration-secs "$CB_TIMEOUT")

for s in $SCENARIOS; do
  d="$OUT/$s"; rm -rf "$d"; mkdir -p "$d"
  echo "== $s ($(date -u +%H:%M:%S))"
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "other processes at start (rustc/cargo/specula, program and crate):"
    pgrep -a 'rustc|cargo|clippy|specula' | sed -E 's#/[^ ]*/##g' | awk '{print $2, $3, $4}' || true
    echo "loadavg: $(cat /proc/loadavg)"
  } >"$d/quiet.txt"
  case $s in
    single|single_t1)
      threads=2; [ "$s" = single_t1 ] && threads=1
      start_replica "$((BASE + 1))" "$threads" "$d/replica-$((BASE + 1)).log"
      drive "http://127.0.0.1:$((BASE + 1))" "$d"
      snapshot "$d" end "$((BASE + 1))"
      summarise "$d" "$((BASE + 1))";;
    cache_aware|round_robin|session_hash)
      for p in $PORTS; do start_replica "$p" 1 "$d/replica-$p.log"; done
      case $s in
        cache_aware) start_router cache_aware "$d/router.log" "${router_args[@]}"; extra=();;
        round_robin) start_router round_robin "$d/router.log" "${router_args[@]}"; extra=();;
        session_hash) start_router consistent_hash "$d/router.log" "${router_args[@]}"
                      extra=(--session-header);;
      esac
      drive "http://127.0.0.1:$RPORT" "$d" "${extra[@]}"
      snapshot "$d" end $PORTS
      summarise "$d" $PORTS;;
    fault_cache_aware|fault_round_robin)
      policy=${s#fault_}
      for p in $PORTS; do start_replica "$p" 1 "$d/replica-$p.log"; done
      victim_pid=$REPLICA_PID; victim=$((BASE + 3))
      start_router "$policy" "$d/router.log" "${router_args[@]}"
      CONVS=$((CONVS * 3 / 2)) drive "http://127.0.0.1:$RPORT" "$d" --timeout 90 &
      drv=$!
      sleep 8
      snapshot "$d" before-kill $PORTS
      kill -KILL "$victim_pid"
      t_kill=$(date +%s.%N)
      sleep 12
      start_replica "$victim" 1 "$d/replica-$victim-restarted.log"
      t_back=$(date +%s.%N)
      snapshot "$d" rejoined "$victim"
      wait "$drv" || true
      snapshot "$d" end $PORTS
      python3 -c "import sys; k,b=map(float,sys.argv[1:]); print('{\"kill_epoch\": %.3f, \"restarted_ready_epoch\": %.3f}' % (k, b))" \
        "$t_kill" "$t_back" >"$d/fault-times.json"
      cat "$d/fault-times.json"
      summarise "$d" $PORTS;;
    *) echo "unknown scenario $s" >&2; exit 2;;
  esac
  echo "loadavg at end: $(cat /proc/loadavg)" >>"$d/quiet.txt"
  cleanup
  sleep 1
done
