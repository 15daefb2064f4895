#!/usr/bin/env python3
"""Generate the DFlash parity fixtures in tests/fixtures/dflash/ from the official reference.

The reference is the `dflash==0.1.0` package itself: its `DFlashDraftModel` class and its
`dflash_generate` speculative loop, run unmodified on CPU in float32. This script only builds tiny
seeded models, saves them in the published on-disk formats (Hugging Face Qwen3 target, z-lab
DFlash drafter), reloads them from disk the way the package's benchmark does, runs the loop with
observation hooks, and writes what it saw. See README.md next to this file for how to run it.

Per case it writes <out>/<case>/target/{config.json, model.safetensors, tokenizer.json},
<out>/<case>/drafter/{config.json, model.safetensors} and <out>/<case>/expected.json.
"""

import argparse
import json
import math
import platform
import shutil
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config, Qwen3ForCausalLM

import dflash.model as dflash_model
from dflash.model import DFlashDraftModel, dflash_generate, extract_context_feature

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "dflash"

VOCAB = 256
HIDDEN = 64
MASK_TOKEN_ID = VOCAB - 1  # a real row of the target embedding, never resized
# Argmax decisions closer than this would be fragile across f32 kernels; every recorded greedy
# decision (target greedy, verify posteriors up to the first mismatch, every draft token) must
# clear it, so the Rust side can reproduce them exactly.
# Torch's own kernels disagree by ~1e-7 on these models (block verify vs one-token decode), so
# 2e-4 leaves a wide safety factor.
MIN_ARGMAX_MARGIN = 2e-4

PINNED = {"dflash": "0.1.0", "torch": "2.13.0", "transformers": "5.15.0"}

CASES = [
    {
        "name": "random",
        "about": "untrained random drafter; 2 drafter layers tapping target layers [1, 2]",
        "target": {"layers": 4, "seed": 11},
        "drafter": {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16,
                    "intermediate": 128, "seed": 21},
        "block_size": 8,
        "target_layer_ids": [1, 2],
        "prompt_ids": [17, 200, 3, 88, 143, 54, 9, 231, 120, 66, 5, 190, 33, 72],
        "max_new_tokens": 32,
        "fit": None,
    },
    {
        "name": "fitted",
        "about": "drafter briefly trained with the DFlash objective on the target's own greedy outputs",
        "target": {"layers": 4, "seed": 30},
        "drafter": {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16,
                    "intermediate": 128, "seed": 40},
        "block_size": 8,
        "target_layer_ids": [1, 2],
        "prompt_ids": [101, 7, 64, 250, 12, 199, 45, 133, 8, 77, 160, 29],
        "max_new_tokens": 40,
        "fit": {"seed": 32, "sequences": 96, "prompt_len": 12, "gen_len": 48, "steps": 400,
                "batch": 16, "anchors": 16, "lr": 3e-3, "gamma": 4.0},
    },
    {
        "name": "layers_mismatch",
        "about": "briefly trained 1-layer drafter with 3 taps [0, 1, 3] (3 = the target's last "
                 "layer) and its own head layout (8 heads / 4 kv heads, head_dim 8)",
        "target": {"layers": 4, "seed": 13},
        "drafter": {"layers": 1, "heads": 8, "kv_heads": 4, "head_dim": 8,
                    "intermediate": 96, "seed": 23},
        "block_size": 5,
        "target_layer_ids": [0, 1, 3],
        "prompt_ids": [240, 15, 99, 3, 180, 61, 222, 47, 130, 6, 91, 205, 38, 174, 19, 112, 57],
        "max_new_tokens": 27,
        "fit": {"seed": 33, "sequences": 96, "prompt_len": 17, "gen_len": 40, "steps": 1000,
                "batch": 16, "anchors": 12, "lr": 3e-3, "gamma": 3.0},
    },
]

# Larger than Qwen3's 0.02 (for target and drafter) so argmax decisions have clear margins and
# the drafter's output depends visibly on its context features.
TARGET_INIT_STD = 0.05
# If a seed gives a fragile argmax, the next seeds are tried (target and drafter seeds + attempt).
MAX_SEED_ATTEMPTS = 10


# config.json fields the target and the drafter share (both are Qwen3 models).
QWEN3_COMMON = {
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB,
}


