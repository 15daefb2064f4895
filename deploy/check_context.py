"""Checks what `docker build .` sends as its build context, by .dockerignore's rules.

    python3 deploy/check_context.py [REPO_ROOT [DOCKERIGNORE]]

Uses the Docker SDK's implementation of .dockerignore matching (the `docker` package). Fails if
a file the Dockerfile copies or the crate needs at compile time is left out, or if something
that should stay out (build output, .git, benchmark runs, model files) is sent.
"""

import os
import sys

from docker.utils.build import exclude_paths

root = sys.argv[1] if len(sys.argv) > 1 else "."
ignore_file = sys.argv[2] if len(sys.argv) > 2 else os.path.join(root, ".dockerignore")
with open(ignore_file, encoding="utf-8") as f:
    patterns = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
sent = exclude_paths(root, patterns)

# Needed: every source file, the compile-time includes, and what the runtime stage copies.
needed = ["Cargo.toml", "Cargo.lock", "build.rs", ".cargo/config.toml", "deploy/docker/entrypoint.sh"]
for top in ["src", "data/prompts"]:
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        needed += [os.path.relpath(os.path.join(dirpath, name), root) for name in files]
for drafter in sorted(os.listdir(os.path.join(root, "drafters"))):
    needed += [f"drafters/{drafter}/config.json", f"drafters/{drafter}/model.safetensors"]

failures = [f"left out but needed: {path}" for path in needed if path not in sent]
for path in sent:
    top = path.split("/")[0]
    if top in {"target", ".git", "runs", "docs", "tests", "tools", "examples"} or path.endswith(".gguf") \
            or top.startswith(".venv") or path.endswith("train-log.jsonl"):
        failures.append(f"sent but should stay out: {path}")

size = sum(os.path.getsize(os.path.join(root, p)) for p in sent if os.path.isfile(os.path.join(root, p)))
for failure in failures:
    print(f"FAIL {failure}")
print(f"build context: {sum(os.path.isfile(os.path.join(root, p)) for p in sent)} files, {size / 2**20:.1f} MiB")
sys.exit(1 if failures else 0)
