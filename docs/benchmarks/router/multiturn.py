#!/usr/bin/env python3
"""Multi-turn chat driver for an OpenAI-compatible server or router (stdlib only).

Each conversation sends its turns in order; turn k's messages are turns
1..k-1 (user message and the server's own streamed reply) plus a new user
message, so every turn shares the previous turn's prompt as a prefix.
`--conversations` conversations run, at most `--concurrency` at a time.

User messages: MT-Bench's two turns per question (`--mt-bench FILE`, the
question.jsonl of FastChat's llm_judge), then fixed follow-ups up to
`--turns`; without a file, deterministic generated conversations.

Every request has its own deadline (`--timeout`): a request that has not
finished by then is cut and counted as a hang, apart from failures (an HTTP
error, a refused or reset connection, an error event in the stream). A failed
turn ends its conversation (the later turns would lack the reply).

Prints one JSON object: requests ok / failed / hung, completion tokens,
wall time, tokens/s, latency percentiles, failures by kind, and the run's
start as Unix time. `--log FILE` writes one JSON line per request (start/end
seconds from the run's start).
"""
import argparse
import http.client
import json
import socket
import sys
import threading
import time
import urllib.parse

FOLLOW_UPS = [
    "Summarise your previous answers in three short bullet points.",
    "Which of those points matters most, and why? Answer in two sentences.",
    "Give one concrete example that illustrates it.",
    "Now restate everything above as a single sentence.",
]

TOPICS = ["a lighthouse", "a bakery", "a chess club", "a river town",
          "a robot gardener", "a night train", "a mountain school", "a city library"]


def load_conversations(n, turns, mt_bench):
    convs = []
    if mt_bench:
        with open(mt_bench) as f:
            qs = [json.loads(line) for line in f if line.strip()]
        qs.sort(key=lambda q: q["question_id"])
        for q in qs[:n]:
            user = list(q["turns"])[:turns]
            user += FOLLOW_UPS[: max(0, turns - len(user))]
            convs.append({"id": "mt-bench-%d" % q["question_id"], "turns": user})
    while len(convs) < n:  # deterministic generated conversations
        i = len(convs)
        t = TOPICS[i % len(TOPICS)]
        user = ["Write a short story (about 150 words) about %s, number %d." % (t, i),
                "Rewrite the story from the point of view of a minor character."]
        user = (user + FOLLOW_UPS)[:turns]
        convs.append({"id": "generated-%d" % i, "turns": user})
    return convs


class Failure(Exception):
    pass


def stream_chat(url, model, messages, max_tokens, deadline, session=None):
    """One streaming chat completion. Returns (text, completion_tokens, ttft).
    Raises Failure(kind) for errors, TimeoutError past the deadline."""
    u = urllib.parse.urlparse(url)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError()
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=remaining)
    body = json.dumps({
        "model": model, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    })
    t0 = time.monotonic()
    ttft = None
    text = []
    chunks = 0
    usage_tokens = None
    try:
        try:
            headers = {"Content-Type": "application/json"}
            if session:
                headers["X-Session-Id"] = session
            conn.request("POST", "/v1/chat/completions", body, headers)
            resp = conn.getresponse()
        except (socket.timeout, TimeoutError):
            raise TimeoutError()
        except (ConnectionError, OSError, http.client.HTTPException) as e:
            raise Failure("connect: %s" % type(e).__name__)
        if resp.status != 200:
            detail = resp.read(300).decode("utf-8", "replace").replace("\n", " ")
            raise Failure("http %d: %s" % (resp.status, detail[:120]))
        done = False
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError()
            conn.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                line = resp.readline()
            except (socket.timeout, TimeoutError):
                raise TimeoutError()
            except (ConnectionError, OSError, http.client.HTTPException) as e:
                raise Failure("stream: %s" % type(e).__name__)
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                ev = json.loads(data)
            except ValueError:
                raise Failure("stream: bad json")
            if "error" in ev:
                raise Failure("stream error event: %s" % str(ev["error"])[:120])
            if ev.get("usage"):
                usage_tokens = ev["usage"].get("completion_tokens")
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    text.append(piece)
                    chunks += 1
        if not done:
            raise Failure("stream: ended without [DONE]")
    finally:
        conn.close()
    return "".join(text), (usage_tokens if usage_tokens is not None else chunks), ttft


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds one request may take before it counts as a hang")
    ap.add_argument("--mt-bench", help="MT-Bench question.jsonl (else generated conversations)")
    ap.add_argument("--session-header", action="store_true",
                    help="send X-Session-Id: <conversation id> (for session-affinity routing)")
    ap.add_argument("--log", help="write one JSON line per request here")
    a = ap.parse_args()

    convs = load_conversations(a.conversations, a.turns, a.mt_bench)
    lock = threading.Lock()
    records = []
    next_conv = [0]
    start = time.monotonic()
    start_epoch = time.time()

    def worker():
        while True:
            with lock:
                if next_conv[0] >= len(convs):
                    return
                conv = convs[next_conv[0]]
                next_conv[0] += 1
            messages = []
            for k, user in enumerate(conv["turns"]):
                messages.append({"role": "user", "content": user})
                t0 = time.monotonic()
                rec = {"conv": conv["id"], "turn": k + 1, "start": round(t0 - start, 3)}
                try:
                    reply, ntok, ttft = stream_chat(a.url, a.model, messages, a.max_tokens,
                                                    t0 + a.timeout,
                                                    conv["id"] if a.session_header else None)
                    rec.update(outcome="ok", tokens=ntok,
                               ttft=None if ttft is None else round(ttft, 4))
                except TimeoutError:
                    rec.update(outcome="hang", error="no end within %gs" % a.timeout)
                except Failure as e:
                    rec.update(outcome="failed", error=str(e))
                t1 = time.monotonic()
                rec.update(end=round(t1 - start, 3), latency=round(t1 - t0, 3))
                with lock:
                    records.append(rec)
                if rec["outcome"] != "ok":
                    break
                messages.append({"role": "assistant", "content": reply})

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start

    ok = [r for r in records if r["outcome"] == "ok"]
    failed = [r for r in records if r["outcome"] == "failed"]
    hung = [r for r in records if r["outcome"] == "hang"]
    tokens = sum(r["tokens"] for r in ok)
    kinds = {}
    for r in failed + hung:
        kinds[r["error"]] = kinds.get(r["error"], 0) + 1
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    planned = sum(len(c["turns"]) for c in convs)
    summary = {
        "url": a.url, "start_epoch": round(start_epoch, 3), "conversations": len(convs), "turns": a.turns,
        "concurrency": a.concurrency, "max_tokens": a.max_tokens,
        "requests_planned": planned, "requests_sent": len(records),
        "requests_ok": len(ok), "requests_failed": len(failed), "requests_hung": len(hung),
        "requests_not_sent": planned - len(records),
        "completion_tokens": tokens, "wall_s": round(wall, 2),
        "output_tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "errors": kinds,
    }
    if a.log:
        with open(a.log, "w") as f:
            for r in sorted(records, key=lambda r: r["start"]):
                f.write(json.dumps(r) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
