#!/usr/bin/env python3
"""Constrained decoding with and without speculation on one `specula serve`, alternating.

Each round sends the same JSON-schema chat requests (greedy, one at a time) with
"speculate": true and then false, and reports completion tokens per second of wall time,
drafted and accepted tokens, and whether the outputs are identical and parse.

    python3 docs/benchmarks/structured-outputs/bench.py http://127.0.0.1:8080 3
"""
import json
import sys
import time
import urllib.request

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a fictional software engineer as JSON.",
    "Describe a retired teacher who loves gardening as JSON.",
    "Describe a young musician from Paris as JSON.",
    "Describe a chef who runs a small restaurant as JSON.",
    "Describe a marathon runner as JSON.",
    "Describe a librarian with many hobbies as JSON.",
]


def post(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def run(url, speculate):
    tokens = drafted = accepted = 0
    outputs = []
    start = time.time()
    for p in PROMPTS:
        r = post(url, {"messages": [{"role": "user", "content": p}], "temperature": 0, "max_tokens": 128,
                       "speculate": speculate,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}})
        u = r["usage"]
        tokens += u["completion_tokens"]
        drafted += u.get("draft_n", 0)
        accepted += u.get("draft_n_accepted", 0)
        outputs.append(r["choices"][0]["message"]["content"])
    secs = time.time() - start
    parsed = sum(1 for o in outputs if isinstance(json.loads(o), dict))
    return tokens / secs, tokens, drafted, accepted, outputs, parsed


def main():
    url, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    print("round | speculate: tok/s (drafted, accepted) | plain: tok/s | ratio | identical | parse")
    for i in range(rounds):
        s = run(url, True)
        p = run(url, False)
        print(f"{i + 1} | {s[0]:.1f} ({s[2]}, {s[3]}) | {p[0]:.1f} | {s[0] / p[0]:.2f}x | "
              f"{s[4] == p[4]} | {s[5]}/{len(PROMPTS)}, {p[5]}/{len(PROMPTS)}")


if __name__ == "__main__":
    main()
