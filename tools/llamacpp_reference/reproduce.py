"""Re-runs llama.cpp's greedy reference (tests/fixtures/llamacpp-greedy) with the engine that
made it, and reports how far another llama.cpp configuration lands from it.

The reference files say they come from `xllamacpp 2026.10.11549 (CPU wheel)`, llama.cpp's Python
binding. With its defaults this script reproduces them exactly; passing a setting (for example
flash_attn_type=0, attention without flash attention) shows how much llama.cpp's own log-probs
move with that one switch.

    python3 -m venv ~/.venvs/xll && ~/.venvs/xll/bin/pip install xllamacpp==2026.10.11549
    ~/.venvs/xll/bin/python tools/llamacpp_reference/reproduce.py MODEL.gguf REFERENCE.json [THREADS] [param=value ...]

for example MODEL.gguf = ~/.cache/specula/models/smollm2-135m.gguf (`specula fetch smollm2-135m`)
and REFERENCE.json = tests/fixtures/llamacpp-greedy/SmolLM2-135M-Instruct.Q4_1.json.
"""
import json
import sys

import xllamacpp as x


def main() -> int:
    model, ref = sys.argv[1], sys.argv[2]
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    p = x.CommonParams()
    p.model.path = model
    p.n_ctx = 512
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.n_parallel = 1
    for kv in sys.argv[4:]:
        k, v = kv.split("=")
        setattr(p, k, int(v))
    server = x.Server(p)
    cases = [r for r in json.load(open(ref))["results"] if "top3" in r]
    diffs, tokens_equal = [], 0
    for r in cases:
        out = server.handle_completions({"prompt": r["prompt"], "n_predict": len(r["token_ids"]), "temperature": 0,
                                         "n_probs": 3, "cache_prompt": False})
        steps = out["choices"][0]["logprobs"]["content"]
        for i, (step, top3) in enumerate(zip(steps, r["top3"])):
            tokens_equal += step["id"] == r["token_ids"][i]
            diffs.append(abs(step["logprob"] - top3[0][1]))
    over = sum(d > 0.05 for d in diffs)
    print(json.dumps({"steps": len(diffs), "same_token": tokens_equal, "within_0.05": len(diffs) - over,
                      "mean_abs_diff": round(sum(diffs) / len(diffs), 4), "max_abs_diff": round(max(diffs), 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
