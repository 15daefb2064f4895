"""Greedy completions with top-3 log-probs from llama.cpp's Python binding (xllamacpp), in the
format of the reference files (tests/fixtures/llamacpp-greedy/*.json), for prompts of one's own.

    python3 -m venv ~/.venvs/xll && ~/.venvs/xll/bin/pip install xllamacpp==2026.10.11549
    ~/.venvs/xll/bin/python tools/llamacpp_reference/greedy.py MODEL.gguf PROMPTS.txt N_TOKENS OUT.json [THREADS [N_CTX]]

PROMPTS.txt has one completion prompt per line. Settings as the reference files' engine:
its defaults, n_ctx 512 unless given, temperature 0, no prompt cache. The output feeds
`cargo run --release --example kernel_accuracy` (docs/kernels.md).
"""
import json
import sys

import xllamacpp as x


def main() -> int:
    model, prompts, n_tokens, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    threads = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    n_ctx = int(sys.argv[6]) if len(sys.argv) > 6 else 512
    p = x.CommonParams()
    p.model.path = model
    p.n_ctx = n_ctx
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.n_parallel = 1
    server = x.Server(p)
    results = []
    for prompt in [line.rstrip("\n") for line in open(prompts) if line.strip()]:
        r = server.handle_completions({"prompt": prompt, "n_predict": n_tokens, "temperature": 0, "n_probs": 3,
                                       "cache_prompt": False})
        steps = r["choices"][0]["logprobs"]["content"]
        results.append({
            "mode": "completion",
            "prompt": prompt,
            "prompt_tokens": r["usage"]["prompt_tokens"],
            "text": r["choices"][0]["text"],
            "token_ids": [s["id"] for s in steps],
            "top3": [[[t["id"], round(t["logprob"], 4)] for t in s["top_logprobs"]] for s in steps],
        })
    json.dump({"model": model.rsplit("/", 1)[-1], "engine": f"llama.cpp via xllamacpp {x.__version__} (CPU wheel)",
               "greedy": True, "results": results}, open(out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
