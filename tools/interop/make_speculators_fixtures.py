#!/usr/bin/env python3
"""Tiny `speculators` DFlash and EAGLE-3 checkpoints + the package's own forward outputs.

Builds each drafter the way `speculators train` does (`create_transformer_layer_config` from
`speculators.train.cli`, then `<Model>.from_training_args`, with a reduced draft vocabulary
`d2t`/`t2d`), perturbs its trainable weights (seeded), saves it with the package's own
`save_pretrained`, reloads it with the package's own `from_pretrained`, and records the
package's forward on fixed random inputs. The verifier (target) is the repository's tiny Qwen3
fixture `tests/fixtures/dflash/random/target` (vocab 256, hidden 64, 4 layers): speculators reads
its `embed_tokens`, `lm_head` and final norm from there (the DFlash checkpoint does not store the
embedding; with a reduced vocabulary it stores `lm_head.weight` = the target's head rows `t2d`).

Run from the repository root (the verifier path is stored relative in config.json):

    TORCHDYNAMO_DISABLE=1 PYTHONPATH=/path/to/specforge-0.2.0 \
        python tools/interop/make_speculators_fixtures.py [--out tests/fixtures/interop]

PYTHONPATH to an unpacked SpecForge 0.2.0 wheel is optional: with it, the DFlash fixture is also
recomputed by SpecForge's z-lab-layout `DFlashDraftModel` after converting the layout (aux layer
ids - 1, see README.md) and the EAGLE-3 "plain" fixture by SpecForge's `LlamaForCausalLMEagle3`
(`layers.0.` -> `midlayer.`), and the script fails if they disagree by more than 1e-5.

Cases written to OUT/<case>/: drafter/{config.json, model.safetensors} and fixture.json.
"""

import argparse
import json
import os
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors import safe_open

TARGET = "tests/fixtures/dflash/random/target"
VOCAB, HIDDEN, TARGET_LAYERS = 256, 64, 4
DRAFT_VOCAB = 128
MASK_TOKEN_ID = 255

torch.set_num_threads(1)


def versions():
    out = {"torch": torch.__version__}
    for pkg in ("speculators", "transformers", "safetensors"):
        out[pkg] = version(pkg)
    return out


def reduced_vocab(generator):
    """speculators' convention (train/vocab_mapping.py): d2t[i] = target_id - i (int64),
    t2d = bool mask over the target vocabulary; ids sorted ascending."""
    ids = torch.sort(torch.randperm(VOCAB, generator=generator)[:DRAFT_VOCAB]).values
    d2t = ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    return ids, d2t, t2d


