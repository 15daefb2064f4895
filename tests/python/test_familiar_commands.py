#!/usr/bin/env python3
"""Checks a `specula serve` started with a llama.cpp user's or a vLLM user's command line.

Started by tests/server_cli.rs with:
  --base-url       http://127.0.0.1:PORT/v1
  --name           the name given by --alias / --served-model-name
  --max-model-len  the -c / --max-model-len given
  --api-key        the --api-key given, if any

Prints one line per check and a closing "N passed, M failed" line; exits non-zero on failure.
"""

import argparse
import json
import sys
import traceback
import urllib.error
import urllib.request

import openai

RESULTS = []


def check(name):
    def run(fn):
        try:
            fn()
            RESULTS.append((name, None))
            print(f"ok    {name}", flush=True)
        except Exception:  # report every failure, keep going
            RESULTS.append((name, traceback.format_exc()))
            print(f"FAIL  {name}\n{traceback.format_exc()}", flush=True)

    return run


def post(url, body, key):
    """POSTs JSON; returns (status, parsed body)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "null")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
    root = args.base_url.rsplit("/v1", 1)[0]
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key or "unused", max_retries=0)
    limit = args.max_model_len

    @check("the model is listed under the served name, with its max_model_len")
    def _():
        models = client.models.list().data
        assert [m.id for m in models] == [args.name], models
        extra = models[0].model_extra or {}
        assert extra.get("max_model_len") == limit, extra

    @check("a chat completion names the model by the served name")
    def _():
        r = client.chat.completions.create(
            model=args.name,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
        )
        assert r.model == args.name, r.model
        assert r.choices[0].message.content, r
        assert r.usage.completion_tokens >= 1, r.usage

    @check(f"a request longer than {limit} tokens gets a 400 in vLLM's error shape")
    def _():
        # Each " hello" is one token in SmolLM2's vocabulary: well past the limit.
        prompt = " hello" * (limit + 200)
        try:
            client.completions.create(model=args.name, prompt=prompt, max_tokens=4)
        except openai.BadRequestError as e:
            assert e.status_code == 400, e.status_code
            body = e.body if isinstance(e.body, dict) else {}
            # The client hands over the `error` object: message, type, param, code.
            assert set(["message", "type", "param", "code"]) <= set(body), body
            assert f"maximum context length is {limit} tokens" in body["message"], body
        else:
            raise AssertionError("an over-long prompt was accepted")

    @check("/tokenize and /detokenize round-trip text (vLLM's shape)")
    def _():
        text = "The capital of France is Paris. 12345 ¿Qué? 東京 🙂"
        status, tok = post(root + "/tokenize", {"model": args.name, "prompt": text, "add_special_tokens": False,
                                                "return_token_strs": True}, args.api_key)
        assert status == 200, tok
        assert tok["count"] == len(tok["tokens"]) > 5, tok
        assert tok["max_model_len"] == limit, tok
        assert len(tok["token_strs"]) == tok["count"], tok
        status, detok = post(root + "/detokenize", {"model": args.name, "tokens": tok["tokens"]}, args.api_key)
        assert status == 200, detok
        assert detok["prompt"] == text, detok

    @check("/tokenize of messages counts what a chat completion's prompt counts")
    def _():
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        status, tok = post(root + "/tokenize", {"model": args.name, "messages": messages}, args.api_key)
        assert status == 200, tok
        r = client.chat.completions.create(model=args.name, messages=messages, max_tokens=1, temperature=0)
        assert tok["count"] == r.usage.prompt_tokens, (tok["count"], r.usage)
        status, detok = post(root + "/detokenize", {"tokens": tok["tokens"]}, args.api_key)
        assert status == 200 and "What is 2 + 2?" in detok["prompt"], detok

    @check("llama-server's /tokenize shape: content, with_pieces")
    def _():
        status, tok = post(root + "/tokenize", {"content": "Hello world", "with_pieces": True}, args.api_key)
        assert status == 200, tok
        assert "".join(t["piece"] for t in tok["tokens"]) == "Hello world", tok
        status, detok = post(root + "/detokenize", {"tokens": [t["id"] for t in tok["tokens"]]}, args.api_key)
        assert status == 200 and detok["content"] == "Hello world", detok

    @check("/tokenize refuses bad input with a 400 naming the field")
    def _():
        status, err = post(root + "/tokenize", {"model": args.name}, args.api_key)
        assert status == 400 and err["error"]["param"] == "prompt", err
        status, err = post(root + "/detokenize", {"tokens": [1, -3]}, args.api_key)
        assert status == 400 and err["error"]["param"] == "tokens[1]", err
        status, err = post(root + "/tokenize", {"model": "someone-else", "prompt": "x"}, args.api_key)
        assert status == 404, err

    if args.api_key:

        @check("the API key guards /tokenize too")
        def _():
            status, err = post(root + "/tokenize", {"prompt": "x"}, None)
            assert status == 401, err
            try:
                openai.OpenAI(base_url=args.base_url, api_key="wrong", max_retries=0).models.list()
            except openai.AuthenticationError:
                pass
            else:
                raise AssertionError("a wrong key was accepted")

    failed = [n for n, err in RESULTS if err]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
