#!/usr/bin/env python3
"""Generate the DFlash training-loss fixture in tests/fixtures/dflash-train/ from the official reference.

It loads the tiny `random` case of tests/fixtures/dflash/ (an HF Qwen3 target and a z-lab DFlash
drafter) with the `dflash==0.1.0` package exactly as make_fixtures.py does (f32, CPU), builds a
fixed, seeded batch of two sequences with chosen anchors, evaluates the DFlash training objective
with the package's own `DFlashDraftModel.forward` (one forward per sequence, all its anchor blocks
at once under a block-sparse boolean mask), backpropagates, and writes

  <out>/batch.json          the batch (tokens, prompt length, anchors) and the settings
  <out>/expected.json       the loss, its weight sum, per-offset accuracy, a few logit rows
  <out>/grads.safetensors   d loss / d parameter for every drafter parameter, f32, checkpoint names
  <out>/README.md           what the fields are and the exact loss

The loss (what the Rust trainer implements) is spelled out in the README it writes.
See README.md next to this file for how to run it.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import make_fixtures as mf  # next to this file: models, greedy decoding, spec equations, versions
from dflash.model import extract_context_feature

DEFAULT_CASE = mf.REPO_ROOT / "tests" / "fixtures" / "dflash" / "random"
DEFAULT_OUT = mf.REPO_ROOT / "tests" / "fixtures" / "dflash-train"

GAMMA = 4.0
BATCH_SEED = 1234
# (sequence length, prompt length, number of anchors)
SEQUENCES = [(40, 10, 5), (29, 8, 4)]


def forced_anchors(length, prompt, block):
    """Anchors a sequence must have: the last prompt token (P-1) and len-2 (the last anchor with a
    label; its block runs past the end). build_batch adds len-B (block ends exactly on the last
    token, all rows valid) and len-B+1 (last row just past the end) to the first sequence."""
    return {prompt - 1, length - 2}


def build_batch(target, block, mask_id):
    gen = torch.Generator().manual_seed(BATCH_SEED)
    sequences = []
    for index, (length, prompt_len, n_anchors) in enumerate(SEQUENCES):
        prompt = torch.randint(0, mask_id, (prompt_len,), generator=gen).tolist()  # ids 0..254
        continuation, _ = mf.target_greedy(target, prompt, length - prompt_len)
        tokens = prompt + continuation
        forced = forced_anchors(length, prompt_len, block)
        if index == 0:
            forced |= {length - block, length - block + 1}
        candidates = [p for p in range(prompt_len - 1, length - 1) if p not in forced]
        extra = torch.randperm(len(candidates), generator=gen)[:n_anchors - len(forced)].tolist()
        anchors = sorted(forced | {candidates[i] for i in extra})
        assert len(anchors) == n_anchors and len(set(anchors)) == n_anchors
        assert all(prompt_len - 1 <= p <= length - 2 for p in anchors)
        assert any(p + block - 1 >= length for p in anchors)
        sequences.append({"tokens": tokens, "prompt_tokens": prompt_len, "anchors": anchors})
    return sequences


def sequence_rows(drafter, target, seq, block, mask_id, layer_ids, gamma):
    """One sequence: the package's drafter forward over all its anchor blocks at once (the mask
    built exactly as make_fixtures.fit_drafter builds it), logits, labels and weights per row."""
    ids = torch.tensor([seq["tokens"]])
    seq_len = ids.shape[1]
    prompt_len = seq["prompt_tokens"]
    anchors = torch.tensor([seq["anchors"]])  # [1, A]
    n_anchors = anchors.shape[1]
    q_len = n_anchors * block
    k_off = torch.arange(block)

    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        features = extract_context_feature(out.hidden_states, layer_ids)  # [1, S, K*H]
    embed = target.get_input_embeddings().weight

    block_pos = (anchors[:, :, None] + k_off).reshape(1, q_len)  # [1, A*B]
    noise_ids = torch.full((1, n_anchors, block), mask_id)
    noise_ids[:, :, 0] = ids.gather(1, anchors)
    noise_ids = noise_ids.reshape(1, q_len)
    position_ids = torch.cat([torch.arange(seq_len)[None], block_pos], dim=1)
    # mask[q, kv] (bool, True = visible): context key kv < anchor(q); block keys of q's own block
    q_anchor = anchors.repeat_interleave(block, dim=1)  # [1, A*B]
    ctx_visible = torch.arange(seq_len)[None, None, :] < q_anchor[:, :, None]
    q_block = torch.arange(q_len) // block
    blk_visible = (q_block[:, None] == q_block[None, :]).expand(1, q_len, q_len)
    mask = torch.cat([ctx_visible, blk_visible], dim=2)[:, None]  # [1, 1, A*B, S+A*B]

    hidden = drafter(position_ids=position_ids, attention_mask=mask,
                     noise_embedding=F.embedding(noise_ids, embed), target_hidden=features)
    logits = drafter.compute_logits(hidden, target.lm_head)[0]  # [A*B, V]

    loss_mask = (torch.arange(seq_len) >= prompt_len)
    pos = block_pos[0]
    in_range = pos < seq_len
    labels = ids[0].gather(0, pos.clamp_max(seq_len - 1))
    decay = torch.exp(-(k_off - 1).float() / gamma)
    decay[0] = 0.0  # row 0 is the anchor itself: never a target
    weights = decay.repeat(n_anchors) * in_range * loss_mask[pos.clamp_max(seq_len - 1)]
    offsets = k_off.repeat(n_anchors)
    return logits, labels, weights, offsets, features


def pooled_loss(rows):
    logits = torch.cat([r[0] for r in rows])
    labels = torch.cat([r[1] for r in rows])
    weights = torch.cat([r[2] for r in rows])
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weights).sum() / weights.sum()


def per_anchor_check(drafter, target, seq, features, logits, block, mask_id, layer_ids, case_dir):
    """Each block row of the masked multi-anchor forward must equal (a) the package's forward of
    that anchor's block alone, against context features 0..p-1 and no mask, and (b) the
    spec-equation drafter of make_fixtures.py (raw safetensors, fresh target forward over x[0..p))."""
    ids = seq["tokens"]
    embed = target.get_input_embeddings().weight
    worst_single, worst_spec = 0.0, 0.0
    with torch.no_grad():
        for a, p in enumerate(seq["anchors"]):
            block_ids = torch.tensor([[ids[p]] + [mask_id] * (block - 1)])
            pos = torch.arange(p + block)[None]
            hidden = drafter(position_ids=pos, attention_mask=None,
                             noise_embedding=F.embedding(block_ids, embed),
                             target_hidden=features[:, :p])
            single = drafter.compute_logits(hidden, target.lm_head)[0]
            rows = logits[a * block:(a + 1) * block]
            worst_single = max(worst_single, (single - rows).abs().max().item())
            spec = mf.spec_equation_draft_logits(case_dir, target, ids, p, block)
            worst_spec = max(worst_spec, (spec - rows[1:]).abs().max().item())
    return worst_single, worst_spec


def f32(x):
    return float(f"{x:.9g}")


README = """# DFlash training-loss fixture

