"""Speedup over plain decoding of each adaptive mode (cold / warm start), per data set and
temperature, from each `bench --mode spec` report under a folder (BUILD-ROUND/report.json), with
the drafting steps per request and τ; then per build and mode the geometric mean over sets and
rounds, end to end and of decoding alone. At T > 0 the speculative and the plain run sample
different (equally likely) outputs, which can end at different lengths: a shorter output spreads
the same prefill over fewer tokens, so there the decode ratio is the steadier measure."""
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

here = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
rows = defaultdict(dict)
per_build = defaultdict(list)
for report in sorted(here.glob("*-[0-9]/report.json")):
    tag = report.parent.name
    for model in json.load(open(report))["models"]:
        cells = defaultdict(lambda: defaultdict(float))
        for run in model["runs"]:
            mode = "plain" if run["mode"] == "plain" else ("warm" if run["mode"].endswith(" warm") else "cold")
            c = cells[(run["dataset"], run["temperature"], mode)]
            c["secs"] += run["prefill_secs"] + run["decode_secs"]
            c["tokens"] += run["tokens"]
            c["decode_secs"] += run["decode_secs"]
            c["decode_tokens"] += max(run["tokens"] - 1, 0)
            m = run.get("metrics") or {}
            c["requests"] += 1
            c["spec_steps"] += m.get("spec_steps", 0)
            c["committed"] += m.get("committed", 0)
            c["steps"] += m.get("steps", 0)
        for (dataset, t, mode), c in cells.items():
            if mode == "plain":
                continue
            plain = cells[(dataset, t, "plain")]
            speed = (c["tokens"] / c["secs"]) / (plain["tokens"] / plain["secs"])
            decode = (c["decode_tokens"] / c["decode_secs"]) / (plain["decode_tokens"] / plain["decode_secs"])
            rows[(dataset, t, mode)][tag] = (speed, c["spec_steps"] / c["requests"], c["committed"] / max(c["steps"], 1))
            per_build[(tag.rsplit("-", 1)[0], mode, t)].append((speed, decode))
tags = sorted({tag for r in rows.values() for tag in r})
print("speedup over plain (drafting steps per request, τ)\n")
print("| data set | T | start | " + " | ".join(tags) + " |")
print("|---|---|---|" + "---|" * len(tags))
for (dataset, t, mode), r in sorted(rows.items()):
    cell = lambda tag: "–" if tag not in r else f"{r[tag][0]:.2f}× ({r[tag][1]:.1f}, {r[tag][2]:.2f})"
    print(f"| {dataset} | {t:g} | {mode} | " + " | ".join(cell(tag) for tag in tags) + " |")
print("\n| build | start | T | geometric mean | lowest | decode: geometric mean | lowest |\n|---|---|---|---|---|---|---|")
gmean = lambda v: math.exp(sum(map(math.log, v)) / len(v))
for (build, mode, t), v in sorted(per_build.items()):
    e2e, dec = [x[0] for x in v], [x[1] for x in v]
    print(f"| {build} | {mode} | {t:g} | {gmean(e2e):.3f}× | {min(e2e):.2f}× | {gmean(dec):.3f}× | {min(dec):.2f}× |")