def perturb(model, generator, frozen):
    """Moves the trainable weights away from their init so a port that swaps or drops one fails:
    norms to 1 + 0.2·N(0,1), matrices to 0.08·N(0,1). Verifier-owned tensors stay."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(name.startswith(f) for f in frozen):
                continue
            if name.endswith("norm.weight") or ".norm." in name or name.endswith("_norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=generator))


def saved_tensors(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: (list(f.get_tensor(k).shape), str(f.get_tensor(k).dtype)) for k in f.keys()}


def min_margin(logits):
    """Smallest top-1 minus top-2 gap over the rows (argmax decisions closer than ~1e-4 are fragile)."""
    top = logits.reshape(-1, logits.shape[-1]).topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).min().item()


def fmt(t):
    return t.detach().to(torch.float32).tolist()


# ---------------------------------------------------------------- independent re-derivations
# Plain-torch forwards written from the checkpoint tensors alone (no speculators code), so the
# fixtures' descriptions (positions, masks, which feature is fed back) are checked, not assumed.


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """Llama/Qwen3 (NeoX, rotate-half) RoPE; x [rows, heads, d], pos [rows]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[:, None] * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _attend(q, k, v, allowed):
    """q [nq, H, d], k/v [nk, KV, d], allowed [nq, nk] bool."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, 1)
    v = v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def dflash_reference(w, cfg, embed, tokens, taps, anchor, block, mask_id):
    tl = cfg["transformer_layer_config"]
    eps, theta, hd = tl["rms_norm_eps"], tl["rope_parameters"]["rope_theta"], tl["head_dim"]
    P = anchor
    ctx = _rms(taps[:P] @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    ids = torch.tensor([int(tokens[P])] + [mask_id] * (block - 1))
    x = embed[ids]
    pos_k = torch.arange(P + block)
    pos_q = torch.arange(P, P + block)
    for i, lt in enumerate(tl["layer_types"]):
        p = lambda n: w[f"layers.{i}.{n}"]
        hn = _rms(x, p("input_layernorm.weight"), eps)
        kv_in = torch.cat([ctx, hn])
        q = _rms((hn @ p("self_attn.q_proj.weight").T).view(block, -1, hd), p("self_attn.q_norm.weight"), eps)
        k = _rms((kv_in @ p("self_attn.k_proj.weight").T).view(P + block, -1, hd), p("self_attn.k_norm.weight"), eps)
        v = (kv_in @ p("self_attn.v_proj.weight").T).view(P + block, -1, hd)
        q, k = _rope(q, pos_q, theta), _rope(k, pos_k, theta)
        allowed = torch.ones(block, P + block, dtype=torch.bool)
        if lt == "sliding_attention" and not cfg["sliding_window_non_causal"]:
            allowed[:, P:] = torch.tril(torch.ones(block, block, dtype=torch.bool))
        x = x + _attend(q, k, v, allowed).reshape(block, -1) @ p("self_attn.o_proj.weight").T
        u = _rms(x, p("post_attention_layernorm.weight"), eps)
        x = x + (torch.nn.functional.silu(u @ p("mlp.gate_proj.weight").T) * (u @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    return _rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T


def eagle3_reference(w, cfg, tokens, taps, steps):
    tl = cfg["transformer_layer_config"]
    eps, theta, hd = tl["rms_norm_eps"], tl["rope_parameters"]["rope_theta"], tl["head_dim"]
    T = len(tokens)
    p = lambda n: w[f"layers.0.{n}"]
    x = taps
    if cfg["norm_before_fc"]:
        x = _rms(x, w["input_norm.weight"], eps)
    feat = x @ w["fc.weight"].T
    keys, vals, owner, step_of = [], [], [], []  # per cached row
    out_logits = []
    for s in range(steps):
        toks = torch.tensor([int(tokens[t + s]) if t + s < T else 0 for t in range(T)])
        emb = w["embed_tokens.weight"][toks]
        e = _rms(emb, p("input_layernorm.weight"), eps)
        h = _rms(feat, p("hidden_norm.weight"), eps)
        residual = h if cfg["norm_before_residual"] else feat
        a = torch.cat([e, h], -1)
        pos = torch.arange(T) + 1 + s
        q = _rope((a @ p("self_attn.q_proj.weight").T).view(T, -1, hd), pos, theta)
        k = _rope((a @ p("self_attn.k_proj.weight").T).view(T, -1, hd), pos, theta)
        v = (a @ p("self_attn.v_proj.weight").T).view(T, -1, hd)
        keys.append(k)
        vals.append(v)
        K, V = torch.cat(keys), torch.cat(vals)
        allowed = torch.zeros(T, K.shape[0], dtype=torch.bool)
        for t in range(T):
            allowed[t, : t + 1] = True  # step-0 rows 0..t
            for j in range(1, s + 1):
                allowed[t, j * T + t] = True  # its own rows of steps 1..s
        o = residual + _attend(q, K, V, allowed).reshape(T, -1) @ p("self_attn.o_proj.weight").T
        u = _rms(o, p("post_attention_layernorm.weight"), eps)
        o = o + (torch.nn.functional.silu(u @ p("mlp.gate_proj.weight").T) * (u @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        normed = _rms(o, w["norm.weight"], eps)
        out_logits.append(normed @ w["lm_head.weight"].T)
        feat = normed if cfg["norm_output"] else o
    return torch.stack(out_logits)


# ---------------------------------------------------------------- DFlash


def make_dflash(out_dir, specforge):
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config

    g = torch.Generator().manual_seed(1234)
    ids, d2t, t2d = reduced_vocab(g)
    block = 4
    aux_ids = [1, 3]  # speculators / vLLM numbering: HF hidden_states index (z-lab: 0, 2)
    tl = create_transformer_layer_config(
        verifier_name_or_path=TARGET,
        num_layers=2,
        draft_arch="qwen3",
        hidden_act="silu",
        sliding_window=2048,
        full_attention_indices=[1],  # layer 0 sliding_attention (causal in block), layer 1 full
    )
    model = DFlashDraftModel.from_training_args(
        verifier_config=tl,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=TARGET,
        draft_vocab_size=DRAFT_VOCAB,
        block_size=block,
        target_layer_ids=aux_ids,
        mask_token_id=MASK_TOKEN_ID,
        draft_attn_impl="eager",
    )
    perturb(model, g, frozen=("embed_tokens", "lm_head", "verifier_"))
    model = model.float().eval()
    drafter = out_dir / "drafter"
    if drafter.exists():
        shutil.rmtree(drafter)
    model.save_pretrained(str(drafter))

    record_dflash(out_dir, g, specforge, made_by="package-initialised, weights perturbed")


def record_dflash(out_dir, g, specforge, made_by):
    """Reloads OUT/drafter with the package's own `from_pretrained` and records its forward on
    seeded random tokens and taps (block size, taps, mask id and draft vocabulary from its config)."""
    from speculators.models.dflash import DFlashDraftModel
    from safetensors.torch import load_file

    drafter = out_dir / "drafter"
    cfg = json.load(open(drafter / "config.json"))
    block, aux_ids, mask_id = cfg["block_size"], cfg["aux_hidden_state_layer_ids"], cfg["mask_token_id"]
    w = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(drafter / "model.safetensors")).items()}
    # Reload exactly as a user would.
    config = DFlashDraftModel.config_class.from_pretrained(str(drafter))
    config.transformer_layer_config._attn_implementation = "eager"  # as `speculators train` does
    model = DFlashDraftModel.from_pretrained(str(drafter), config=config).float().eval()
    # The package loads the verifier's embedding (and, for a drafter over the whole vocabulary,
    # its head) cast to the checkpoint's dtype (bfloat16 for a trained one: 5e-4 off here, 4e-3
    # in the logits); specula uses the target's own. Recorded with the target's own (f32), which
    # changes nothing for a float32 checkpoint.
    target_weights = load_file(str(Path(TARGET) / "model.safetensors"))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target_weights["model.embed_tokens.weight"])
        if "lm_head.weight" not in w:
            model.lm_head.weight.copy_(target_weights["lm_head.weight"])
    # A drafter over the whole vocabulary (speculators' default) stores neither `d2t` nor
    # `lm_head.weight`: it scores with the verifier's head.
    d2t = w.get("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
    w.setdefault("lm_head.weight", model.lm_head.weight.detach().float())

    T = 24
    tokens = torch.randint(0, VOCAB - 1, (T,), generator=g)
    taps = torch.randn(T, len(aux_ids) * HIDDEN, generator=g)
    last = torch.randn(T, HIDDEN, generator=g)
    anchors = [5, 11, 17]
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, anchors] = 1
    with torch.no_grad():
        _, logits, _, _, idx = model._backbone_forward(
            taps[None],
            tokens[None],
            loss_mask,
            last[None],
            torch.zeros(1, T, dtype=torch.long),
            max_anchors=len(anchors),
        )
    logits = logits[0].view(len(anchors), block, -1)
    assert idx.view(len(anchors), block)[:, 0].tolist() == anchors
    argmax = logits.argmax(-1)
    drafted = (argmax + d2t[argmax]).tolist()

    # Same forward with the sdpa path (boolean mask) must agree.
    model.config.transformer_layer_config._attn_implementation = "sdpa"
    model._attn_impl = "sdpa"
    from torch.nn.attention.flex_attention import create_mask

    model._create_mask_fn = create_mask
    with torch.no_grad():
        _, logits_sdpa, _, _, _ = model._backbone_forward(
            taps[None], tokens[None], loss_mask, last[None],
            torch.zeros(1, T, dtype=torch.long), max_anchors=len(anchors),
        )
    diff = (logits_sdpa[0].view_as(logits) - logits).abs().max().item()
    assert diff < 1e-5, f"eager vs sdpa: {diff}"

    checks = {"eager_vs_sdpa_max_abs": diff}
    worst = max(
        (dflash_reference(w, cfg, model.embed_tokens.weight.float(), tokens, taps, a, block, mask_id) - logits[i]).abs().max().item()
        for i, a in enumerate(anchors)
    )
    assert worst < 1e-5, f"independent DFlash forward disagrees: {worst}"
    checks["independent_max_abs"] = worst
    checks["min_top2_margin_rows_1_to_B-1"] = min_margin(logits[:, 1:])
    if specforge:
        checks["specforge_zlab_max_abs"] = dflash_via_specforge(
            drafter, tokens, taps, anchors, block, aux_ids, logits, model
        )
    tl = cfg["transformer_layer_config"]
    fixture = {
        "made_by": f"tools/interop/make_speculators_fixtures.py (speculators DFlashDraftModel._backbone_forward; {made_by})",
        "versions": versions(),
        "target": TARGET,
        "about": (
            f"speculators DFlash drafter: {tl['num_hidden_layers']} Qwen3-style layers, layer_types "
            f"{tl['layer_types']} (sliding window {tl.get('sliding_window')}, causal inside the block), "
            f"block_size {block}, aux_hidden_state_layer_ids {aux_ids} (= z-lab target_layer_ids "
            f"{[i - 1 for i in aux_ids]}), mask {mask_id}, draft vocab {cfg['draft_vocab_size']} "
            "(lm_head.weight = target head rows t2d; draft id i -> target id i + d2t[i])."
        ),
        "tokens": tokens.tolist(),
        "taps": fmt(taps),
        "taps_about": "row t = concat(target hidden states of aux layers, in aux_hidden_state_layer_ids order) at position t",
        "anchors": anchors,
        "block_size": block,
        "block_logits": fmt(logits),
        "block_logits_about": (
            "per anchor P: drafter logits over the draft vocabulary for the block [x[P], MASK x (B-1)] at "
            "positions P..P+B-1, context = taps rows 0..P-1; row k (1..B-1) predicts x[P+k]; row 0 "
            "(the anchor) is computed but unused when sample_from_anchor is false"
        ),
        "draft_argmax": argmax.tolist(),
        "drafted_target_ids": drafted,
        "checks": checks,
        "saved_tensors": saved_tensors(drafter / "model.safetensors"),
    }
    with open(out_dir / "fixture.json", "w") as f:
        json.dump(fixture, f)
    print(f"dflash: drafted {drafted} checks {checks}", file=sys.stderr)


def dflash_via_specforge(drafter, tokens, taps, anchors, block, aux_ids, ref_logits, spec_model):
    """Converts the speculators checkpoint to the z-lab layout and runs SpecForge's DFlashDraftModel."""
    from safetensors.torch import load_file
    from specforge.modeling.draft.dflash import DFlashDraftModel as SFDFlash
    from transformers import Qwen3Config

    cfg = json.load(open(drafter / "config.json"))
    tlc = dict(cfg["transformer_layer_config"])
    qc = Qwen3Config(
        **{k: v for k, v in tlc.items() if k not in ("architectures", "model_type")},
    )
    qc.architectures = ["DFlashDraftModel"]
    qc.block_size = cfg["block_size"]
    qc.num_target_layers = TARGET_LAYERS
    qc.dflash_config = {
        "mask_token_id": cfg["mask_token_id"],
        "target_layer_ids": [i - 1 for i in cfg["aux_hidden_state_layer_ids"]],
    }
    qc._attn_implementation = "eager"
    sf = SFDFlash(qc).float().eval()
    weights = load_file(str(drafter / "model.safetensors"))
    weights.setdefault("lm_head.weight", spec_model.lm_head.weight.detach())
    body = {k: v for k, v in weights.items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = sf.load_state_dict(body, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    embed = spec_model.embed_tokens.weight
    head = weights["lm_head.weight"].float()
    worst = 0.0
    for a_i, p in enumerate(anchors):
        ids = torch.full((1, block), MASK_TOKEN_ID)
        ids[0, 0] = tokens[p]
        noise = embed[ids]
        pos = torch.arange(p + block)[None]
        mask_full = torch.ones(1, 1, block, p + block, dtype=torch.bool)
        mask_causal = mask_full.clone()
        mask_causal[0, 0, :, p:] = torch.tril(torch.ones(block, block, dtype=torch.bool))
        with torch.no_grad():
            h = sf(
                position_ids=pos,
                attention_mask={"sliding_attention": mask_causal, "full_attention": mask_full},
                noise_embedding=noise,
                target_hidden=taps[None, :p],
            )
        lg = h[0] @ head.T
        worst = max(worst, (lg - ref_logits[a_i]).abs().max().item())
    assert worst < 1e-5, f"SpecForge z-lab layout disagrees with speculators: {worst}"
    return worst


# ---------------------------------------------------------------- EAGLE-3


def make_eagle3(out_dir, specforge, *, defaults):
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    g = torch.Generator().manual_seed(4321 if defaults else 8765)
    ids, d2t, t2d = reduced_vocab(g)
    aux_ids = [1, 2, 3]  # speculators / vLLM numbering (SpecForge/SGLang numbering: 0, 1, 2)
    tl = create_transformer_layer_config(
        verifier_name_or_path=TARGET,
        num_layers=1,
        draft_arch="llama",
        hidden_act="silu",
        sliding_window=2048,
        full_attention_indices=[] if defaults else [0],
    )
    flags = dict(norm_before_residual=True, norm_before_fc=True, norm_output=True) if defaults else dict(
        norm_before_residual=False, norm_before_fc=False, norm_output=False
    )
    ttt_steps = 4
    model = Eagle3DraftModel.from_training_args(
        verifier_config=tl,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=TARGET,
        draft_vocab_size=DRAFT_VOCAB,
        target_layer_ids=aux_ids,
        ttt_steps=ttt_steps,
        draft_attn_impl="eager",
        **flags,
    )
    # speculators keeps lm_head frozen (DraftVocabMixin) at the target head rows t2d, so a real
    # checkpoint's lm_head equals those rows; it is perturbed here anyway, so that a loader that
    # takes the target's rows instead of the checkpoint's lm_head.weight fails this fixture.
    perturb(model, g, frozen=("embed_tokens", "verifier_"))
    model = model.float().eval()
    drafter = out_dir / "drafter"
    if drafter.exists():
        shutil.rmtree(drafter)
    model.save_pretrained(str(drafter))
    record_eagle3(out_dir, g, specforge, made_by="package-initialised, weights perturbed")


def record_eagle3(out_dir, g, specforge, made_by):
    """Reloads OUT/drafter with the package's own `from_pretrained` and records its forward
    (4 test-time-training steps, the logits of each captured at `lm_head`) on seeded random
    tokens and taps."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from safetensors.torch import load_file

    drafter = out_dir / "drafter"
    cfg = json.load(open(drafter / "config.json"))
    aux_ids = cfg["eagle_aux_hidden_state_layer_ids"]
    flags = {k: cfg[k] for k in ("norm_before_residual", "norm_before_fc", "norm_output")}
    layer_types = cfg["transformer_layer_config"].get("layer_types") or ["full_attention"]
    ttt_steps = 4
    config = Eagle3DraftModel.config_class.from_pretrained(str(drafter))
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(str(drafter), config=config).float().eval()

    T = 12
    tokens = torch.randint(0, VOCAB, (T,), generator=g)
    taps = torch.randn(T, len(aux_ids) * HIDDEN, generator=g)
    captured = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach().clone()))
    with torch.no_grad():
        draft_tokens = model(
            hidden_states=taps[None],
            input_ids=tokens[None],
            document_ids=torch.zeros(1, T, dtype=torch.long),
            ttt_steps=ttt_steps,
        )
    hook.remove()
    step_logits = torch.stack([c[0] for c in captured])  # [steps, T, draft_vocab]
    assert torch.equal(step_logits.argmax(-1), torch.stack([d[0] for d in draft_tokens]))
    argmax = step_logits.argmax(-1)
    w = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(drafter / "model.safetensors")).items()}
    d2t = w["d2t"]
    drafted = (argmax + d2t[argmax]).tolist()

    ref = eagle3_reference(w, cfg, tokens, taps, ttt_steps)
    worst = (ref - step_logits).abs().max().item()
    assert worst < 1e-5, f"independent EAGLE-3 forward disagrees: {worst}"
    checks = {"independent_max_abs": worst, "min_top2_margin": min_margin(step_logits)}
    if specforge and not any(flags.values()) and layer_types == ["full_attention"]:
        checks["specforge_first_pass_max_abs"] = eagle3_via_specforge(drafter, tokens, taps, step_logits[0])
    on = [k for k, v in flags.items() if v]
    fixture = {
        "made_by": f"tools/interop/make_speculators_fixtures.py (speculators Eagle3DraftModel.forward, lm_head hooked; {made_by})",
        "versions": versions(),
        "target": TARGET,
        "about": (
            f"speculators EAGLE-3 drafter, 1 Llama layer, draft vocab {cfg['draft_vocab_size']}, "
            f"eagle_aux_hidden_state_layer_ids {aux_ids} (vLLM numbering = SpecForge/SGLang "
            f"{[i - 1 for i in aux_ids]}); flags on: {on or 'none'} (norm_before_fc: input_norm over the "
            "concatenated taps before fc; norm_output: the fed-back feature is the post-norm output); "
            f"layer_types {layer_types}"
        ),
        "tokens": tokens.tolist(),
        "taps": fmt(taps),
        "taps_about": "row t = concat of the aux target hidden states (aux id order) of the target row that precedes tokens[t]",
        "positions": [t + 1 for t in range(T)],
        "ttt_steps": ttt_steps,
        "step_logits": fmt(step_logits),
        "step_logits_about": (
            "step 0: one causal pass over rows t = (embed(tokens[t]), fc(taps[t])) at position t+1. "
            "step s >= 1: row t takes token tokens[t+s] (0 when t+s >= T) and, as its feature, row t's "
            "step s-1 output (post-norm if norm_output else pre-norm), at position t+1+s; it attends to "
            "step-0 rows 0..t and to its own rows of steps 1..s-1 (plus itself). Logits over the draft vocab."
        ),
        "draft_argmax": argmax.tolist(),
        "drafted_target_ids": drafted,
        "checks": checks,
        "saved_tensors": saved_tensors(drafter / "model.safetensors"),
    }
    with open(out_dir / "fixture.json", "w") as f:
        json.dump(fixture, f)
    print(f"eagle3 ({made_by}): checks {checks}", file=sys.stderr)


def trained(ckpt, out_dir, specforge, kind):
    """A checkpoint that `speculators train` wrote (its config.json and model.safetensors), copied
    as OUT/drafter with the verifier path pointed at the repository's tiny target, and its forward
    recorded as for the package-initialised cases."""
    drafter = out_dir / "drafter"
    if drafter.exists():
        shutil.rmtree(drafter)
    drafter.mkdir(parents=True)
    cfg = json.load(open(Path(ckpt) / "config.json"))
    cfg["speculators_config"]["verifier"]["name_or_path"] = TARGET
    with open(drafter / "config.json", "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    shutil.copyfile(Path(ckpt) / "model.safetensors", drafter / "model.safetensors")
    g = torch.Generator().manual_seed(2468 if kind == "dflash" else 1357)
    (record_dflash if kind == "dflash" else record_eagle3)(
        out_dir, g, specforge, made_by="trained by `speculators train` on data `specula train export` wrote"
    )
    # What the training run was, beside what it computes.
    fixture = json.load(open(out_dir / "fixture.json"))
    command = [l for l in open(Path(ckpt) / "train_command.txt").read().splitlines() if l and not l.startswith("#")]
    fixture["training"] = {
        "command": command[-1].replace("tools/interop/speculators_cpu_train_demo.py", "speculators train"),
        "training_state": json.load(open(Path(ckpt) / "training_state.json")),
        "val_metrics": json.load(open(Path(ckpt) / "val_metrics.json")),
        "checkpoint_dtype": sorted({dtype for _, dtype in fixture["saved_tensors"].values()}),
    }
    with open(out_dir / "fixture.json", "w") as f:
        json.dump(fixture, f)


def eagle3_via_specforge(drafter, tokens, taps, first_logits):
    """Loads the speculators EAGLE-3 checkpoint into SpecForge's LlamaForCausalLMEagle3 (midlayer
    names) and compares the first causal pass."""
    from safetensors.torch import load_file
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers.models.llama.configuration_llama import LlamaConfig

    cfg = json.load(open(drafter / "config.json"))
    tlc = {k: v for k, v in cfg["transformer_layer_config"].items() if k not in ("architectures", "model_type")}
    lc = LlamaConfig(**tlc)
    lc.draft_vocab_size = cfg["draft_vocab_size"]
    lc.target_hidden_size = HIDDEN
    lc.pretraining_tp = 1
    lc.norm_before_residual = cfg["norm_before_residual"]
    lc.tie_word_embeddings = False
    sf = LlamaForCausalLMEagle3(lc).float().eval()
    w = load_file(str(drafter / "model.safetensors"))
    w = {k.replace("layers.0.", "midlayer."): v for k, v in w.items()}
    missing, unexpected = sf.load_state_dict(w, strict=False)
    assert not unexpected, unexpected
    assert not [m for m in missing if "rotary" not in m], missing
    T = len(tokens)
    with torch.no_grad():
        hidden = sf.project_hidden_states(taps[None])
        mask = sf.prepare_decoder_attention_mask(torch.ones(1, T, dtype=torch.bool), hidden, 1, T, 0)
        cache = [[], []]
        out = sf.backbone(sf.embed_input_ids(tokens[None]), hidden, cache, mask, torch.arange(T)[None], use_cache=True)
        lg = sf.compute_logits(out)[0]
    worst = (lg - first_logits).abs().max().item()
    assert worst < 1e-5, f"SpecForge disagrees with speculators on the first pass: {worst}"
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/interop")
    ap.add_argument("--trained-dflash", help="a DFlash checkpoint `speculators train` wrote: only the -trained case")
    ap.add_argument("--trained-eagle3", help="an EAGLE-3 checkpoint `speculators train` wrote: only the -trained case")
    args = ap.parse_args()
    if not Path(TARGET, "config.json").exists():
        sys.exit("run from the repository root")
    try:
        import specforge  # noqa: F401

        specforge = True
    except ImportError:
        specforge = False
    out = Path(args.out)
    if args.trained_dflash or args.trained_eagle3:
        for kind, ckpt in (("dflash", args.trained_dflash), ("eagle3", args.trained_eagle3)):
            if ckpt:
                d = out / f"speculators-{kind}-trained"
                d.mkdir(parents=True, exist_ok=True)
                trained(ckpt, d, specforge, kind)
        return
    for name, fn in [
        ("speculators-dflash", lambda d: make_dflash(d, specforge)),
        ("speculators-eagle3", lambda d: make_eagle3(d, specforge, defaults=True)),
        ("speculators-eagle3-plain", lambda d: make_eagle3(d, specforge, defaults=False)),
    ]:
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        fn(d)


if __name__ == "__main__":
    main()
