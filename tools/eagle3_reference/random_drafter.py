"""Writes an EAGLE-3 drafter with random weights for SmolLM2-135M (width 576, 9 heads of 64 with
3 KV heads, FFN 1536, a draft vocabulary of the first 8,192 token ids, no embedding of its own):
what a trained drafter of that shape costs per draft step, without its acceptance.

Usage: python random_drafter.py OUT_DIR   (needs torch and safetensors)
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

H, HEADS, KV, D, FFN, VOCAB, DRAFT = 576, 9, 3, 64, 1536, 49152, 8192


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)

    def w(*shape):
        return (0.02 * torch.randn(*shape)).to(torch.float16)

    t = {"fc.weight": w(H, 3 * H), "norm.weight": torch.ones(H, dtype=torch.float16), "lm_head.weight": w(DRAFT, H)}
    for n in ["input_layernorm", "hidden_norm", "post_attention_layernorm"]:
        t[f"midlayer.{n}.weight"] = torch.ones(H, dtype=torch.float16)
    t["midlayer.self_attn.q_proj.weight"] = w(HEADS * D, 2 * H)
    t["midlayer.self_attn.k_proj.weight"] = w(KV * D, 2 * H)
    t["midlayer.self_attn.v_proj.weight"] = w(KV * D, 2 * H)
    t["midlayer.self_attn.o_proj.weight"] = w(H, HEADS * D)
    t["midlayer.mlp.gate_proj.weight"] = w(FFN, H)
    t["midlayer.mlp.up_proj.weight"] = w(FFN, H)
    t["midlayer.mlp.down_proj.weight"] = w(H, FFN)
    t["d2t"] = torch.zeros(DRAFT, dtype=torch.int64)
    save_file(t, os.path.join(out, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D,
        "intermediate_size": FFN, "vocab_size": VOCAB, "draft_vocab_size": DRAFT, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "hidden_act": "silu",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


if __name__ == "__main__":
    main()