Generated by `tools/dflash_reference/make_train_fixture.py` (see `tools/dflash_reference/README.md`)
with the official `dflash==0.1.0` package, torch 2.13.0 and transformers 5.15.0, float32 on CPU, one
thread, deterministic algorithms. Do not edit by hand; regenerate instead.

Models: the `random` case of `tests/fixtures/dflash/` (read from there, not copied): `target/` an
HF Qwen3 (vocab 256, hidden 64, 4 layers), `drafter/` a z-lab DFlash drafter (block_size 8,
target_layer_ids [1, 2], mask_token_id 255, 2 layers, untrained), both loaded with
`from_pretrained(attn_implementation="sdpa", dtype=float32)`.

## `batch.json`

- `sequences`: two examples, each `{tokens, prompt_tokens, anchors}`. Lengths 40 and 29; `tokens` is
  a seeded random prompt of 10 / 8 ids in 0..254 followed by the target's own greedy continuation
  (so generated tokens may be any id 0..255). `anchors` are distinct, sorted, with
  `prompt_tokens - 1 <= p <= len - 2`; both sequences have an anchor at `prompt_tokens - 1` and at
  `len - 2`; sequence 0 also has `len - 8` (block ends exactly on the last token) and `len - 7`
  (its last row is past the end).
- `gamma`, `block_size`, `mask_token_id`, `target_layer_ids`: the loss settings below.

## The loss

For each sequence s with tokens x[0..S) and P = `prompt_tokens`: loss mask m[i] = 1 if i >= P else
0; target features F[i] = concat over l in `target_layer_ids` of HF `hidden_states[l + 1]` at
position i (forward of the target over the whole of x; causal, so F[i] depends on x[0..i] only).

