#!/usr/bin/env python3
"""Drives a running `specula serve` with the official `openai` Python client.

Started by tests/server_openai_python.rs, which runs two servers on 127.0.0.1 and passes:
  --base-url  http://127.0.0.1:PORT/v1   the main server (no API key, 1024-token context)
  --tiny-url  http://127.0.0.1:PORT/v1   one running + one waiting request at most, API key "sekrit"
  --cases     FILE  greedy references computed with engine::generate (what `specula generate` runs)

Prints one line per check and a closing "N passed, M failed" line; exits non-zero on failure.
"""

import argparse
import json
import sys
import threading
import time
import traceback
import urllib.request

import urllib.error

import openai

MODEL = "smollm2-135m"
RESULTS = []


def check(name):
    """Runs the decorated function at once, recording and printing its outcome."""

    def run(fn):
        started = time.time()
        try:
            fn()
            RESULTS.append((name, None))
            print(f"ok    {name} ({time.time() - started:.1f}s)", flush=True)
        except Exception:  # report every failure, keep going
            RESULTS.append((name, traceback.format_exc()))
            print(f"FAIL  {name}\n{traceback.format_exc()}", flush=True)

    return run


def health(base_url):
    root = base_url.rsplit("/v1", 1)[0]
    with urllib.request.urlopen(root + "/health", timeout=10) as r:
        return json.load(r)


