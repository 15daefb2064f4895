"""A tiny random Llama with Llama 3 RoPE scaling and the logits Hugging Face transformers
computes for it, as the fixture of `tests/model_families.rs` (tests/fixtures/llama3-rope/).

    ~/.venvs/dflash/bin/python tools/llama3_rope_reference/make_fixture.py tests/fixtures/llama3-rope

The scaling's original context (64) is short enough that, with head_dim 16 and base 500000,
one frequency is kept, one is blended and six are slowed by the factor: every branch of the
rule runs. Any transformers with `LlamaForCausalLM` and `rope_type: llama3` will do (made with
transformers 5.15, torch 2.13, CPU, float32).
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> int:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        # Norm weights near one, as trained models have them.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out, "model.safetensors"))
    ids = [int(x) for x in torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(7))]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    json.dump(
        {
            "engine": "transformers LlamaForCausalLM, float32, CPU",
            "token_ids": ids,
            "logits": [[round(float(x), 6) for x in row] for row in logits],
        },
        open(os.path.join(out, "expected.json"), "w"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
