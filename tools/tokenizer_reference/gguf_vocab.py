#!/usr/bin/env python3
"""Builds the GGUF tokenizer metadata llama.cpp's converter would write for a real tokenizer file.

Standard library only, so `tests/tokenizer_vocabularies.rs` can run it on a fresh machine:

    python3 gguf_vocab.py FORMAT PATH PRE > vocab.json

FORMAT is `hf` (a Hugging Face tokenizer.json, or a .zip holding one), `tekken` (Mistral's
tiktoken-style tekken.json), `o200k` or `cl100k` (tiktoken's o200k_base / cl100k_base ranks as
a binary rank table). The output is one JSON object with the GGUF keys' values:
`tokens`, `token_type` (llama.cpp codes: 1 normal, 3 control, 4 user-defined, 5 unused),
`merges` ("left right" strings, byte-level alphabet) and `pre`.
"""
import base64
import io
import json
import struct
import sys
import zipfile

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# Mistral's default special tokens for tekken files that list none (version v3 and older),
# as mistral-common defines them; the rest of the first `default_num_special_tokens` ids are
# `<SPECIAL_{id}>`.
TEKKEN_V3_SPECIALS = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
]


def bytes_to_unicode():
    """GPT-2's byte → printable character table."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(keep)
    shifted = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(0x100 + shifted)
            shifted += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


BYTE_CHAR = bytes_to_unicode()


def byte_level(data: bytes) -> str:
    return "".join(BYTE_CHAR[b] for b in data)


def looks_special(text: str) -> bool:
    """The converter's `does_token_look_special`: added tokens that are control tokens
    even where tokenizer.json does not mark them special."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def read_tokenizer_json(path: str) -> dict:
    if path.endswith(".zip"):
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("tokenizer.json")]
            if len(names) != 1:
                raise SystemExit(f"{path}: expected one tokenizer.json inside, found {names}")
            return json.load(io.TextIOWrapper(archive.open(names[0]), encoding="utf-8"))
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def from_hf(path: str, pre: str) -> dict:
    """tokenizer.json → GGUF vocabulary, the way the converter's `get_vocab_base` does it."""
    doc = read_tokenizer_json(path)
    model = doc["model"]
    if model["type"] != "BPE":
        raise SystemExit(f"{path}: model type {model['type']} is not BPE")
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in doc.get("added_tokens", [])}
    n = max(list(by_id) + list(added)) + 1
    tokens, types = [], []
    for i in range(n):
        if i in added:
            text = added[i]["content"]
            special = added[i]["special"] or looks_special(text)
            tokens.append(text)
            types.append(CONTROL if special else USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"pre": pre, "tokens": tokens, "token_type": types, "merges": merges}


def bpe_parts(ranks: dict, token: bytes, max_rank: int) -> list:
    """tiktoken's merge loop on `token`, using only merges ranked below `max_rank`."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best is None or rank < best[1]):
                best = (i, rank)
        if best is None:
            return parts
        i = best[0]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def merges_from_ranks(ranks: dict) -> list:
    """Rebuilds BPE merges from tiktoken ranks: each multi-byte token is the merge of the two
    parts the merge loop leaves when stopped just before that token's own rank."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = bpe_parts(ranks, token, rank)
        if len(parts) != 2:
            raise SystemExit(f"rank {rank}: token {token!r} is not the merge of two tokens")
        merges.append(f"{byte_level(parts[0])} {byte_level(parts[1])}")
    return merges


def from_tekken(path: str, pre: str) -> dict:
    """tekken.json → GGUF vocabulary: the special tokens first (control), then the
    `default_vocab_size - num_special` best-ranked byte sequences, with rebuilt merges."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    config = doc["config"]
    n_special = config["default_num_special_tokens"]
    inner = config["default_vocab_size"] - n_special
    listed = [t["token_str"] for t in doc.get("special_tokens") or []]
    specials = listed or TEKKEN_V3_SPECIALS
    specials = specials + [f"<SPECIAL_{i}>" for i in range(len(specials), n_special)]
    ranked = sorted(doc["vocab"], key=lambda t: t["rank"])[:inner]
    ranks = {base64.b64decode(t["token_bytes"]): t["rank"] for t in ranked}
    tokens = specials + [byte_level(base64.b64decode(t["token_bytes"])) for t in ranked]
    types = [CONTROL] * n_special + [NORMAL] * len(ranked)
    return {"pre": pre, "tokens": tokens, "token_type": types, "merges": merges_from_ranks(ranks)}


# The special tokens of tiktoken's encodings (its definitions); ids between are unused.
TIKTOKEN_SPECIALS = {
    "o200k": {199999: "<|endoftext|>", 200018: "<|endofprompt|>"},
    "cl100k": {
        100257: "<|endoftext|>",
        100258: "<|fim_prefix|>",
        100259: "<|fim_middle|>",
        100260: "<|fim_suffix|>",
        100276: "<|endofprompt|>",
    },
}


def read_rank_table(path: str) -> dict:
    """A binary tiktoken rank table: u32 count, then per token u16 length, bytes, u32 rank
    (little-endian), the layout of the `o200k.vocab` shipped in the quicktok package."""
    with open(path, "rb") as f:
        data = f.read()
    (count,) = struct.unpack_from("<I", data, 0)
    offset, ranks = 4, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, offset)
        token = data[offset + 2 : offset + 2 + length]
        (rank,) = struct.unpack_from("<I", data, offset + 2 + length)
        offset += 6 + length
        ranks[token] = rank
    if offset != len(data) or sorted(ranks.values()) != list(range(count)):
        raise SystemExit(f"{path}: not a rank table (ranks must be 0..{count - 1}, file fully read)")
    return ranks


def from_rank_table(encoding: str, path: str, pre: str) -> dict:
    """A tiktoken encoding → GGUF vocabulary: ranks as ids, rebuilt merges, its special tokens."""
    ranks = read_rank_table(path)
    specials = TIKTOKEN_SPECIALS[encoding]
    n = max(specials) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [UNUSED] * n
    for token, rank in ranks.items():
        tokens[rank], types[rank] = byte_level(token), NORMAL
    for i, text in specials.items():
        tokens[i], types[i] = text, CONTROL
    return {"pre": pre, "tokens": tokens, "token_type": types, "merges": merges_from_ranks(ranks)}


def main() -> None:
    formats = {
        "hf": from_hf,
        "tekken": from_tekken,
        "o200k": lambda path, pre: from_rank_table("o200k", path, pre),
        "cl100k": lambda path, pre: from_rank_table("cl100k", path, pre),
    }
    if len(sys.argv) != 4 or sys.argv[1] not in formats:
        raise SystemExit(__doc__)
    fmt, path, pre = sys.argv[1:]
    vocab = formats[fmt](path, pre)
    json.dump(vocab, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
