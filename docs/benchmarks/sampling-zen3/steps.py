"""Per data set, temperature and mode of a `bench --mode spec` report: decode ms per token, and
ms per step outside the forward (decode time less forward, drafting and catch-up time)."""
import json
import sys
from collections import defaultdict

report = json.load(open(sys.argv[1]))
for model in report["models"]:
    totals = defaultdict(lambda: defaultdict(float))
    for run in model["runs"]:
        m = run.get("metrics") or {}
        t = totals[(run["dataset"], run["temperature"], run["mode"].split(" ")[0].split("/")[-1])]
        t["decode"] += run["decode_secs"]
        t["tokens"] += run["tokens"]
        t["steps"] += m.get("steps", 0)
        t["outside"] += run["decode_secs"] - m.get("verify_secs", 0) - m.get("draft_secs", 0) - m.get("catch_up_secs", 0)
    for (dataset, temperature, mode), t in totals.items():
        print(f"{dataset:10} T={temperature:g} {mode:22} {1e3 * t['decode'] / t['tokens']:6.3f} ms/token"
              f" {1e3 * t['outside'] / max(t['steps'], 1):6.3f} ms/step outside the forward")