def target_config_dict(num_layers):
    """A Qwen3 target config.json in the layout of published Qwen3 checkpoints (top-level rope_theta)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": TARGET_INIT_STD,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
        "max_window_layers": num_layers,
        "num_attention_heads": 4,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": 2,
        **QWEN3_COMMON,
    }


def drafter_config_dict(case):
    """A drafter config.json in the z-lab DFlash checkpoint layout."""
    d = case["drafter"]
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": case["block_size"],
        "dflash_config": {
            "mask_token_id": MASK_TOKEN_ID,
            "target_layer_ids": case["target_layer_ids"],
        },
        "head_dim": d["head_dim"],
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": TARGET_INIT_STD,
        "intermediate_size": d["intermediate"],
        "layer_types": ["full_attention"] * d["layers"],
        "max_position_embeddings": 512,
        "max_window_layers": d["layers"],
        "num_attention_heads": d["heads"],
        "num_hidden_layers": d["layers"],
        "num_key_value_heads": d["kv_heads"],
        "num_target_layers": case["target"]["layers"],
        **QWEN3_COMMON,
    }


def byte_level_tokenizer_json():
    """tokenizer.json for a byte-level BPE with exactly 256 tokens (one per byte, no merges)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    byte_to_char, extra = {}, 0
    for b in range(256):
        if b in printable:
            byte_to_char[b] = chr(b)
        else:
            byte_to_char[b] = chr(256 + extra)
            extra += 1
    vocab = {byte_to_char[b]: b for b in range(256)}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def perturb_norm_weights(model, generator):
    """RMSNorm weights start at exactly 1; move them so a port that mixes up norms fails."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))


def save_safetensors(model, path):
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()
             if "rotary_emb" not in k}
    save_file(state, str(path), metadata={"format": "pt"})
    return sorted(state)


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2) + "\n")


def build_target(case, target_dir, seed):
    target_dir.mkdir(parents=True)
    config_dict = target_config_dict(case["target"]["layers"])
    write_json(target_dir / "config.json", config_dict)
    write_json(target_dir / "tokenizer.json", byte_level_tokenizer_json())
    torch.manual_seed(seed)
    target = Qwen3ForCausalLM(Qwen3Config.from_pretrained(target_dir)).float().eval()
    perturb_norm_weights(target, torch.Generator().manual_seed(seed + 1000))
    save_safetensors(target, target_dir / "model.safetensors")


def build_drafter(case, drafter_dir, target, seed):
    drafter_dir.mkdir(parents=True)
    write_json(drafter_dir / "config.json", drafter_config_dict(case))
    torch.manual_seed(seed)
    drafter = DFlashDraftModel(Qwen3Config.from_pretrained(drafter_dir)).float()
    perturb_norm_weights(drafter, torch.Generator().manual_seed(seed + 1000))
    fit_log = None
    if case["fit"] is not None:
        fit_log = fit_drafter(drafter, target, case)
    drafter.eval()
    names = save_safetensors(drafter, drafter_dir / "model.safetensors")
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names), names
    return fit_log


def load_models(case_dir):
    """Load both models from disk exactly as dflash's benchmark.load_models does (f32, CPU)."""
    target = AutoModelForCausalLM.from_pretrained(
        case_dir / "target", attn_implementation="sdpa", dtype=torch.float32).eval()
    drafter = DFlashDraftModel.from_pretrained(
        case_dir / "drafter", attn_implementation="sdpa", dtype=torch.float32).eval()
    return target, drafter


def margin(logits_row):
    top = torch.topk(logits_row.float(), 2).values
    return (top[0] - top[1]).item()


