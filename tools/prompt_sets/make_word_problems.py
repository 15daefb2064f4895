"""Writes data/prompts/word-problems.jsonl: short maths word problems for drafter training data.

No package ships maths word problems that may feed training (GSM8K is an evaluation set), and
`reasoning-gym-math`'s generators write exercises, not stories. So a target writes them itself
(self-instruct): each prompt asks a running `specula serve` for one new grade-school word
problem on a given topic, quantity and number of steps, sampled at temperature 1 with the
prompt's own seed. Every kept problem is checked against gsm8k-100: one shared run of 8 words
(case and punctuation ignored) and it is dropped, as are repeats and answers that are not a
single question.

    specula serve -m qwen2.5-coder-1.5b --drafter none --port 8093 &
    python3 tools/prompt_sets/make_word_problems.py http://127.0.0.1:8093 \
        ~/.cache/specula/data/gsm8k-100/gsm8k-100.jsonl data/prompts/word-problems.jsonl 1680

A fifth argument F extends the file a run over instructions 0..F wrote with instructions F..N
(the file holds a run of 720, then runs from 720 to 1,200 and from 1,200 to 1,680); the result
equals one run over 0..N.

The server's sampling is seeded per request and its batches are row-invariant, so the same
server build and model write the same file. One JSON object per line: `id` (topic/index),
`topic`, `question`.
"""

import json
import re
import sys

from self_instruct import ask_all, read_kept, runs_of_8, words, write_kept

TOPICS = [
    "a bakery", "a school trip", "a vegetable garden", "a basketball season", "saving pocket money",
    "a road trip", "a library", "a farm with animals", "a birthday party", "painting a house",
    "a lemonade stand", "a bookshop sale", "a train journey", "a fruit market", "a swimming pool",
    "a science fair", "knitting scarves", "a pizza restaurant", "a zoo", "a marathon",
    "a toy factory", "a car wash fundraiser", "a movie theatre", "a bike shop", "a camping trip",
    "a flower shop", "a chess club", "a coffee shop", "a music band", "an orchard",
    "a pet shop", "a recycling drive", "a school cafeteria", "a hotel", "a video game collection",
    "building a fence", "a candle business", "a soccer tournament", "a dentist's office", "a bus route",
    "baking cookies", "a summer job", "a fishing trip", "a clothing store", "a carpenter",
    "an aquarium", "a charity walk", "a pumpkin patch", "stamp collecting", "a water tank",
    "a phone plan", "a gym membership", "a beekeeper", "a ferry", "a family dinner",
    "a classroom of students", "a bake sale", "a tailor", "a ski resort", "a grocery list",
]
QUANTITIES = [
    "money", "time", "distances and speeds", "percentages", "fractions", "weights",
    "counts of items", "rates of work", "ratios", "ages",
]
STEPS = [2, 3, 3, 4, 4, 5]


def instruction(i):
    topic = TOPICS[i % len(TOPICS)]
    quantity = QUANTITIES[(i // len(TOPICS) + i) % len(QUANTITIES)]
    steps = STEPS[(i * 7 + i // 5) % len(STEPS)]
    text = (
        f"Write one new grade-school math word problem about {topic}, involving {quantity}. "
        f"Solving it should take {steps} steps of arithmetic with whole numbers or simple decimals, "
        "and it should end with a single question. Write only the problem: no title, no answer, "
        "no solution."
    )
    return topic, text


def clean(answer):
    """The problem alone, or None when the answer is not one."""
    text = answer.strip().strip('"').strip()
    text = re.sub(r"^(\*\*)?(word )?problem:?(\*\*)?:?\s*", "", text, flags=re.IGNORECASE).strip()
    if not text.endswith("?") or not 60 <= len(text) <= 800:
        return None
    lowered = text.lower()
    if any(m in lowered for m in ("solution", "answer:", "step 1", "```", "**")):
        return None
    if text.count("?") > 2:
        return None
    return text


def main(server, gsm8k_path, out_path, n, first="0"):
    n, first = int(n), int(first)
    eval_runs = set()
    with open(gsm8k_path) as f:
        for line in f:
            eval_runs |= runs_of_8(json.loads(line)["question"])
    answers = ask_all(server, n, lambda i: instruction(i)[1], first_seed=1000, max_tokens=200, first=first)

    kept = read_kept(out_path, first)
    seen = {" ".join(words(row["question"])) for row in kept}
    dropped = {"not a problem": 0, "near gsm8k-100": 0, "repeat": 0}
    for i in range(first, n):
        answer, topic = answers[i], instruction(i)[0]
        text = clean(answer) if answer is not None else None
        if text is None:
            dropped["not a problem"] += 1
            continue
        if runs_of_8(text) & eval_runs:
            dropped["near gsm8k-100"] += 1
            continue
        key = " ".join(words(text))
        if key in seen:
            dropped["repeat"] += 1
            continue
        seen.add(key)
        kept.append({"id": f"{topic.replace(' ', '-')}/{i}", "topic": topic, "question": text})
    write_kept(out_path, kept, n - first, dropped)


if __name__ == "__main__":
    main(*sys.argv[1:])