For each anchor p, a block of B rows at positions p .. p+B-1 (always all B rows, even when
p+B-1 >= S): row 0's input id is x[p], rows 1..B-1 are the MASK id; their embeddings are rows of
the target's input embedding. A block row of anchor p attends to context keys at positions
0..p-1 (the drafter's `hidden_norm(fc(F[j]))`, j < p; strictly before the anchor) and to all B rows
of its own block (bidirectional, including rows past the end of the sequence), nothing else.
RoPE positions: context key j at j, block row k at p+k. All anchors of a sequence go through one
forward: `DFlashDraftModel.forward(position_ids=[0..S) ++ block positions, attention_mask=bool
[1, 1, A*B, S+A*B] (True = visible), noise_embedding, target_hidden=F)`. Logits =
`drafter.compute_logits(hidden, target.lm_head)` (plain LM head here: no multiplier, no softcap).

Row k >= 1 of anchor p has label x[p+k] and weight w = exp(-(k-1)/gamma) if p+k < S and
m[p+k] = 1, else 0; row 0 always has weight 0. CE = softmax cross-entropy over the full vocabulary
(natural log).

    loss = sum over all rows of both sequences of w * CE  /  sum of w     (pooled, no epsilon)

Gradients: `loss.backward()` with the target frozen; only drafter parameters get gradients.

## `expected.json`

- `loss`: the loss above as torch computed it in f32 (printed to 9 significant digits);
  `loss_f64`: the same formula evaluated in f64 from the f32 logits (differs by rounding only).
- `weight_sum`: sum of w over both sequences.
- `per_sequence`: for each sequence, `weighted_ce_sum` (sum of w * CE) and `weight_sum`; the loss is
  (sum of weighted_ce_sum) / (sum of weight_sum), not the mean of the per-sequence ratios
  (`mean_of_sequence_losses` is recorded to show the difference).
- `accuracy`: list for k = 1..B-1: over rows with w > 0 at block offset k (both sequences), the
  fraction whose argmax logit equals the label; null when there is none. `valid_rows`: their count
  per k. The drafter is untrained, so accuracies are near 0.
- `logits_rows`: the full drafter logits (256 floats) of sequence 0, anchor index 0, at block
  offsets 1 and 2 (each entry: `sequence`, `anchor_index`, `anchor`, `offset`, `position`, `label`,
  `logits`).
- `checks`: max |logit difference| of the multi-anchor masked forward against one forward per anchor
  without mask (package) and against the spec-equation drafter of make_fixtures.py, and
  whether two forwards were bit-identical; `min_label_vs_best_other_logit_gap`: over rows with
  w > 0, the smallest |label logit - best other logit| (so `accuracy` does not hinge on a near-tie).
- `versions`.

## `grads.safetensors`

d loss / d theta for every drafter parameter, f32, under the parameter's checkpoint name (the same
names and shapes as in `tests/fixtures/dflash/random/drafter/model.safetensors`: `fc.weight`,
`hidden_norm.weight`, `norm.weight`, `layers.{i}.input_layernorm.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.post_attention_layernorm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`).
`expected.json` also records each gradient's L2 norm under `grad_norms`.
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", type=Path, default=DEFAULT_CASE,
                        help="directory with target/ and drafter/ (default: the random case)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--allow-unpinned", action="store_true")
    args = parser.parse_args()

    found = mf.versions()
    mismatched = {k: (v, found[k]) for k, v in mf.PINNED.items() if found[k].split("+")[0] != v}
    if mismatched and not args.allow_unpinned:
        sys.exit(f"pinned versions required (want, have): {mismatched}")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    case_dir = args.case.resolve()
    target, drafter = mf.load_models(case_dir)
    for p in target.parameters():
        p.requires_grad_(False)
    block, mask_id = drafter.block_size, drafter.mask_token_id
    layer_ids = list(drafter.target_layer_ids)
    assert (block, mask_id, layer_ids) == (8, 255, [1, 2]), (block, mask_id, layer_ids)
    vocab = target.config.vocab_size

    sequences = build_batch(target, block, mask_id)

    def forward():
        return [sequence_rows(drafter, target, s, block, mask_id, layer_ids, GAMMA)
                for s in sequences]

    # Determinism: two forwards give bit-identical logits.
    with torch.no_grad():
        first = forward()
    drafter.zero_grad(set_to_none=True)
    rows = forward()
    deterministic = all(torch.equal(a[0], b[0].detach()) for a, b in zip(first, rows))
    assert deterministic, "two forwards differ"

    loss = pooled_loss(rows)
    loss.backward()
    grads = {name: p.grad.detach().float().contiguous().clone()
             for name, p in drafter.named_parameters()}

    # Gradient names and shapes are the checkpoint's.
    ckpt = load_file(str(case_dir / "drafter" / "model.safetensors"))
    assert sorted(grads) == sorted(ckpt), (sorted(grads), sorted(ckpt))
    assert all(grads[k].shape == ckpt[k].shape for k in grads)
    assert all(torch.isfinite(g).all() for g in grads.values())

    # Pooling: sequence by sequence sums give the same loss.
    per_sequence, num, den, seq_losses = [], 0.0, 0.0, []
    with torch.no_grad():
        for logits, labels, weights, _, _ in rows:
            ce = F.cross_entropy(logits.double(), labels, reduction="none")
            wce, w = (ce * weights.double()).sum().item(), weights.double().sum().item()
            per_sequence.append({"weighted_ce_sum": wce, "weight_sum": w})
            num, den = num + wce, den + w
            seq_losses.append(wce / w)
    loss_f64 = num / den
    assert abs(loss_f64 - loss.item()) < 1e-5 * max(1.0, abs(loss_f64)), (loss_f64, loss.item())
    mean_of_seq = sum(seq_losses) / len(seq_losses)

    # The mask semantics: per-anchor forwards (package, no mask) and the spec equations agree.
    worst_single, worst_spec = 0.0, 0.0
    for seq, (logits, _, _, _, feats) in zip(sequences, rows):
        a, b = per_anchor_check(drafter, target, seq, feats, logits.detach(), block, mask_id,
                                layer_ids, case_dir)
        worst_single, worst_spec = max(worst_single, a), max(worst_spec, b)
    assert worst_single < 1e-5 and worst_spec < 1e-5, (worst_single, worst_spec)

    # Accuracy per block offset.
    accuracy, valid_rows = [], []
    with torch.no_grad():
        logits = torch.cat([r[0] for r in rows])
        labels = torch.cat([r[1] for r in rows])
        weights = torch.cat([r[2] for r in rows])
        offsets = torch.cat([r[3] for r in rows])
        hit = logits.argmax(-1) == labels
        # The argmax test must not hinge on a near-tie: gap between the label's logit and the best
        # other logit, over rows that count.
        label_logit = logits.gather(1, labels[:, None])[:, 0]
        others = logits.scatter(1, labels[:, None], float("-inf")).max(-1).values
        label_gap = (label_logit - others).abs()[weights > 0].min().item()
        assert label_gap > mf.MIN_ARGMAX_MARGIN, label_gap
        for k in range(1, block):
            valid = (offsets == k) & (weights > 0)
            n = int(valid.sum())
            valid_rows.append(n)
            accuracy.append(None if n == 0 else hit[valid].float().mean().item())
    weight_sum = weights.sum().item()

    s0 = sequences[0]
    p0 = s0["anchors"][0]
    logits_rows = [{"sequence": 0, "anchor_index": 0, "anchor": p0, "offset": k,
                    "position": p0 + k, "label": s0["tokens"][p0 + k],
                    "logits": [f32(x) for x in rows[0][0][k].tolist()]}
                   for k in (1, 2)]
    assert all(len(r["logits"]) == vocab for r in logits_rows)

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    mf.write_json(out / "batch.json", {
        "sequences": sequences,
        "gamma": GAMMA,
        "block_size": block,
        "mask_token_id": mask_id,
        "target_layer_ids": layer_ids,
        "models": "tests/fixtures/dflash/random/{target,drafter}",
        "seed": BATCH_SEED,
    })
    mf.write_json(out / "expected.json", {
        "loss": f32(loss.item()),
        "loss_f64": loss_f64,
        "weight_sum": weight_sum,
        "per_sequence": per_sequence,
        "mean_of_sequence_losses": mean_of_seq,
        "accuracy": accuracy,
        "valid_rows": valid_rows,
        "logits_rows": logits_rows,
        "grad_norms": {k: f32(v.norm().item()) for k, v in sorted(grads.items())},
        "checks": {
            "two_forwards_bit_identical": deterministic,
            "max_abs_diff_vs_per_anchor_forward": float(f"{worst_single:.3g}"),
            "max_abs_diff_vs_spec_equations": float(f"{worst_spec:.3g}"),
            "min_label_vs_best_other_logit_gap": float(f"{label_gap:.3g}"),
        },
        "versions": found,
    })
    save_file(grads, str(out / "grads.safetensors"), metadata={"format": "pt"})
    (out / "grads.safetensors").chmod(0o644)
    (out / "README.md").write_text(README)

    print(f"loss            {loss.item():.9g}  (f64 from f32 logits {loss_f64:.12g})")
    print(f"weight_sum      {weight_sum:.9g}  per sequence {[round(s['weight_sum'], 6) for s in per_sequence]}")
    print(f"mean of sequence losses (NOT the loss) {mean_of_seq:.9g}")
    print(f"valid_rows      {valid_rows}")
    print(f"accuracy        {accuracy}")
    print(f"anchors         {[s['anchors'] for s in sequences]}")
    print(f"min |label logit - best other logit| over weighted rows {label_gap:.3g}")
    print(f"masked vs per-anchor forward {worst_single:.2e}, vs spec equations {worst_spec:.2e}")
    total_grad = math.sqrt(sum(v.double().pow(2).sum().item() for v in grads.values()))
    print(f"grad L2 norm    {total_grad:.6g} over {len(grads)} tensors")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