@torch.no_grad()
def target_greedy(target, prompt_ids, n):
    """Plain greedy decoding with the target alone (KV cache, one token per step)."""
    cache = DynamicCache(config=target.config)
    out = target(torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True)
    tokens, margins = [], []
    for i in range(n):
        logits = out.logits[0, -1]
        token = int(torch.argmax(logits))
        tokens.append(token)
        margins.append(margin(logits))
        if i + 1 < n:
            out = target(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
    return tokens, margins


@torch.no_grad()
def greedy_continuations(target, prompts, n):
    """Batched greedy continuation without cache (training data only)."""
    ids = prompts.clone()
    for _ in range(n):
        next_ids = torch.argmax(target(ids).logits[:, -1], dim=-1, keepdim=True)
        ids = torch.cat([ids, next_ids], dim=1)
    return ids


def fit_drafter(drafter, target, case):
    """Train the drafter with the DFlash objective (spec §4): random anchors, block
    [anchor, MASK x (B-1)], context = target features strictly before the anchor, bidirectional
    attention inside the block, same-position CE on block positions 1..B-1 with decay weights.
    The forward is the package's own DFlashDraftModel.forward with a block-sparse mask."""
    fit = case["fit"]
    block = case["block_size"]
    layer_ids = case["target_layer_ids"]
    gen = torch.Generator().manual_seed(fit["seed"])
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()

    prompts = torch.randint(0, VOCAB - 1, (fit["sequences"] - 1, fit["prompt_len"]), generator=gen)
    # The fixture prompt's own trajectory is in the training set: the point of this case is a
    # drafter that is accepted often on that prompt, not generalisation.
    assert len(case["prompt_ids"]) == fit["prompt_len"]
    prompts = torch.cat([torch.tensor([case["prompt_ids"]]), prompts])
    seqs = greedy_continuations(target, prompts, fit["gen_len"])  # [N, S]
    num_seqs, seq_len = seqs.shape
    with torch.no_grad():
        out = target(seqs, output_hidden_states=True)
        features = extract_context_feature(out.hidden_states, layer_ids)  # [N, S, K*H]
        embed = target.get_input_embeddings().weight
    head = target.lm_head

    anchors_per_seq = fit["anchors"]
    q_len = anchors_per_seq * block
    k_off = torch.arange(block)
    decay = torch.exp(-(k_off - 1).clamp_min(0).float() / fit["gamma"])
    decay[0] = 0.0  # position 0 is the anchor itself: never a target

    opt = torch.optim.AdamW(drafter.parameters(), lr=fit["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / fit["steps"])))
    drafter.train()
    log = []
    t0 = time.time()
    for step in range(fit["steps"]):
        batch = torch.randint(0, num_seqs, (fit["batch"],), generator=gen)
        ids = seqs[batch]
        # anchors are generated tokens (as at inference): positions prompt_len .. S-2
        candidates = torch.arange(fit["prompt_len"], seq_len - 1)
        anchors = torch.stack([
            candidates[torch.randperm(len(candidates), generator=gen)[:anchors_per_seq]].sort().values
            for _ in range(fit["batch"])])  # [b, A]
        block_pos = (anchors[:, :, None] + k_off).reshape(fit["batch"], q_len)  # [b, A*B]
        noise_ids = torch.full((fit["batch"], anchors_per_seq, block), MASK_TOKEN_ID)
        noise_ids[:, :, 0] = ids.gather(1, anchors)
        noise_ids = noise_ids.reshape(fit["batch"], q_len)
        position_ids = torch.cat(
            [torch.arange(seq_len).expand(fit["batch"], seq_len), block_pos], dim=1)
        # mask[q, kv]: context key kv < anchor(q); block keys of the same block only
        q_anchor = anchors.repeat_interleave(block, dim=1)  # [b, A*B]
        ctx_visible = torch.arange(seq_len)[None, None, :] < q_anchor[:, :, None]
        q_block = torch.arange(q_len) // block
        blk_visible = (q_block[:, None] == q_block[None, :]).expand(fit["batch"], q_len, q_len)
        mask = torch.cat([ctx_visible, blk_visible], dim=2)[:, None]  # [b, 1, A*B, S+A*B]

        hidden = drafter(position_ids=position_ids, attention_mask=mask,
                         noise_embedding=F.embedding(noise_ids, embed),
                         target_hidden=features[batch])
        logits = drafter.compute_logits(hidden, head)  # [b, A*B, V]
        in_range = block_pos < seq_len
        labels = ids.gather(1, block_pos.clamp_max(seq_len - 1))
        weights = decay.repeat(anchors_per_seq)[None, :] * in_range
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
        loss = (ce * weights.reshape(-1)).sum() / (weights.sum() + 1e-6)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == fit["steps"] - 1:
            with torch.no_grad():
                hit = ((logits.argmax(-1) == labels) | (weights == 0)).reshape(
                    fit["batch"], anchors_per_seq, block)[:, :, 1:]
                accept_proxy = hit.int().cumprod(-1).sum(-1).float().mean().item() + 1
            log.append({"step": step, "loss": round(loss.item(), 4),
                        "tau_proxy": round(accept_proxy, 3)})
            print(f"    fit step {step:4d} loss {loss.item():.4f} tau_proxy {accept_proxy:.2f}",
                  flush=True)
    print(f"    fit took {time.time() - t0:.1f}s", flush=True)
    for p in target.parameters():
        p.requires_grad_(True)
    return log


def run_reference(drafter, target, prompt_ids, max_new_tokens):
    """Run dflash.model.dflash_generate (greedy) unmodified, observing its calls through hooks."""
    draft_calls, draft_logits, target_calls = [], [], []

    def on_draft(module, args, kwargs):
        draft_calls.append({
            "position_ids": kwargs["position_ids"][0].tolist(),
            "context_rows": int(kwargs["target_hidden"].shape[1]),
            "block_len": int(kwargs["noise_embedding"].shape[1]),
        })

    def on_target(module, args, kwargs, output):
        input_ids = args[0] if args else kwargs["input_ids"]
        target_calls.append({
            "input_ids": input_ids[0].tolist(),
            "position_ids": kwargs["position_ids"][0].tolist(),
            "logits": output.logits[0].detach().clone(),
        })

    package_compute_logits = drafter.compute_logits

    def recording_compute_logits(hidden, head):
        logits = package_compute_logits(hidden, head)
        draft_logits.append(logits[0].detach().clone())
        return logits

    handles = [drafter.register_forward_pre_hook(on_draft, with_kwargs=True),
               target.register_forward_hook(on_target, with_kwargs=True)]
    drafter.compute_logits = recording_compute_logits
    # return_stats times with torch.cuda.synchronize(); on CPU use the plain clock instead.
    package_cuda_time = dflash_model._cuda_time
    dflash_model._cuda_time = time.perf_counter
    try:
        stats = dflash_generate(drafter, target, torch.tensor([prompt_ids]), max_new_tokens,
                                stop_token_ids=None, temperature=0.0, return_stats=True)
    finally:
        dflash_model._cuda_time = package_cuda_time
        del drafter.compute_logits
        for h in handles:
            h.remove()

    output_ids = stats.output_ids[0].tolist()[len(prompt_ids):]
    verify_calls = target_calls[1:]
    assert len(verify_calls) == len(draft_calls) == len(draft_logits) == len(stats.acceptance_lengths)

    rounds, margins_draft, margins_verify = [], [], []
    committed = [output_ids[0]]  # the first token comes from the prefill logits
    prefill_margin = margin(target_calls[0]["logits"][-1])
    for call, dcall, dlogits, produced in zip(verify_calls, draft_calls, draft_logits,
                                              stats.acceptance_lengths):
        block = call["input_ids"]
        start = call["position_ids"][0]
        drafts = block[1:]
        assert drafts == torch.argmax(dlogits, -1).tolist(), "draft tokens are not argmax"
        assert dcall["position_ids"][-len(block):] == list(range(start, start + len(block)))
        assert dcall["position_ids"][0] == start - dcall["context_rows"]
        posterior = torch.argmax(call["logits"], -1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == posterior[accepted]:
            accepted += 1
        margins_draft += [margin(row) for row in dlogits]
        margins_verify += [margin(call["logits"][i]) for i in range(accepted + 1)]
        rounds.append({
            "start": start,
            "anchor": block[0],
            "context_rows": dcall["context_rows"],
            "verify_size": len(block),
            "draft_tokens": drafts,
            "accepted": accepted,
            "next_token": posterior[accepted],
            "produced": produced,
        })
        committed += drafts[:accepted] + [posterior[accepted]]
    assert committed[:max_new_tokens] == output_ids, "hook reconstruction disagrees with package"
    return {
        "output_ids": output_ids,
        "rounds": rounds,
        "acceptance_lengths": list(stats.acceptance_lengths),
        "first_round_draft_logits": draft_logits[0],
        "all_draft_logits": draft_logits,
        "margins": {"prefill": prefill_margin, "draft": min(margins_draft),
                    "verify": min(margins_verify)},
    }


def f32_list(tensor):
    return [[float(f"{x:.9g}") for x in row] for row in tensor.tolist()]


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    """NeoX rotate-half RoPE; x is [rows, heads, head_dim], positions are absolute."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * half, 2).float() / (2 * half)))
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles, angles], -1).cos()[:, None, :]
    sin = torch.cat([angles, angles], -1).sin()[:, None, :]
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


@torch.no_grad()
def spec_equation_draft_logits(case_dir, target, tokens, start, verify_size):
    """Drafter logits for one round written directly from the spec (§2.4, §3.3), independent of
    the package: raw safetensors + config.json, no KV cache. The context is recomputed from a fresh
    target forward over the committed tokens 0..start-1, which is what the package's cached,
    incremental context must equal."""
    cfg = json.loads((case_dir / "drafter" / "config.json").read_text())
    w = load_file(str(case_dir / "drafter" / "model.safetensors"))
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    n_h, n_kv, d_h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    mask_id = cfg["dflash_config"]["mask_token_id"]

    hidden_states = target(torch.tensor([tokens[:start]]), output_hidden_states=True).hidden_states
    feats = torch.cat([hidden_states[l + 1][0] for l in layer_ids], -1)  # [start, K*H]
    ctx = rms_norm(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    embed = target.get_input_embeddings().weight
    block = [tokens[start]] + [mask_id] * (verify_size - 1)
    h = embed[torch.tensor(block)]
    pos_ctx = torch.arange(start)
    pos_blk = torch.arange(start, start + verify_size)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        u = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q = rms_norm((u @ w[p + "self_attn.q_proj.weight"].T).view(verify_size, n_h, d_h),
                     w[p + "self_attn.q_norm.weight"], eps)
        q = rope(q, pos_blk, theta)
        k_rows = torch.cat([ctx, u]) @ w[p + "self_attn.k_proj.weight"].T
        v_rows = torch.cat([ctx, u]) @ w[p + "self_attn.v_proj.weight"].T
        k = rms_norm(k_rows.view(-1, n_kv, d_h), w[p + "self_attn.k_norm.weight"], eps)
        k = rope(k, torch.cat([pos_ctx, pos_blk]), theta)
        v = v_rows.view(-1, n_kv, d_h)
        group = n_h // n_kv
        heads = []
        for j in range(n_h):  # no mask: every block query sees all context and all block rows
            scores = (q[:, j] @ k[:, j // group].T) * d_h ** -0.5
            heads.append(torch.softmax(scores, -1) @ v[:, j // group])
        h = h + torch.cat(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        mlp = F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ w[p + "mlp.down_proj.weight"].T
    out = rms_norm(h, w["norm.weight"], eps)
    return out[1:] @ target.lm_head.weight.T


def check_against_spec_equations(case_dir, target, prompt, ref):
    """Max |logit difference| over all rounds between the package and the spec equations; also
    requires the same draft tokens in every round."""
    tokens = prompt + ref["output_ids"]
    worst = 0.0
    for rnd, logits in zip(ref["rounds"], ref["all_draft_logits"]):
        ours = spec_equation_draft_logits(case_dir, target, tokens, rnd["start"],
                                          rnd["verify_size"])
        assert torch.argmax(ours, -1).tolist() == rnd["draft_tokens"], rnd
        worst = max(worst, (ours - logits).abs().max().item())
    return worst


def check_hidden_state_convention(target):
    """Document what hidden_states[l+1] is for the target's last layer in this transformers."""
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        last = len(target.model.layers)
        raw = target.model.embed_tokens(ids)
        cache_free = target.model(ids, output_hidden_states=True)
    # hidden_states[last] equals the final-normed output (last_hidden_state) in transformers 5.x
    return bool(torch.equal(out.hidden_states[last], cache_free.last_hidden_state)), bool(
        torch.equal(out.hidden_states[0], raw))


def versions():
    return {
        "dflash": version("dflash"),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "safetensors": version("safetensors"),
        "python": platform.python_version(),
    }


def make_case(case, out_dir):
    name = case["name"]
    print(f"== {name}: {case['about']}", flush=True)
    for attempt in range(MAX_SEED_ATTEMPTS):
        seeds = {"target": case["target"]["seed"] + attempt,
                 "drafter": case["drafter"]["seed"] + attempt}
        result = try_case(case, out_dir / name, seeds)
        if result is not None:
            return name, result
        print(f"   seeds {seeds} give a fragile argmax; trying the next ones", flush=True)
    sys.exit(f"{name}: no seeds with clear argmax margins in {MAX_SEED_ATTEMPTS} attempts")


def try_case(case, case_dir, seeds):
    """Build, run and record one case with the given seeds; None if an argmax is fragile."""
    name = case["name"]
    shutil.rmtree(case_dir, ignore_errors=True)
    build_target(case, case_dir / "target", seeds["target"])
    target_for_fit = AutoModelForCausalLM.from_pretrained(
        case_dir / "target", attn_implementation="sdpa", dtype=torch.float32).eval()
    fit_log = build_drafter(case, case_dir / "drafter", target_for_fit, seeds["drafter"])
    del target_for_fit

    target, drafter = load_models(case_dir)
    assert drafter.target_layer_ids == case["target_layer_ids"]
    assert drafter.block_size == case["block_size"] and drafter.mask_token_id == MASK_TOKEN_ID
    prompt, n = case["prompt_ids"], case["max_new_tokens"]

    greedy, greedy_margins = target_greedy(target, prompt, n)
    ref = run_reference(drafter, target, prompt, n)
    tau = sum(ref["acceptance_lengths"]) / len(ref["acceptance_lengths"])
    last_tap_is_normed, first_is_embedding = check_hidden_state_convention(target)

    print(f"   target greedy : {greedy}")
    print(f"   speculative   : {ref['output_ids']}")
    print(f"   acceptance    : {ref['acceptance_lengths']}  tau = {tau:.3f}")
    margins = dict(ref["margins"], target_greedy=min(greedy_margins))
    print(f"   min argmax margins: {margins}")
    spec_diff = check_against_spec_equations(case_dir, target, prompt, ref)
    print(f"   spec-equation drafter vs package: max |logit diff| {spec_diff:.2e} over all rounds")
    assert spec_diff < 1e-4
    assert ref["output_ids"] == greedy, f"{name}: speculative output differs from target greedy"
    assert len(ref["output_ids"]) == n
    assert last_tap_is_normed and first_is_embedding
    if min(margins.values()) < MIN_ARGMAX_MARGIN:
        return None

    expected = {
        "case": name,
        "about": case["about"],
        "prompt_ids": prompt,
        "max_new_tokens": n,
        "block_size": case["block_size"],
        "mask_token_id": MASK_TOKEN_ID,
        "target_layer_ids": case["target_layer_ids"],
        "target_greedy_ids": greedy,
        "output_ids": ref["output_ids"],
        "rounds": ref["rounds"],
        "first_round_draft_logits": f32_list(ref["first_round_draft_logits"]),
        "acceptance_lengths": ref["acceptance_lengths"],
        "tau": round(tau, 6),
        "min_argmax_margins": {k: float(f"{v:.6g}") for k, v in margins.items()},
        "spec_equation_max_abs_logit_diff": float(f"{spec_diff:.3g}"),
        "seeds": {"target": seeds["target"], "target_norms": seeds["target"] + 1000,
                  "drafter": seeds["drafter"], "drafter_norms": seeds["drafter"] + 1000,
                  "fit": case["fit"]["seed"] if case["fit"] else None},
        "fit": None if case["fit"] is None else {"settings": case["fit"], "log": fit_log},
        "versions": versions(),
        "reference": "dflash.model.dflash_generate(drafter, target, prompt, max_new_tokens, "
                     "stop_token_ids=None, temperature=0.0), float32 on CPU, models loaded from "
                     "these directories with from_pretrained(attn_implementation='sdpa')",
        "conventions": {
            "taps": "tap l = hidden_states[l + 1] of the HF target forward; for l = the last "
                    "decoder layer HF returns the FINAL-NORMED output there (not the raw residual)",
            "acceptance_lengths": "the package's per-round `produced` = min(accepted + 1, "
                                  "prompt_len + max_new_tokens - start - 1): accepted + 1 except "
                                  "in a shrunken last round whose drafts were all accepted (its "
                                  "bonus token would lie past max_new_tokens and is dropped)",
            "verify_size": "min(block_size, prompt_len + max_new_tokens - start); the draft block "
                           "shrinks to verify_size near the end (fewer MASK rows in the drafter)",
            "rounds.start": "absolute position of the anchor; the drafter's query positions are "
                            "start .. start + verify_size - 1",
            "rounds.context_rows": "new context rows fed to the drafter this round (positions "
                                   "start - context_rows .. start - 1)",
            "first_round_draft_logits": "drafter logits for block positions 1 .. verify_size-1 of "
                                        "round 1 (rows), over the target vocabulary",
        },
    }
    write_json(case_dir / "expected.json", expected)
    return tau


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--allow-unpinned", action="store_true",
                        help="run even if dflash/torch/transformers are not the pinned versions")
    args = parser.parse_args()

    found = versions()
    mismatched = {k: (v, found[k]) for k, v in PINNED.items() if found[k].split("+")[0] != v}
    if mismatched and not args.allow_unpinned:
        sys.exit(f"pinned versions required (want, have): {mismatched}")
    # One thread: deterministic reductions, and far faster than two on a busy 2-core machine.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    out_dir = args.out.resolve()
    for case in CASES:
        shutil.rmtree(out_dir / case["name"], ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    taus = [make_case(case, out_dir) for case in CASES]
    print("== summary")
    for name, tau in taus:
        print(f"   {name:16s} tau = {tau:.3f}")
    total = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    print(f"   fixtures: {total / 1e6:.2f} MB in {out_dir}")


if __name__ == "__main__":
    main()
