#!/usr/bin/env python3
"""Prototype of the export `specula train data` needs: a specula data directory
(`shard-*.jsonl` lines with `tokens`, `loss_mask`, `prompt_tokens`, `finish`, ...) to one JSONL
file of pre-tokenized rows `{"input_ids": [...], "loss_mask": [...]}` that both

  * speculators 0.9.0 `speculators prepare-data --data FILE.jsonl` (rows with `input_ids` and
    `loss_mask` pass through `_passthrough_pretokenized`: no re-tokenisation, no render endpoint),
  * SpecForge 0.2.0 `data.prompts_path: FILE.jsonl` (`data/prompt_builder.py`: a first record
    with `input_ids` and `loss_mask` makes the whole file pre-tokenized)

read as they are. Only these two keys are written (speculators drops other columns anyway;
SpecForge ignores them). A single file, not a directory: speculators loads every *.json/*.jsonl
under a directory (specula's meta.json included), SpecForge's prompts_path is one file.

    python tools/interop/export_specula_data.py DATA_DIR OUT.jsonl [--eos ID] [--max-len N] [--limit N]

--eos ID appends the target's end-of-sequence/end-of-turn id (loss 1) to rows whose `finish`
is `stop`: specula's `tokens` leave out the id that ended the answer, while a conversation
rendered by the frameworks' own preprocessing contains it, so without it the drafter never
learns to propose the end of an answer.
"""

import argparse
import glob
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir")
    ap.add_argument("out")
    ap.add_argument("--eos", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    shards = sorted(glob.glob(os.path.join(args.data_dir, "shard-*.jsonl")))
    if not shards:
        sys.exit(f"no shard-*.jsonl in {args.data_dir}")
    n = kept = 0
    with open(args.out, "w") as out:
        for shard in shards:
            for line in open(shard):
                if not line.strip():
                    continue
                ex = json.loads(line)
                ids, mask = list(ex["tokens"]), list(ex["loss_mask"])
                assert len(ids) == len(mask), ex["id"]
                if args.eos is not None and ex.get("finish") == "stop":
                    ids.append(args.eos)
                    mask.append(1)
                if args.max_len is not None:
                    ids, mask = ids[: args.max_len], mask[: args.max_len]
                n += 1
                if sum(mask) < 2:  # SpecForge DFlash needs two consecutive supervised tokens
                    continue
                out.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
                kept += 1
                if args.limit is not None and kept >= args.limit:
                    break
            if args.limit is not None and kept >= args.limit:
                break
    print(f"{kept} rows written ({n - kept} with fewer than 2 response tokens skipped)", file=sys.stderr)


if __name__ == "__main__":
    main()
