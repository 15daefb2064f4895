#!/usr/bin/env python3
"""Summarise one scenario directory written by run.sh (stdlib only).

usage: summarise.py DIR PORT...

Reads DIR/driver.json, DIR/requests.jsonl and DIR/metrics-end-PORT.txt (and,
after a fault, DIR/metrics-before-kill-PORT.txt, DIR/metrics-rejoined-PORT.txt
and DIR/fault-times.json). Every replica starts with empty counters, so the
end snapshot is the scenario's total; a killed replica's counters up to the
kill are lost, and the summary says so.
"""
import json
import os
import re
import sys

KEYS = {
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
    "hit_tokens": "specula_prefix_cache_hit_tokens_total",
    "prefill_tokens": "specula_prefill_tokens_total",
    "finished": "specula_requests_finished_total",
    "failed": "specula_requests_failed_total",
    "cancelled": "specula_requests_cancelled_total",
    "generated": "specula_generated_tokens_total",
}


def read_metrics(path):
    vals = {}
    if not os.path.exists(path):
        return None
    for line in open(path):
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line.strip())
        if m:
            vals[m.group(1)] = vals.get(m.group(1), 0.0) + float(m.group(3))
    return {k: int(vals.get(v, 0)) for k, v in KEYS.items()}


def rate(a, b):
    return round(a / b, 4) if b else None


def main():
    d, ports = sys.argv[1], sys.argv[2:]
    out = {"driver": json.load(open(os.path.join(d, "driver.json")))}
    reps = {}
    tot = {k: 0 for k in KEYS}
    for p in ports:
        m = read_metrics(os.path.join(d, "metrics-end-%s.txt" % p))
        if m is None:
            continue
        reps[p] = m
        for k in KEYS:
            tot[k] += m[k]
    out["replicas"] = reps
    out["aggregate"] = dict(
        tot,
        hit_rate_vllm=rate(tot["hits"], tot["queries"]),
        hit_rate_specula=rate(tot["hit_tokens"], tot["hit_tokens"] + tot["prefill_tokens"]),
    )
    ft = os.path.join(d, "fault-times.json")
    if os.path.exists(ft):
        times = json.load(open(ft))
        t0 = out["driver"]["start_epoch"]
        kill = round(times["kill_epoch"] - t0, 3)
        reqs = [json.loads(l) for l in open(os.path.join(d, "requests.jsonl"))]
        bad = [r for r in reqs if r["outcome"] != "ok"]
        fault = {"kill_s": kill,
                 "restarted_ready_s": round(times["restarted_ready_epoch"] - t0, 3)}
        fault["failed_or_hung"] = [
            {k: r.get(k) for k in ("conv", "turn", "start", "end", "outcome", "error")} for r in bad]
        fault["last_failure_end_s_after_kill"] = (
            round(max(r["end"] for r in bad) - kill, 2) if bad else None)
        fault["requests_started_after_kill"] = sum(1 for r in reqs if r["start"] >= kill)
        fault["ok_started_after_kill"] = sum(
            1 for r in reqs if r["start"] >= kill and r["outcome"] == "ok")
        fault["max_latency_s"] = max((r["latency"] for r in reqs), default=None)
        before = {p: read_metrics(os.path.join(d, "metrics-before-kill-%s.txt" % p)) for p in ports}
        fault["finished_before_kill"] = {p: (m or {}).get("finished") for p, m in before.items()}
        rj = [p for p in ports if os.path.exists(os.path.join(d, "metrics-rejoined-%s.txt" % p))]
        for p in rj:
            fault["restarted_replica"] = p
            fault["restarted_finished_at_ready"] = read_metrics(
                os.path.join(d, "metrics-rejoined-%s.txt" % p))["finished"]
            fault["restarted_finished_at_end"] = reps.get(p, {}).get("finished")
        # the router's own log: its failed sends to the killed replica (whole seconds)
        rl = os.path.join(d, "router.log")
        if os.path.exists(rl) and "restarted_replica" in fault:
            import calendar, time as _t
            sends = []
            for line in open(rl, errors="replace"):
                line = re.sub(r"\x1b\[[0-9;]*m", "", line)
                if "Failed to send" in line and ":%s/" % fault["restarted_replica"] in line:
                    ts = calendar.timegm(_t.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
                    sends.append(ts - times["kill_epoch"])
            fault["router_failed_sends_to_killed"] = len(sends)
            fault["router_last_failed_send_s_after_kill"] = (
                "%d..%d" % (int(max(sends)) , int(max(sends)) + 1) if sends else None)
            fault["router_circuit_breaker_opened"] = sum(
                1 for l in open(rl, errors="replace") if "closed -> open" in l)
        fault["note"] = ("the killed replica's counters before the kill are lost; "
                         "aggregate counts after the kill only for it")
        out["fault"] = fault
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
