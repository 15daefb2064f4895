#!/usr/bin/env python3
"""Multiple-choice scoring through /v1/completions with `echo` and log-probs, the way evaluation
harnesses score (lm-eval's `local-completions`): each choice is appended to the question, the
server echoes the prompt with its tokens' log-probs, and the choice whose tokens are most likely
wins. Run with and without the server's drafter ("speculate"): the scores must be identical.

The task is built from GSM8K's test problems (gsm8k-100, `specula fetch gsm8k-100`): for each
problem, its final answer and three final answers of other problems, as " The answer is N.".

    python3 docs/benchmarks/mc-scoring/score.py http://127.0.0.1:8080 ~/.cache/specula/data/gsm8k-100/gsm8k-100.jsonl 40
"""
import json
import random
import sys
import urllib.request


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def continuation_logprob(url, context, continuation, speculate):
    """Sum of the log-probs of the continuation's tokens after the context (echoed prompt)."""
    ctx = post(url, {"prompt": context, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0,
                     "speculate": speculate})
    full = post(url, {"prompt": context + continuation, "max_tokens": 1, "temperature": 0, "echo": True,
                      "logprobs": 0, "speculate": speculate})
    n_ctx = len(ctx["choices"][0]["logprobs"]["tokens"]) - 1  # minus the generated token
    lps = full["choices"][0]["logprobs"]["token_logprobs"][:-1]  # the prompt's tokens only
    return sum(lps[n_ctx:])


def main():
    url, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 40
    problems = [json.loads(l) for l in open(path)][:n]
    answers = [p["final_answer"] for p in problems]
    rng = random.Random(0)
    scores = {}
    for speculate in (True, False):
        correct, rows = 0, []
        for i, p in enumerate(problems):
            others = [a for a in dict.fromkeys(answers) if a != answers[i]]
            choices = [answers[i]] + rng.sample(others, 3)
            context = f"Question: {p['question']}\nAnswer:"
            lls = [continuation_logprob(url, context, f" The answer is {c}.", speculate) for c in choices]
            rows.append([round(x, 5) for x in lls])
            correct += int(max(range(4), key=lambda k: lls[k]) == 0)
        rng = random.Random(0)
        scores[speculate] = (correct / len(problems), rows)
        print(f"speculate={speculate}: accuracy {correct}/{len(problems)} = {correct / len(problems):.3f}")
    same = scores[True][1] == scores[False][1]
    print(f"identical log-likelihoods with and without speculation: {same}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
