"""Writes data/prompts/function-stubs.jsonl: Python function stubs for the target to complete.

Code completion is served as raw text: a signature and a docstring with examples, which the
model continues with the body (HumanEval's shape). HumanEval is an evaluation set, and
`codeio-completion`'s functions all take one `main_solution` input without examples, so a
target writes stubs itself (self-instruct): each prompt asks a running `specula serve` for one
new function on a given topic and kind of input, sampled at temperature 1 with the prompt's own
seed. A kept stub parses as Python, is one function with a docstring holding `>>>` examples,
and is cut after that docstring. It is dropped if its function name is defined in a HumanEval
prompt or it shares a run of 8 words (case and punctuation ignored) with any HumanEval prompt.

    specula serve -m qwen2.5-coder-1.5b --drafter none --port 8093 &
    python3 tools/prompt_sets/make_function_stubs.py http://127.0.0.1:8093 \
        ~/.cache/specula/data/humaneval/HumanEval.jsonl data/prompts/function-stubs.jsonl 1680

A fifth argument F extends the file a run over instructions 0..F wrote with instructions F..N
(the file holds a run of 720, then runs from 720 to 1,200 and from 1,200 to 1,680); the result
equals one run over 0..N.

The server's sampling is seeded per request and its batches are row-invariant, so the same
server build and model write the same file. One JSON object per line: `id` (topic/index),
`topic`, `prompt` (the stub, ending in a newline after the docstring).
"""

import ast
import json
import re
import sys

from self_instruct import ask_all, read_kept, runs_of_8, write_kept

TOPICS = [
    "palindromes", "vowels and consonants", "prime numbers", "digits of an integer", "sorting a list",
    "balanced brackets", "binary strings", "running sums", "matrices", "intervals",
    "counting words", "anagrams", "Fibonacci-like sequences", "dictionaries of counts", "dates as strings",
    "temperatures", "grades of students", "shopping carts", "coordinates on a grid", "geometric shapes",
    "caesar ciphers", "run-length encoding", "duplicate elements", "nested lists", "sets of numbers",
    "greatest common divisors", "factorials", "powers of two", "Roman numerals", "time of day",
    "bank balances", "stock prices", "character frequencies", "capital letters", "whitespace in text",
    "sliding windows", "pairs that sum to a target", "longest runs", "rotating lists", "merging lists",
    "triangles", "even and odd numbers", "prefixes and suffixes", "email addresses", "file paths",
    "tuples of names and ages", "inventory counts", "scores in a game", "polynomials as coefficient lists",
    "number bases", "leap years", "distances between points", "unique characters", "sentence reversal",
    "filtering by a predicate", "rounding numbers", "percentages", "queues of tasks", "truthy values",
    "hexadecimal strings",
]
INPUTS = [
    "a list of integers", "a string", "two strings", "an integer", "a list of strings",
    "a list of floats", "a dictionary", "two integers", "a list of tuples", "a string and an integer",
]


def instruction(i):
    topic = TOPICS[i % len(TOPICS)]
    given = INPUTS[(i // len(TOPICS) + i) % len(INPUTS)]
    text = (
        f"Write the signature and docstring of one new Python function about {topic} that takes "
        f"{given}. Use type hints. The docstring states the task in one to three sentences and "
        "then gives two or three `>>>` examples, each followed by its result. Do not write the "
        "body. Put the code, with any `from typing import` it needs, in one ```python block."
    )
    return topic, text


def stub(answer):
    """(function name, the stub cut after its docstring), or None when the answer is not one."""
    fenced = re.findall(r"```(?:python)?\n(.*?)```", answer, flags=re.DOTALL)
    if len(fenced) != 1:
        return None
    source = fenced[0].expandtabs(4)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    others = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.Import, ast.ImportFrom))]
    if len(functions) != 1 or others:
        return None
    function = functions[0]
    doc = function.body[0] if function.body else None
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str) and ">>>" in doc.value.value):
        return None
    lines = source.splitlines()
    imports = [lines[n.lineno - 1] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    if any(n.end_lineno != n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))):
        return None
    start = (function.decorator_list[0].lineno if function.decorator_list else function.lineno) - 1
    head = "\n".join(lines[start:doc.end_lineno]).rstrip()
    if any(len(line) > 100 for line in head.splitlines()) or not 80 <= len(head) <= 1500:
        return None
    text = ("\n".join(imports) + "\n\n\n" if imports else "") + head + "\n"
    return function.name, text


def main(server, humaneval_path, out_path, n, first="0"):
    n, first = int(n), int(first)
    eval_runs, eval_names = set(), set()
    with open(humaneval_path) as f:
        for line in f:
            row = json.loads(line)
            eval_runs |= runs_of_8(row["prompt"])
            eval_names |= set(re.findall(r"def (\w+)\(", row["prompt"]))
    answers = ask_all(server, n, lambda i: instruction(i)[1], first_seed=5000, max_tokens=320, first=first)

    kept = read_kept(out_path, first)
    seen = {re.search(r"def (\w+)\(", row["prompt"]).group(1) for row in kept}
    dropped = {"not a stub": 0, "near humaneval": 0, "repeat": 0}
    for i in range(first, n):
        answer, topic = answers[i], instruction(i)[0]
        found = stub(answer) if answer is not None else None
        if found is None:
            dropped["not a stub"] += 1
            continue
        name, text = found
        if name in eval_names or runs_of_8(text) & eval_runs:
            dropped["near humaneval"] += 1
            continue
        if name in seen:
            dropped["repeat"] += 1
            continue
        seen.add(name)
        kept.append({"id": f"{topic.replace(' ', '-')}/{i}", "topic": topic, "prompt": text})
    write_kept(out_path, kept, n - first, dropped)


if __name__ == "__main__":
    main(*sys.argv[1:])
