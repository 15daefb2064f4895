#!/usr/bin/env python3
"""Checks that speculators' own offline DFlash training accepts data in the format specula
exports (tools/interop/export_specula_data.py), on CPU with a tiny target.

Two steps, after `speculators prepare-data` has turned the exported JSONL into DATA (a
`datasets` directory with `input_ids`, `loss_mask`, `seq_len`):

  hidden-states TARGET DATA --layers 1 3
      writes DATA/hidden_states/hs_<i>.safetensors for every row i, in the layout speculators'
      FileTransfer reads (`hs_connectors.transfer._load_hs_file`): `token_ids` [seq] int64 and
      `hidden_states` [seq, len(layers) + 1, hidden] = HF `hidden_states[l]` for each requested
      layer l (speculators / vLLM numbering) followed by the last decoder layer's output before
      the final norm. vLLM's extraction normally writes these files; here the target runs in
      transformers (float32) instead, since vLLM is not available on this machine.

  train ARGS...
      runs `speculators train ARGS...` (speculators.train.cli.main with TrainConfig.resolve),
      with one shim: speculators' Trainer moves batches and the model to the integer device
      `local_rank` (a CUDA device); on a machine without an accelerator it is replaced by
      "cpu", and the step timer's `torch.accelerator.synchronize()` becomes a no-op. Nothing
      else in the training code is changed.
"""

import argparse
import sys
from pathlib import Path

import torch


def hidden_states(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("data")
    ap.add_argument("--layers", type=int, nargs="+", required=True)
    args = ap.parse_args(argv)
    from datasets import load_from_disk
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    pre_norm = {}
    model.model.norm.register_forward_hook(lambda m, i, o: pre_norm.__setitem__("x", i[0]))
    ds = load_from_disk(args.data).with_format("torch")
    out = Path(args.data) / "hidden_states"
    out.mkdir(exist_ok=True)
    for i in range(len(ds)):
        ids = ds[i]["input_ids"].long()
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
        layers = [hs[l][0] for l in args.layers] + [pre_norm["x"][0]]
        save_file(
            {"token_ids": ids.contiguous(), "hidden_states": torch.stack(layers, 1).contiguous()},
            str(out / f"hs_{i}.safetensors"),
        )
    print(f"{len(ds)} hidden-state files in {out}", file=sys.stderr)


def train(argv):
    import speculators.train.trainer as trainer_mod
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    if not torch.cuda.is_available():
        trainer_mod.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *a, **k: None  # the step timer's sync
    main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    {"hidden-states": hidden_states, "train": train}[cmd](rest)
