#!/usr/bin/env python3
"""Draft logits of one DFlash block from an exported drafter, computed by the official package.

Loads an HF Qwen3 target and a z-lab DFlash drafter directory (config.json + model.safetensors,
f32/f16/bf16 weights) with `dflash==0.1.0` the way make_fixtures.py (and the package's benchmark)
does, then computes the drafter logits of one block [x[P], MASK x (B-1)] at positions P..P+B-1
against the context features of x[0..P) -- exactly the call `dflash_generate` makes in a round
whose anchor is at P with the whole context new: no attention mask (the block sees all context
rows and all of itself), embeddings via the package's `_raw_input_embeddings` (with the drafter's
`input_embedding_scale`, default 1), logits via `drafter.compute_logits` on the target's output
head. Writes JSON {tokens, anchor, block_size, mask_token_id, target_layer_ids, dtype, logits:
[B-1 rows (offsets 1..B-1) of vocab floats], argmax, versions}.

  check_export.py --target DIR --drafter DIR --out FILE.json [--tokens 1,2,3 --anchor P]
                  [--dtype float32|bfloat16|float16] [--spec-check]

Without --tokens a fixed list of 24 ids in 0..min(vocab, 255)-1 (seed 7) is used; --anchor
defaults to the last token (P = len(tokens) - 1; only x[0..P] are used). --spec-check also runs
the spec-equation drafter of make_fixtures.py (f32 checkpoints only) and requires agreement within
1e-5. Runs on one CPU thread.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import make_fixtures as mf  # next to this file
from dflash.model import (DFlashDraftModel, _draft_value, _output_head, _raw_input_embeddings,
                          extract_context_feature)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(target_dir, drafter_dir, dtype):
    """As make_fixtures.load_models / dflash.benchmark.load_models, with a chosen dtype."""
    target = AutoModelForCausalLM.from_pretrained(
        target_dir, attn_implementation="sdpa", dtype=dtype).eval()
    drafter = DFlashDraftModel.from_pretrained(
        drafter_dir, attn_implementation="sdpa", dtype=dtype).eval()
    return target, drafter


@torch.no_grad()
def block_logits(target, drafter, tokens, anchor):
    block = drafter.block_size
    ids = torch.tensor([tokens[:anchor + 1]])
    out = target(ids[:, :anchor], output_hidden_states=True)
    features = extract_context_feature(out.hidden_states, drafter.target_layer_ids)  # [1, P, K*H]
    block_ids = torch.tensor([[tokens[anchor]] + [drafter.mask_token_id] * (block - 1)])
    noise = _raw_input_embeddings(
        target, block_ids, float(_draft_value(drafter.config, "input_embedding_scale", 1.0)))
    hidden = drafter(target_hidden=features, noise_embedding=noise,
                     position_ids=torch.arange(anchor + block)[None], attention_mask=None)
    return drafter.compute_logits(hidden[:, 1:], _output_head(target))[0].float()  # [B-1, V]


def spec_check(target_dir, drafter_dir, tokens, anchor, logits):
    """Max |diff| against make_fixtures.spec_equation_draft_logits, which reads <case>/drafter."""
    target = AutoModelForCausalLM.from_pretrained(
        target_dir, attn_implementation="sdpa", dtype=torch.float32).eval()
    block = json.loads((Path(drafter_dir) / "config.json").read_text())["block_size"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "drafter").symlink_to(Path(drafter_dir).resolve())
        spec = mf.spec_equation_draft_logits(Path(tmp), target, tokens, anchor, block)
    return (spec - logits).abs().max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--drafter", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", help="comma-separated token ids x[0..]")
    parser.add_argument("--anchor", type=int, help="anchor position P (default: last token)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype the models are loaded and run in (default float32)")
    parser.add_argument("--spec-check", action="store_true",
                        help="also compare with make_fixtures' spec-equation drafter (f32 only)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    config = json.loads((args.drafter / "config.json").read_text())
    if config.get("architectures", ["DFlashDraftModel"])[0] != "DFlashDraftModel":
        sys.exit(f"not a DFlashDraftModel checkpoint: {config.get('architectures')}")
    target, drafter = load(args.target, args.drafter, DTYPES[args.dtype])
    vocab = target.config.vocab_size

    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    else:
        gen = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, min(vocab, 255), (24,), generator=gen).tolist()
    anchor = len(tokens) - 1 if args.anchor is None else args.anchor
    if not 0 <= anchor < len(tokens):
        sys.exit(f"--anchor {anchor} outside the {len(tokens)} tokens")
    if anchor == 0:
        print("warning: anchor 0 means no context rows", file=sys.stderr)
    tokens = tokens[:anchor + 1]

    logits = block_logits(target, drafter, tokens, anchor)
    result = {
        "tokens": tokens,
        "anchor": anchor,
        "block_size": drafter.block_size,
        "mask_token_id": drafter.mask_token_id,
        "target_layer_ids": list(drafter.target_layer_ids),
        "dtype": args.dtype,
        "positions": list(range(anchor + 1, anchor + drafter.block_size)),
        "logits": mf.f32_list(logits),
        "argmax": logits.argmax(-1).tolist(),
        "versions": mf.versions(),
    }
    if args.spec_check:
        diff = spec_check(args.target, args.drafter, tokens, anchor, logits)
        print(f"spec-equation drafter vs package: max |logit diff| {diff:.2e}")
        result["spec_equation_max_abs_logit_diff"] = float(f"{diff:.3g}")
        if diff >= 1e-5:
            sys.exit(f"spec-equation drafter disagrees: {diff:.3g} >= 1e-5")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    mf.write_json(args.out, result)
    print(f"anchor {anchor}, {len(result['logits'])} rows x {logits.shape[1]} logits, "
          f"argmax {result['argmax']} -> {args.out}")


if __name__ == "__main__":
    main()
