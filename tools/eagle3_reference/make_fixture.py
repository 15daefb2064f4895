"""Makes the EAGLE-3 drafting fixture with SpecForge's own model code.

A tiny random `LlamaForCausalLMEagle3` (SpecForge 0.2.0's class, random weights and norms, a
random reduced vocabulary with its `d2t`/`t2d`) is saved in the published layout, then run on
random target states: one causal pass over the context rows, then a chain of draft steps from
the last row, each feeding back the previous output and the drafted token, exactly as
SpecForge's training-time test attends (step j of a row sees the causal context and its own
earlier steps). The fixture stores the checkpoint, the inputs, every row's first-pass logits,
the chain's logits and its drafted target ids.

Usage (offline; SpecForge unpacked without its dependencies, see README.md):
    TORCHDYNAMO_DISABLE=1 PYTHONPATH=/path/to/specforge-0.2.0 \
        python make_fixture.py OUT_DIR [--norm-before-residual]
"""

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers.models.llama.configuration_llama import LlamaConfig

from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

HIDDEN, TARGET_HIDDEN, VOCAB, DRAFT_VOCAB = 64, 48, 300, 100
ROWS, CHAIN = 11, 5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=1,
        vocab_size=VOCAB,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        hidden_act="silu",
        tie_word_embeddings=False,
    )
    config.draft_vocab_size = DRAFT_VOCAB
    config.target_hidden_size = TARGET_HIDDEN
    config.pretraining_tp = 1
    model = LlamaForCausalLMEagle3(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
        used = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
        model.d2t.copy_(used - torch.arange(DRAFT_VOCAB))
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[used] = True
        model.t2d.copy_(t2d)

    os.makedirs(os.path.join(args.out, "drafter"), exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(args.out, "drafter", "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": TARGET_HIDDEN,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    }
    with open(os.path.join(args.out, "drafter", "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    tokens = torch.randint(0, VOCAB, (ROWS,))  # row t holds token t + 1
    taps = torch.randn(ROWS, 3 * TARGET_HIDDEN)
    with torch.no_grad():
        hidden = model.project_hidden_states(taps[None])
        mask = model.prepare_decoder_attention_mask(
            torch.ones(1, ROWS, dtype=torch.bool), hidden, 1, ROWS, 0
        )
        positions = torch.arange(ROWS)[None]
        cache = [[], []]
        out = model.backbone(model.embed_input_ids(tokens[None]), hidden, cache, mask, positions, use_cache=True)
        first = model.compute_logits(out)[0]
        chain_logits, drafted = [], []
        logits = first[-1]
        for step in range(CHAIN):
            chain_logits.append(logits.tolist())
            token = int(logits.argmax()) + int(model.d2t[int(logits.argmax())])
            drafted.append(token)
            if step + 1 == CHAIN:
                break
            # Every row takes the drafted token; only the last row's result is used (a row's
            # later steps see only its own earlier steps and the causal context).
            ids = torch.full((1, ROWS), token)
            out = model.backbone(model.embed_input_ids(ids), out, cache, mask, positions, use_cache=True)
            logits = model.compute_logits(out)[0, -1]

    fixture = {
        "made_by": "tools/eagle3_reference/make_fixture.py with specforge 0.2.0 (LlamaForCausalLMEagle3), torch "
        + torch.__version__,
        "tokens": tokens.tolist(),
        "taps": taps.tolist(),
        "first_pass_logits": first.tolist(),
        "chain_logits": chain_logits,
        "drafted": drafted,
    }
    with open(os.path.join(args.out, "fixture.json"), "w") as f:
        json.dump(fixture, f)
    print("drafted", drafted, file=sys.stderr)


if __name__ == "__main__":
    main()
