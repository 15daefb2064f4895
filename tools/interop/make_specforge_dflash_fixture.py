#!/usr/bin/env python3
"""A tiny SpecForge 0.2.0 DFlash drafter exported by SpecForge's own `export --to hf` path.

The draft config is generated the way `specforge train` generates one when no
`model.draft_model_config` is given (`training.model_loading._generate_draft_config` with the
DFlash provider: target-derived Qwen3 fields, block_size 16, `dflash_config.target_layer_ids`),
then set to 2 layers, block 4, taps [0, 2] and MASK 255 (what a user-supplied draft config or
the trainer's `_build_dflash_family_model` writes into `dflash_config`). Its weights are
perturbed (seeded), stored as a SpecForge training state (`training_state.pt`:
`draft_state_dict` + `strategy`), and exported with `specforge.export.to_hf.export_to_hf`
(bfloat16, `save_pretrained`). The export is reloaded with `AutoDraftModel.from_pretrained` in
float32 and run as `DFlashDraftModel.spec_generate` runs one block (no mask: the block sees
all context rows and itself), with the target's embedding and LM head.

    TORCHDYNAMO_DISABLE=1 PYTHONPATH=/path/to/specforge-0.2.0 \
        python tools/interop/make_specforge_dflash_fixture.py [--out tests/fixtures/interop/specforge-dflash]

Writes OUT/drafter/{config.json, model.safetensors} and OUT/fixture.json.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_speculators_fixtures import dflash_reference, min_margin  # noqa: E402

TARGET = "tests/fixtures/dflash/random/target"
VOCAB, HIDDEN = 256, 64
MASK_TOKEN_ID = 255
BLOCK = 4
TAPS = [0, 2]  # z-lab / SpecForge numbering: output of decoder layer k (HF hidden_states[k + 1])

torch.set_num_threads(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/interop/specforge-dflash")
    args = ap.parse_args()
    from specforge.algorithms.dflash.providers import algorithm_providers
    from specforge.export.to_hf import export_to_hf
    from specforge.modeling.auto import AutoDraftModel
    from specforge.training.model_loading import _generate_draft_config

    provider = algorithm_providers().model.draft_config
    cfg = SimpleNamespace(
        training=SimpleNamespace(strategy="dflash"),
        model=SimpleNamespace(target_model_path=TARGET, cache_dir=None, trust_remote_code=False),
    )
    dc = _generate_draft_config(cfg, provider)
    generated = dc.to_dict()
    dc.num_hidden_layers = 2
    dc.layer_types = ["full_attention"] * 2
    dc.block_size = BLOCK
    dc.dflash_config = {"target_layer_ids": TAPS, "mask_token_id": MASK_TOKEN_ID}

    g = torch.Generator().manual_seed(778)
    model = AutoDraftModel.from_config(dc).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))

    out = Path(args.out)
    drafter = out / "drafter"
    if drafter.exists():
        shutil.rmtree(drafter)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        config_path = os.path.join(tmp, "draft_config.json")
        dc.to_json_file(config_path)
        state = {"draft_state_dict": {k: v.clone() for k, v in model.state_dict().items()}, "strategy": "dflash"}
        torch.save(state, os.path.join(tmp, "training_state.pt"))
        export_to_hf(os.path.join(tmp, "training_state.pt"), config_path, str(drafter))

    sf = AutoDraftModel.from_pretrained(str(drafter), torch_dtype=torch.float32).float().eval()
    sf.config._attn_implementation = "eager"
    tw = load_file(os.path.join(TARGET, "model.safetensors"))
    embed, head = tw["model.embed_tokens.weight"].float(), tw["lm_head.weight"].float()

    T = 24
    tokens = torch.randint(0, VOCAB - 1, (T,), generator=g)
    taps = torch.randn(T, len(TAPS) * HIDDEN, generator=g)
    anchors = [5, 11, 17]
    w = {k: v.float() for k, v in load_file(str(drafter / "model.safetensors")).items()}
    w["lm_head.weight"] = head
    ref_cfg = {
        "transformer_layer_config": {
            "rms_norm_eps": sf.config.rms_norm_eps,
            "rope_parameters": {"rope_theta": json.load(open(drafter / "config.json"))["rope_theta"]},
            "head_dim": sf.config.head_dim,
            "layer_types": sf.config.layer_types,
        },
        "sliding_window_non_causal": False,
    }
    block_logits, worst = [], 0.0
    for p in anchors:
        ids = torch.full((1, BLOCK), MASK_TOKEN_ID)
        ids[0, 0] = tokens[p]
        with torch.no_grad():
            h = sf(
                target_hidden=taps[None, :p],
                noise_embedding=embed[ids],
                position_ids=torch.arange(p + BLOCK)[None],
                is_causal=False,
            )
        lg = h[0] @ head.T
        block_logits.append(lg)
        ref = dflash_reference(w, ref_cfg, embed, tokens, taps, p, BLOCK, MASK_TOKEN_ID)
        worst = max(worst, (ref - lg).abs().max().item())
    assert worst < 1e-5, f"independent forward disagrees: {worst}"
    logits = torch.stack(block_logits)
    with safe_open(str(drafter / "model.safetensors"), framework="pt") as f:
        saved = {k: [list(f.get_tensor(k).shape), str(f.get_tensor(k).dtype)] for k in f.keys()}
    fixture = {
        "made_by": "tools/interop/make_specforge_dflash_fixture.py (specforge DFlashDraftModel via export_to_hf)",
        "versions": {"specforge": "0.2.0 (wheel unpacked, no deps)", "torch": torch.__version__,
                     "transformers": version("transformers")},
        "target": TARGET,
        "about": "SpecForge DFlash (z-lab layout), 2 full-attention layers, block 4, target_layer_ids [0, 2], mask 255; weights exported in bfloat16",
        "generated_draft_config": generated,
        "tokens": tokens.tolist(),
        "taps": taps.tolist(),
        "taps_about": "row t = concat(HF hidden_states[k + 1] for k in target_layer_ids) at position t",
        "anchors": anchors,
        "block_size": BLOCK,
        "block_logits": logits.tolist(),
        "block_logits_about": "per anchor P: logits over the target vocab (target lm_head) of the block [x[P], MASK x 3] at positions P..P+3 against context taps rows 0..P-1, block fully visible; row k >= 1 predicts x[P+k]",
        "draft_argmax": logits.argmax(-1).tolist(),
        "checks": {"independent_max_abs": worst, "min_top2_margin_rows_1_to_B-1": min_margin(logits[:, 1:])},
        "saved_tensors": saved,
    }
    with open(out / "fixture.json", "w") as f:
        json.dump(fixture, f)
    print("specforge dflash:", fixture["checks"], fixture["draft_argmax"], file=sys.stderr)


if __name__ == "__main__":
    main()