def raw_post(url, body):
    """POSTs raw bytes; returns (status, body text)."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_idle(base_url, within=15.0):
    deadline = time.time() + within
    while True:
        h = health(base_url)
        if h["kv"]["used_blocks"] == 0 and h["running"] == 0 and h["waiting"] == 0:
            return h
        assert time.time() < deadline, f"server not idle: {h}"
        time.sleep(0.05)


def expect_error(fn, exc_type, status, param=None, code=None, needle=None):
    try:
        fn()
    except exc_type as e:
        assert e.status_code == status, (e.status_code, e.body)
        err = e.body if isinstance(e.body, dict) else {}
        if "error" in err:
            err = err["error"]
        if param is not None:
            assert err.get("param") == param, err
        if code is not None:
            assert err.get("code") == code, err
        if needle is not None:
            assert needle.lower() in str(err.get("message", "")).lower(), err
        return err
    raise AssertionError(f"expected {exc_type.__name__} {status}")


def completion_text(client, case, **extra):
    if case["chat"]:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": case["prompt"]}],
            max_tokens=case["max_tokens"], temperature=0, **extra)
        return r.choices[0].message.content, r
    r = client.completions.create(model=MODEL, prompt=case["prompt"], max_tokens=case["max_tokens"], temperature=0, **extra)
    return r.choices[0].text, r


def stream_text(client, case):
    if case["chat"]:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": case["prompt"]}],
            max_tokens=case["max_tokens"], temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    stream = client.completions.create(model=MODEL, prompt=case["prompt"], max_tokens=case["max_tokens"], temperature=0, stream=True)
    return "".join(c.choices[0].text for c in stream if c.choices)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--tiny-url", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--tools-url", required=True)
    args = ap.parse_args()
    cases = json.load(open(args.cases))
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=300)

    @check("models list")
    def _():
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]

    @check("chat and completion, not streamed, equal specula generate (greedy)")
    def _():
        for case in cases:
            text, r = completion_text(client, case)
            assert text == case["expected"], (case["prompt"], text, case["expected"])
            assert r.usage.completion_tokens == case["completion_tokens"], r.usage
            assert r.usage.prompt_tokens == case["prompt_tokens"], r.usage
            extra = r.usage.model_extra or {}
            assert "draft_n" in extra and "draft_n_accepted" in extra, r.usage

    @check("chat and completion, streamed, equal specula generate (greedy)")
    def _():
        for case in cases[:2]:
            assert stream_text(client, case) == case["expected"], case["prompt"]

    @check("8 concurrent streamed requests equal specula generate")
    def _():
        out = [None] * len(cases)

        def worker(i):
            try:
                out[i] = stream_text(client, cases[i])
            except Exception as e:  # surfaced by the comparison below
                out[i] = repr(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for case, got in zip(cases, out):
            assert got == case["expected"], (case["prompt"], got, case["expected"])
        wait_idle(args.base_url)

    @check("stream_options.include_usage and finish reasons")
    def _():
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count from one to twenty in words."}],
            max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        usage_chunks = [c for c in chunks if c.usage is not None]
        assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"], finishes
        assert chunks[-1].usage.completion_tokens == 12
        # The specula extension: per token source, for the playground.
        sources = [s for c in chunks for s in ((c.model_extra or {}).get("specula") or {}).get("sources", [])]
        assert len(sources) == 12 and set(sources) <= {"draft", "target"}, sources

    @check("stop sequences")
    def _():
        case = cases[0]
        full, _ = completion_text(client, case)
        words = full.split()
        assert len(words) >= 3, full
        stop = words[1]
        cut = full.index(stop)
        text, r = completion_text(client, case, stop=[stop])
        assert text == full[:cut], (text, full[:cut])
        assert r.choices[0].finish_reason == "stop"
        if case["chat"]:
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": case["prompt"]}],
                max_tokens=case["max_tokens"], temperature=0, stream=True, stop=stop)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full[:cut]

    @check("seed reproducibility")
    def _():
        def sample(seed):
            r = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=20, temperature=1.0, seed=seed)
            return r.choices[0].text

        a = sample(7)
        assert a == sample(7)
        assert a != sample(8)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                           max_tokens=10, temperature=0.8, top_p=0.9, seed=3,
                                           extra_body={"top_k": 40, "min_p": 0.05})
        r2 = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                            max_tokens=10, temperature=0.8, top_p=0.9, seed=3,
                                            extra_body={"top_k": 40, "min_p": 0.05})
        assert r.choices[0].message.content == r2.choices[0].message.content

    @check("bad inputs: OpenAI errors with the right status")
    def _():
        chat = client.chat.completions.create
        msgs = [{"role": "user", "content": "hi"}]
        expect_error(lambda: chat(model=MODEL, messages=[]), openai.BadRequestError, 400, param="messages")
        expect_error(lambda: chat(model=MODEL, messages=msgs, max_tokens=0), openai.BadRequestError, 400, param="max_tokens")
        expect_error(lambda: chat(model=MODEL, messages=msgs, max_tokens=-3), openai.BadRequestError, 400, param="max_tokens")
        expect_error(lambda: chat(model=MODEL, messages=msgs, max_completion_tokens=0), openai.BadRequestError, 400,
                     param="max_completion_tokens")
        expect_error(lambda: chat(model=MODEL, messages=msgs, max_tokens=5000), openai.BadRequestError, 400,
                     param="max_tokens", code="context_length_exceeded")
        expect_error(lambda: chat(model=MODEL, messages=msgs, temperature="hot"), openai.BadRequestError, 400, param="temperature")
        expect_error(lambda: chat(model=MODEL, messages=msgs, n=17), openai.BadRequestError, 400, param="n")
        expect_error(lambda: chat(model=MODEL, messages=[{"role": "wizard", "content": "x"}]), openai.BadRequestError, 400,
                     param="messages[0].role")
        expect_error(lambda: chat(model="gpt-99", messages=msgs), openai.NotFoundError, 404, param="model", code="model_not_found")
        expect_error(lambda: client.completions.create(model=MODEL, prompt="word " * 1100, max_tokens=1),
                     openai.BadRequestError, 400, code="context_length_exceeded")
        # Bodies the client library would never send: raw HTTP.
        url = args.base_url + "/chat/completions"
        for body, status, needle in [
            (b'{"messages": [', 400, "parse the json"),
            (b'{"messages":[{"role":"user","content":"\xff\xfe"}]}', 400, "utf-8"),
            (b'{"prompt": "' + b"a" * (1 << 20) + b'"}', 413, "larger than"),
        ]:
            status_got, payload = raw_post(url, body)
            assert status_got == status, (status_got, payload)
            err = json.loads(payload)["error"]
            assert needle in err["message"].lower() and {"type", "param", "code"} <= set(err), err
        # The server keeps serving.
        r = chat(model=MODEL, messages=msgs, max_tokens=3, temperature=0)
        assert r.choices[0].message.content is not None

    @check("a client that disconnects mid-stream frees its KV blocks")
    def _():
        with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
                max_tokens=900, temperature=0, stream=True, extra_body={"ignore_eos": True}) as resp:
            # Held in a name: a `for` over a temporary `iter_lines()` drops it at `break`,
            # which closes the connection, i.e. disconnects before the check below.
            stream = resp.iter_lines()
            lines = 0
            for line in stream:
                if line.startswith("data:"):
                    lines += 1
                if lines >= 4:
                    break
            # /health reports the engine as of its last finished step: allow it a moment.
            deadline = time.time() + 5
            while (h := health(args.base_url))["kv"]["used_blocks"] == 0:
                assert time.time() < deadline, f"no KV blocks in use while streaming: {h}"
                time.sleep(0.02)
            assert h["running"] == 1, h
        h = wait_idle(args.base_url)
        assert h["kv"]["free_blocks"] == h["kv"]["total_blocks"], h

    @check("API key, and 503 when the queue is full")
    def _():
        tiny = openai.OpenAI(base_url=args.tiny_url, api_key="sekrit", max_retries=0, timeout=300)
        wrong = openai.OpenAI(base_url=args.tiny_url, api_key="nope", max_retries=0, timeout=60)
        expect_error(lambda: wrong.models.list(), openai.AuthenticationError, 401, code="invalid_api_key")
        long_req = dict(model=MODEL, prompt="Write a very long essay about rivers.", max_tokens=3000, temperature=0, stream=True,
                        extra_body={"ignore_eos": True})
        first = tiny.completions.create(**long_req)
        next(iter(first))  # running
        second_started = threading.Event()

        def second():
            s = tiny.completions.create(**long_req)
            second_started.set()
            for _ in s:
                pass

        t = threading.Thread(target=second, daemon=True)
        t.start()
        second_started.wait(60)
        deadline = time.time() + 30
        while health(args.tiny_url)["waiting"] != 1:
            assert time.time() < deadline, "second request never queued"
            time.sleep(0.02)
        err = expect_error(lambda: tiny.completions.create(**long_req), openai.InternalServerError, 503, code="server_overloaded")
        assert "overloaded" in err["message"]
        first.close()
        # Closing the first stream cancels it; the waiting one starts.
        deadline = time.time() + 30
        while health(args.tiny_url)["waiting"] != 0:
            assert time.time() < deadline, "the queued request never started"
            time.sleep(0.05)

    tools_client = openai.OpenAI(base_url=args.tools_url, api_key="unused", max_retries=0, timeout=300)
    weather = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                       "required": ["city"], "additionalProperties": False}}}]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]

    @check("tool calls: required, named and streamed, then a tool result round trip")
    def _():
        r = tools_client.chat.completions.create(model=MODEL, messages=question, tools=weather,
                                                 tool_choice="required", temperature=0, max_tokens=64)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather", call
        assert isinstance(json.loads(call.function.arguments)["city"], str), call
        named = {"type": "function", "function": {"name": "get_weather"}}
        stream = tools_client.chat.completions.create(model=MODEL, messages=question, tools=weather,
                                                      tool_choice=named, temperature=0, max_tokens=64, stream=True)
        names, args_text, finish = [], "", None
        for c in stream:
            if not c.choices:
                continue
            for d in c.choices[0].delta.tool_calls or []:
                if d.function and d.function.name:
                    names.append(d.function.name)
                args_text += (d.function.arguments or "") if d.function else ""
            finish = c.choices[0].finish_reason or finish
        assert names == ["get_weather"] and finish == "tool_calls", (names, finish)
        assert json.loads(args_text) == json.loads(call.function.arguments), (args_text, call)
        followup = question + [choice.message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
        r = tools_client.chat.completions.create(model=MODEL, messages=followup, tools=weather,
                                                 tool_choice="none", temperature=0, max_tokens=16)
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls, r.choices[0]

    def collect_stream(stream):
        """Per choice index: text, log-prob entries, tool-call names and arguments, finish."""
        out = {}
        for c in stream:
            for ch in c.choices:
                o = out.setdefault(ch.index, {"text": "", "lps": [], "names": [], "args": "", "finish": None})
                o["text"] += ch.delta.content or ""
                if ch.logprobs and ch.logprobs.content:
                    o["lps"] += ch.logprobs.content
                for d in ch.delta.tool_calls or []:
                    if d.function and d.function.name:
                        o["names"].append(d.function.name)
                    o["args"] += (d.function.arguments or "") if d.function else ""
                o["finish"] = ch.finish_reason or o["finish"]
        return out

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
              "required": ["city"], "additionalProperties": False}
    for speculate in (True, False):
        extra = {"speculate": speculate}

        @check(f"log-probs and n = 3, streamed and not (speculate={speculate})")
        def _():
            kw = dict(model=MODEL, messages=question, temperature=0, max_tokens=8, logprobs=True,
                      top_logprobs=2, n=3, extra_body=extra)
            r = client.chat.completions.create(**kw)
            assert len(r.choices) == 3 and len({c.message.content for c in r.choices}) == 1, r.choices
            lps = r.choices[0].logprobs.content
            assert len(lps) == r.usage.completion_tokens // 3, (len(lps), r.usage)
            assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lps)
            streamed = collect_stream(client.chat.completions.create(stream=True, **kw))
            assert sorted(streamed) == [0, 1, 2], streamed.keys()
            for i in range(3):
                assert streamed[i]["text"] == r.choices[i].message.content, (streamed[i], r.choices[i])
                got = [(t.token, round(t.logprob, 5)) for t in streamed[i]["lps"]]
                want = [(t.token, round(t.logprob, 5)) for t in r.choices[i].logprobs.content]
                assert got == want, (got, want)

        @check(f"JSON schema response format, streamed and not (speculate={speculate})")
        def _():
            kw = dict(model=MODEL, messages=question, temperature=0, max_tokens=48, extra_body=extra,
                      response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
            r = client.chat.completions.create(**kw)
            assert isinstance(json.loads(r.choices[0].message.content)["city"], str), r.choices[0].message
            streamed = collect_stream(client.chat.completions.create(stream=True, **kw))
            assert streamed[0]["text"] == r.choices[0].message.content, (streamed[0], r.choices[0])

        @check(f"a required tool call, streamed and not (speculate={speculate})")
        def _():
            kw = dict(model=MODEL, messages=question, tools=weather, tool_choice="required", temperature=0,
                      max_tokens=64, extra_body=extra)
            r = tools_client.chat.completions.create(**kw)
            call = r.choices[0].message.tool_calls[0]
            streamed = collect_stream(tools_client.chat.completions.create(stream=True, **kw))
            assert streamed[0]["names"] == [call.function.name] and streamed[0]["finish"] == "tool_calls", streamed
            assert json.loads(streamed[0]["args"]) == json.loads(call.function.arguments)

    failed = [n for n, e in RESULTS if e]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
