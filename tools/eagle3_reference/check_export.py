"""Loads a drafter exported by `specula train eagle3` into SpecForge's own
`LlamaForCausalLMEagle3` and writes the logits SpecForge computes on the fixture's inputs.

The state dict is loaded strictly: every tensor name, shape and type of the export must be
what SpecForge expects (`d2t` int64, `t2d` bool), plus `embed_tokens`, which the export leaves
out (the drafter uses its target's) and which is taken from the target's checkpoint here.

Usage (see README.md for the environment):
    TORCHDYNAMO_DISABLE=1 PYTHONPATH=/path/to/specforge-0.2.0 python check_export.py \
        tests/fixtures/eagle3-export tests/fixtures/dflash/random/target
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file
from transformers.models.llama.configuration_llama import LlamaConfig

from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

CHAIN = 3


def main():
    fixture, target_dir = sys.argv[1], sys.argv[2]
    with open(os.path.join(fixture, "drafter", "config.json")) as f:
        c = json.load(f)
    config = LlamaConfig(
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        head_dim=c["head_dim"],
        num_hidden_layers=1,
        vocab_size=c["vocab_size"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"],
        max_position_embeddings=c["max_position_embeddings"],
        hidden_act=c["hidden_act"],
        tie_word_embeddings=False,
    )
    config.draft_vocab_size = c["draft_vocab_size"]
    config.target_hidden_size = c["target_hidden_size"]
    config.pretraining_tp = 1
    model = LlamaForCausalLMEagle3(config).float().eval()
    state = load_file(os.path.join(fixture, "drafter", "model.safetensors"))
    assert state["t2d"].dtype == torch.bool and state["d2t"].dtype == torch.int64
    target = load_file(os.path.join(target_dir, "model.safetensors"))
    state["embed_tokens.weight"] = target["model.embed_tokens.weight"]
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)

    with open(os.path.join(fixture, "inputs.json")) as f:
        inputs = json.load(f)
    tokens = torch.tensor(inputs["tokens"])
    rows = len(tokens) - 1
    taps = torch.tensor(inputs["taps"])[:rows]
    with torch.no_grad():
        hidden = model.project_hidden_states(taps[None])
        mask = model.prepare_decoder_attention_mask(torch.ones(1, rows, dtype=torch.bool), hidden, 1, rows, 0)
        positions = torch.arange(rows)[None]
        cache = [[], []]
        out = model.backbone(model.embed_input_ids(tokens[1:][None]), hidden, cache, mask, positions, use_cache=True)
        first = model.compute_logits(out)[0]
        chain, drafted = [], []
        logits = first[-1]
        for step in range(CHAIN):
            chain.append(logits.tolist())
            i = int(logits.argmax())
            token = i + int(model.d2t[i])
            assert bool(model.t2d[token])
            drafted.append(token)
            if step + 1 == CHAIN:
                break
            ids = torch.full((1, rows), token)
            out = model.backbone(model.embed_input_ids(ids), out, cache, mask, positions, use_cache=True)
            logits = model.compute_logits(out)[0, -1]
    expected = {
        "made_by": "tools/eagle3_reference/check_export.py with specforge 0.2.0, torch " + torch.__version__,
        "first_pass_logits": first.tolist(),
        "chain_logits": chain,
        "drafted": drafted,
    }
    with open(os.path.join(fixture, "expected.json"), "w") as f:
        json.dump(expected, f)
    print("drafted", drafted, file=sys.stderr)


if __name__ == "__main__":
    main()
