"""What the self-instruct prompt-set scripts share: seeded requests to a running `specula serve`
and the runs of 8 words they compare with an evaluation set."""

import json
import re
import sys
import threading
import urllib.request


def words(text):
    return re.findall(r"[a-z0-9]+", text.lower())


def runs_of_8(text):
    w = words(text)
    return {tuple(w[j:j + 8]) for j in range(len(w) - 7)}


def ask(server, text, seed, max_tokens):
    """One chat answer sampled at temperature 1 (top-p 0.95) with `seed`; None when it did not
    finish within `max_tokens`."""
    body = json.dumps({
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 0.95,
        "seed": seed,
    }).encode()
    req = urllib.request.Request(f"{server}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        reply = json.load(resp)
    choice = reply["choices"][0]
    if choice.get("finish_reason") != "stop":
        return None
    return choice["message"]["content"]


def ask_all(server, n, instruction, first_seed, max_tokens, clients=8, first=0):
    """The answers to instructions first..n (`instruction(i)` gives the text; answers[i], the
    ones before `first` None), request i seeded `first_seed + i`, `clients` requests at a time."""
    answers = [None] * n
    next_index = [first]
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= n:
                return
            answers[i] = ask(server, instruction(i), first_seed + i, max_tokens)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def read_kept(out_path, first):
    """The rows a run over instructions 0..first wrote (none when `first` is 0): a later run
    over first..n extends the file, and equals one run over 0..n."""
    if first == 0:
        return []
    with open(out_path) as f:
        return [json.loads(line) for line in f]


def write_kept(out_path, kept, n, dropped):
    """Writes the kept rows as JSON lines and reports what was dropped."""
    with open(out_path, "w") as f:
        for row in kept:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(kept)} rows in all; of {n} instructions this run, dropped {dropped}", file=sys.stderr)
