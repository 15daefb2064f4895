"""Writes data/prompts/reasoning-gym-math.jsonl: maths questions for drafter training data.

The evaluation sets hold maths (gsm8k-100, math500), and no maths training set ships in a
package, so these questions come from the procedural generators of `reasoning-gym` (Apache-2.0):
arithmetic, algebra, number theory, geometry, probability and short word problems, each made
from a fixed seed. `gsm_symbolic` is left out: its templates are GSM8K's test problems.

    python3 -m venv ~/.venvs/rg && ~/.venvs/rg/bin/pip install reasoning-gym==0.1.25
    ~/.venvs/rg/bin/python tools/prompt_sets/make_reasoning_gym_math.py data/prompts/reasoning-gym-math.jsonl

The same file every run (the script fixes Python's string hashing, which `polynomial_multiplication`
depends on). One JSON object per line: `id` (task/index), `task`, `question`, `answer` (the generator's).
"""

import json
import os
import sys

import reasoning_gym

TASKS = [
    "aiw", "leg_counting", "coin_flip", "dice", "time_intervals", "calendar_arithmetic",
    "basic_arithmetic", "chain_sum", "decimal_arithmetic", "products", "fraction_simplification",
    "lcm", "gcd", "prime_factorization", "count_primes", "power_function", "base_conversion",
    "number_sequence", "simple_equations", "polynomial_equations", "polynomial_multiplication",
    "complex_arithmetic", "simple_integration", "intermediate_integration", "simple_geometry",
    "advanced_geometry",
]
PER_TASK = 70
SEED = 2026


def main(out_path):
    rows = []
    for t, task in enumerate(TASKS):
        assert task != "gsm_symbolic"
        data = reasoning_gym.create_dataset(task, size=PER_TASK, seed=SEED + t)
        for i in range(PER_TASK):
            item = data[i]
            rows.append({"id": f"{task}/{i}", "task": task, "question": item["question"].strip(),
                         "answer": str(item["answer"])})
    # Interleave the tasks, so that a `--limit` takes some of each.
    rows.sort(key=lambda r: (int(r["id"].split("/")[1]), TASKS.index(r["task"])))
    with open(out_path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(rows)} questions from {len(TASKS)} tasks -> {out_path}")


if __name__ == "__main__":
    # Some generators iterate over sets: string hashing must not vary between runs.
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, "PYTHONHASHSEED": "0"})
    main(sys.argv[1])
