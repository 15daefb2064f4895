//! Tokenizers built from GGUF metadata: byte-level BPE ("gpt2" model in GGUF terms) and
//! SentencePiece-style ("llama": Llama 2, Gemma; the algorithm is in [`super::gguf_spm`]).
//!
//! The vocabulary, merges or scores and token types come from the GGUF header. For BPE the
//! pre-tokenizer (the regexes that cut text into words before BPE) is chosen by
//! `tokenizer.ggml.pre` and mirrors llama.cpp's `llama-vocab.cpp`, so prompt token counts
//! match llama.cpp; BPE encoding runs through the `tokenizers` crate. Decoding is done
//! here, byte-exact, so that streaming detokenisation can reproduce it piece by piece.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior};

use super::gguf_spm::{SpmEncoder, SPACE_MARK};

/// GPT-2's word split (llama.cpp's `gpt-2`, `olmo`, `mpt`, ... expression).
const GPT2_WORD_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Every digit is its own word (applied before the GPT-2 split for StarCoder, SmolLM, ...).
const SINGLE_DIGIT_REGEX: &str = r"\p{N}";
/// Qwen2 word split; llama.cpp's case-insensitive-free rewrite of the tokenizer.json regex.
const QWEN2_WORD_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3 (and cl100k) word split, as in Llama 3's tokenizer.json: digit runs of at most three.
const LLAMA3_WORD_REGEX: &str = r#"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"#;
/// Mistral's tekken split (tekken.json `config.pattern`): words split at lower→upper case changes.
/// llama.cpp rewrites the `\p{Lu}`/`\p{Ll}` classes for its own regex engine; the
/// original is used here because the engine here supports it and it is what the model saw.
const TEKKEN_WORD_REGEX: &str = r#"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"#;
/// GPT-4o (o200k) split: tekken's case-aware words, plus contractions and three-digit runs.
const GPT4O_WORD_REGEX: &str = r#"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"#;
/// DeepSeek LLM (v1/v2): newlines, Latin/Greek/Cyrillic-ish letters, ASCII and full-width
/// punctuation, trailing whitespace, CJK/Hangul runs, then single digits; from its tokenizer.json.
const DEEPSEEK_LLM_REGEXES: &[&str] = &[
    r#"[\r\n]"#,
    r#"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"#,
    r#"\s?[!-/:-~！-／：-～‘-‟　-。]+"#,
    r#"\s+$"#,
    r#"[一-龥ࠀ-一가-퟿]+"#,
    SINGLE_DIGIT_REGEX,
];
/// DeepSeek Coder (v1): newlines, letter runs, punctuation runs, CJK/Hangul runs, single digits.
const DEEPSEEK_CODER_REGEXES: &[&str] =
    &[r#"[\r\n]"#, r#"\s?\p{L}+"#, r#"\s?\p{P}+"#, r#"[一-龥ࠀ-一가-퟿]+"#, SINGLE_DIGIT_REGEX];
/// DeepSeek V3 / R1: up to three digits, CJK/kana runs, then words with one leading symbol.
const DEEPSEEK_V3_REGEXES: &[&str] = &[
    r#"\p{N}{1,3}"#,
    r#"[一-龥぀-ゟ゠-ヿ]+"#,
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];
/// Falcon: punctuation runs, the GPT-2 split, then three-digit groups (llama.cpp's expressions).
const FALCON_REGEXES: &[&str] = &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2_WORD_REGEX, r"[0-9][0-9][0-9]"];
/// BLOOM / Poro / GPT-3 Finnish: anything up to whitespace or sentence punctuation.
const BLOOM_WORD_REGEX: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";
/// Seed-Coder: Qwen2's split without `\r\n` in punctuation runs.
const SEED_CODER_WORD_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Token texts llama.cpp treats as end-of-generation whatever the GGUF says.
const EOG_TOKEN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];
/// Fill-in-the-middle separators that also end generation in llama.cpp.
const FIM_EOG_TOKEN_TEXTS: &[&str] = &["<|fim_pad|>", "<|fim_repo|>", "<|repo_name|>", "<|file_sep|>"];
/// Texts llama.cpp uses to find the end-of-turn token when the GGUF has no `eot_token_id`.
const EOT_TOKEN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
];

/// The byte-level BPE pre-tokenizers this crate knows. Each stands for one entry of
/// [`PRE_TOKENIZERS`], which holds its `tokenizer.ggml.pre` names, regexes and flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// GPT-2's split (`gpt-2`, `olmo`, `mpt`, `phi-2`, `jais`, ...).
    Gpt2,
    /// Single digits, then GPT-2's split (`starcoder`, `command-r`, `smollm`, `refact`, ...).
    StarCoder,
    /// Qwen2's split with single digits (`qwen2`, `stablelm2`, `deepseek-r1-qwen`, ...).
    Qwen2,
    /// Llama 3's split, whole-word vocabulary lookup, BOS added (`llama-bpe`, `falcon3`, `pixtral`, ...).
    Llama3,
    /// Llama 3's split with plain merges and no BOS (`dbrx`, `smaug-bpe`).
    Dbrx,
    /// Mistral's tekken split, whole-word vocabulary lookup, BOS added (`tekken`).
    Tekken,
    /// GPT-4o's (o200k) split (`gpt-4o`, `llama4`, `minimax-m2`).
    Gpt4o,
    /// DeepSeek LLM v1/v2 (`deepseek-llm`).
    DeepseekLlm,
    /// DeepSeek Coder v1 (`deepseek-coder`).
    DeepseekCoder,
    /// DeepSeek V3 / R1 (`deepseek-v3`).
    DeepseekV3,
    /// Falcon 1 (`falcon`).
    Falcon,
    /// BLOOM-style splits at whitespace and sentence punctuation (`bloom`, `poro-chat`, `gpt3-finnish`).
    Bloom,
    /// BLOOM's split, then single digits (`viking`).
    Viking,
    /// Seed-Coder (`seed-coder`).
    SeedCoder,
}

/// What a pre-tokenizer does: the regexes that cut text into words, and llama.cpp's
/// per-pre-tokenizer flags.
pub struct PreTokenizerSpec {
    pub kind: PreTokenizerKind,
    /// `tokenizer.ggml.pre` values llama.cpp maps to this behaviour.
    pub names: &'static [&'static str],
    /// Applied one after another, each to the pieces the previous one produced; matches and
    /// the text between them both become pieces.
    pub regexes: &'static [&'static str],
    /// A word that is itself a vocabulary token becomes that token without merging, as
    /// tiktoken does (llama.cpp's `ignore_merges`).
    pub ignore_merges: bool,
    /// Whether BOS is added when the GGUF has no `tokenizer.ggml.add_bos_token`.
    pub add_bos_default: bool,
}

/// Every supported `tokenizer.ggml.pre` value, with what it does (llama.cpp's
/// `llama-vocab.cpp` name mapping; regexes as in the models' own tokenizer files).
pub const PRE_TOKENIZERS: &[PreTokenizerSpec] = {
    use PreTokenizerKind as K;
    &[
        PreTokenizerSpec {
            kind: K::Llama3,
            names: &[
                "llama3",
                "llama-v3",
                "llama-bpe",
                "falcon3",
                "falcon-h1",
                "pixtral",
                "midm-2.0",
                "lfm2",
                "jina-v5-nano",
            ],
            regexes: &[LLAMA3_WORD_REGEX],
            ignore_merges: true,
            add_bos_default: true,
        },
        PreTokenizerSpec {
            kind: K::Dbrx,
            names: &["dbrx", "smaug-bpe"],
            regexes: &[LLAMA3_WORD_REGEX],
            ignore_merges: false,
            add_bos_default: false,
        },
        PreTokenizerSpec {
            kind: K::Tekken,
            names: &["tekken"],
            regexes: &[TEKKEN_WORD_REGEX],
            ignore_merges: true,
            add_bos_default: true,
        },
        PreTokenizerSpec {
            kind: K::Gpt4o,
            names: &["gpt-4o", "llama4", "minimax-m2"],
            regexes: &[GPT4O_WORD_REGEX],
            ignore_merges: false,
            add_bos_default: false,
        },
        PreTokenizerSpec {
            kind: K::DeepseekLlm,
            names: &["deepseek-llm"],
            regexes: DEEPSEEK_LLM_REGEXES,
            ignore_merges: false,
            add_bos_default: false,
        },
        PreTokenizerSpec {
            kind: K::DeepseekCoder,
            names: &["deepseek-coder"],
            regexes: DEEPSEEK_CODER_REGEXES,
            ignore_merges: false,
            add_bos_default: false,
        },
        PreTokenizerSpec {
            kind: K::DeepseekV3,
            names: &["deepseek-v3", "hunyuan-dense"],
            regexes: DEEPSEEK_V3_REGEXES,
            ignore_merges: false,
            add_bos_default: false,
        },
        PreTokenizerSpec {
            kind: K::Qwen2,
            names: &["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"],
            regexes: &[QWEN2_WORD_REGEX],
            ignore_merges: false,
            add_bos_default: false,
        },
        PreTokenizerSpec {
            kind: K::StarCoder,
            names: &["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"],
            regexes: &[SINGLE_DIGIT_REGEX, GPT2_WORD_REGEX],
            ignore_merges: false,
            add_bos_default: false,
        },
        PreTokenizerSpec {
            kind: K::Gpt2,
            names: &[
                "gpt-2",
                "phi-2",
                "jina-es",
                "jina-de",
                "jina-v2-es",
                "jina-v2-de",
                "gigachat",
                "a.x-4.0",
                "mellum",
                "mpt",
                "olmo",
                "jais",
                "trillion",
                "granite-docling",
                "exaone4",
            ],
            regexes: &[GPT2_WORD_REGEX],
            ignore_merges: false,
            add_bos_default: false,
        },
        PreTokenizerSpec {
            kind: K::Falcon,
            names: &["falcon"],
            regexes: FALCON_REGEXES,
            ignore_merges: false,
            add_bos_default: false,
        },
        PreTokenizerSpec {
            kind: K::Bloom,
            names: &["bloom", "poro-chat", "gpt3-finnish"],
            regexes: &[BLOOM_WORD_REGEX],
            ignore_merges: false,
            add_bos_default: false,
        },
        PreTokenizerSpec {
            kind: K::Viking,
            names: &["viking"],
            regexes: &[BLOOM_WORD_REGEX, SINGLE_DIGIT_REGEX],
            ignore_merges: false,
            add_bos_default: false,
        },
        PreTokenizerSpec {
            kind: K::SeedCoder,
            names: &["seed-coder"],
            regexes: &[SEED_CODER_WORD_REGEX],
            ignore_merges: false,
            add_bos_default: false,
        },
    ]
};

impl PreTokenizerKind {
    /// Maps a `tokenizer.ggml.pre` value; `None` for anything not supported.
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        PreTokenizerSpec::find(name).map(|spec| spec.kind)
    }

    /// This pre-tokenizer's entry in [`PRE_TOKENIZERS`].
    pub fn spec(self) -> &'static PreTokenizerSpec {
        PRE_TOKENIZERS.iter().find(|spec| spec.kind == self).expect("every kind has a table entry")
    }

    /// Every supported `tokenizer.ggml.pre` value, in table order.
    pub fn supported_names() -> Vec<&'static str> {
        PRE_TOKENIZERS.iter().flat_map(|spec| spec.names.iter().copied()).collect()
    }

    /// The regex sequence as a `tokenizers` pre-tokenizer (no byte-level mapping).
    fn splits(self) -> Result<Vec<PreTokenizerWrapper>> {
        self.spec()
            .regexes
            .iter()
            .map(|regex| {
                Split::new(SplitPattern::Regex((*regex).to_string()), SplitDelimiterBehavior::Isolated, false)
                    .map(PreTokenizerWrapper::Split)
                    .map_err(|e| anyhow!("compiling pre-tokenizer regex `{regex}`: {e}"))
            })
            .collect()
    }

    /// The regex sequence alone, to see the words text is cut into before BPE.
    pub fn word_splitter(self) -> Result<WordSplitter> {
        Ok(WordSplitter(Sequence::new(self.splits()?)))
    }
}

/// A pre-tokenizer's regexes, compiled once (see [`PreTokenizerKind::word_splitter`]).
pub struct WordSplitter(Sequence);

impl WordSplitter {
    /// The words `text` is cut into before BPE, as text (special tokens are not looked for here).
    pub fn split(&self, text: &str) -> Result<Vec<String>> {
        let mut pretokenized = PreTokenizedString::from(text);
        self.0.pre_tokenize(&mut pretokenized).map_err(|e| anyhow!("pre-tokenizing: {e}"))?;
        Ok(pretokenized
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(word, _, _)| word.to_string())
            .collect())
    }
}

impl PreTokenizerSpec {
    fn find(name: &str) -> Option<&'static Self> {
        PRE_TOKENIZERS.iter().find(|spec| spec.names.contains(&name))
    }
}

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenKind {
    fn from_gguf(code: i64) -> Result<Self> {
        Ok(match code {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            other => bail!("unknown tokenizer.ggml.token_type value {other}"),
        })
    }

    /// Matched whole in input text instead of going through BPE (llama.cpp's special cache).
    fn is_matched_whole(self) -> bool {
        matches!(self, Self::Control | Self::UserDefined | Self::Unknown)
    }

    /// Dropped from output when decoding with `skip_special`.
    fn is_skippable(self) -> bool {
        matches!(self, Self::Control | Self::Unknown)
    }
}

/// How text becomes ids.
enum Encoder {
    Bpe(Box<tokenizers::Tokenizer>),
    Spm(Box<SpmEncoder>),
}

/// The tokenizer model a GGUF names in `tokenizer.ggml.model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabModel {
    /// `gpt2`: byte-level BPE.
    Bpe,
    /// `llama`: SentencePiece-style merges by score, with byte fallback.
    Spm,
}

/// A tokenizer read from a GGUF file.
pub struct Tokenizer {
    encoder: Encoder,
    /// The BPE pre-tokenizer; `None` for SentencePiece vocabularies, which have none.
    pre: Option<PreTokenizerKind>,
    /// Token texts as stored in the GGUF (byte-level alphabet for normal tokens).
    texts: Vec<String>,
    kinds: Vec<TokenKind>,
    /// What each token decodes to, as raw bytes (may be part of a UTF-8 character).
    pieces: Vec<Vec<u8>>,
    text_to_id: HashMap<String, u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    /// End-of-generation ids, sorted, no duplicates.
    stop_ids: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("pre", &self.pre)
            .field("vocab_size", &self.texts.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eot", &self.eot)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .field("stop_ids", &self.stop_ids)
            .finish()
    }
}

/// Vocabulary-level metadata shared by the tokenizer and the chat template.
pub(crate) struct GgufVocab {
    pub model: VocabModel,
    pub texts: Vec<String>,
    /// Merge priorities (SentencePiece vocabularies; empty for BPE).
    pub scores: Vec<f32>,
    pub kinds: Vec<TokenKind>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
}

impl GgufVocab {
    pub(crate) fn read(content: &Content) -> Result<Self> {
        let model = match metadata_string(content, "tokenizer.ggml.model")?.as_str() {
            "gpt2" => VocabModel::Bpe,
            "llama" => VocabModel::Spm,
            other => bail!(
                "unsupported tokenizer model `{other}` in tokenizer.ggml.model: supported are byte-level \
                 BPE (`gpt2`) and SentencePiece-style (`llama`)"
            ),
        };
        let texts = string_array(content, "tokenizer.ggml.tokens")?;
        if texts.is_empty() {
            bail!("tokenizer.ggml.tokens is empty");
        }
        if u32::try_from(texts.len()).is_err() {
            bail!("tokenizer.ggml.tokens has {} entries, more than u32 ids allow", texts.len());
        }
        let kinds = match content.metadata.get("tokenizer.ggml.token_type") {
            None => vec![TokenKind::Normal; texts.len()],
            Some(value) => {
                let codes = value.to_vec().map_err(|e| anyhow!("tokenizer.ggml.token_type is not an array: {e}"))?;
                if codes.len() != texts.len() {
                    bail!(
                        "tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
                        codes.len(),
                        texts.len()
                    );
                }
                codes
                    .iter()
                    .map(|v| integer(v).and_then(TokenKind::from_gguf))
                    .collect::<Result<Vec<_>>>()
                    .context("reading tokenizer.ggml.token_type")?
            }
        };
        let scores = match (model, content.metadata.get("tokenizer.ggml.scores")) {
            (VocabModel::Bpe, _) => Vec::new(),
            (VocabModel::Spm, None) => vec![0.0; texts.len()],
            (VocabModel::Spm, Some(value)) => {
                let values = value.to_vec().map_err(|e| anyhow!("tokenizer.ggml.scores is not an array: {e}"))?;
                if values.len() != texts.len() {
                    bail!(
                        "tokenizer.ggml.scores has {} entries but tokenizer.ggml.tokens has {}",
                        values.len(),
                        texts.len()
                    );
                }
                values
                    .iter()
                    .map(|v| match v {
                        Value::F32(x) => Ok(*x),
                        Value::F64(x) => Ok(*x as f32),
                        other => Err(anyhow!("tokenizer.ggml.scores holds {other:?}, not floats")),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
        };
        let n_tokens = texts.len() as u32;
        let token_id = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
            let id = match content.metadata.get(key) {
                Some(v) => Some(
                    u32::try_from(integer(v).with_context(|| format!("reading {key}"))?)
                        .map_err(|_| anyhow!("{key} is negative"))?,
                ),
                None => default,
            };
            match id {
                Some(id) if id >= n_tokens => {
                    bail!("{key} = {id} is outside the vocabulary of {n_tokens} tokens")
                }
                other => Ok(other),
            }
        };
        // llama.cpp's defaults when the keys are absent: gpt2 vocabularies use id 11 for
        // both and add no BOS; SentencePiece ones use 1 and 2 and add BOS.
        // Llama 3 and tekken vocabularies add BOS by default; the GGUF key overrides it.
        let bpe_adds_bos = match model {
            VocabModel::Bpe => metadata_opt_string(content, "tokenizer.ggml.pre")?
                .and_then(|name| PreTokenizerSpec::find(&name))
                .is_some_and(|spec| spec.add_bos_default),
            VocabModel::Spm => true,
        };
        let (bos_default, eos_default, add_bos_default) = match model {
            VocabModel::Bpe => (11, 11, bpe_adds_bos),
            VocabModel::Spm => (1, 2, true),
        };
        let bos = token_id("tokenizer.ggml.bos_token_id", Some(bos_default).filter(|&id| id < n_tokens))?;
        let eos = token_id("tokenizer.ggml.eos_token_id", Some(eos_default).filter(|&id| id < n_tokens))?;
        let add_bos = metadata_bool(content, "tokenizer.ggml.add_bos_token")?.unwrap_or(add_bos_default);
        let add_eos = metadata_bool(content, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        if add_bos && bos.is_none() {
            bail!("tokenizer.ggml.add_bos_token is set but the GGUF has no BOS token");
        }
        if add_eos && eos.is_none() {
            bail!("tokenizer.ggml.add_eos_token is set but the GGUF has no EOS token");
        }
        Ok(Self { model, texts, scores, kinds, bos, eos, add_bos, add_eos })
    }

    /// Text → id; a text stored twice maps to its last id, as in llama.cpp.
    pub(crate) fn text_to_id(&self) -> HashMap<String, u32> {
        self.texts.iter().enumerate().map(|(id, text)| (text.clone(), id as u32)).collect()
    }

    /// The text a token stands for, the way llama.cpp renders it with `special = true`.
    pub(crate) fn rendered_text(&self, id: u32) -> String {
        let bytes = piece_bytes(self.model, &self.texts[id as usize], self.kinds[id as usize]);
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF header.
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let vocab = GgufVocab::read(content)?;
        let text_to_id = vocab.text_to_id();
        // llama.cpp forces these to control tokens even if the GGUF says otherwise.
        let mut kinds = vocab.kinds.clone();
        for &text in EOG_TOKEN_TEXTS.iter().chain(FIM_EOG_TOKEN_TEXTS) {
            if let Some(&id) = text_to_id.get(text) {
                kinds[id as usize] = TokenKind::Control;
            }
        }
        let (encoder, pre) = match vocab.model {
            VocabModel::Bpe => {
                let (encoder, pre) = Self::bpe_encoder(content, &vocab, &text_to_id, &kinds)?;
                (Encoder::Bpe(Box::new(encoder)), Some(pre))
            }
            VocabModel::Spm => {
                let unk = match content.metadata.get("tokenizer.ggml.unknown_token_id") {
                    Some(v) => u32::try_from(integer(v).context("reading tokenizer.ggml.unknown_token_id")?)
                        .ok()
                        .filter(|&id| (id as usize) < vocab.texts.len()),
                    None => Some(0).filter(|_| !vocab.texts.is_empty()),
                };
                let add_space_prefix = metadata_bool(content, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
                let whole = |id: u32| kinds[id as usize].is_matched_whole();
                let spm = SpmEncoder::new(&vocab.texts, vocab.scores.clone(), whole, unk, add_space_prefix);
                (Encoder::Spm(Box::new(spm)), None)
            }
        };
        Self::finish(content, vocab, text_to_id, kinds, encoder, pre)
    }

    /// The byte-level BPE encoder: merges, the pre-tokenizer named by the GGUF, and the
    /// tokens matched whole.
    fn bpe_encoder(
        content: &Content,
        vocab: &GgufVocab,
        text_to_id: &HashMap<String, u32>,
        kinds: &[TokenKind],
    ) -> Result<(tokenizers::Tokenizer, PreTokenizerKind)> {
        let pre_name = metadata_string(content, "tokenizer.ggml.pre")
            .context("the GGUF names no pre-tokenizer (tokenizer.ggml.pre); refusing to guess one")?;
        let pre = PreTokenizerKind::from_gguf_name(&pre_name).ok_or_else(|| {
            anyhow!(
                "unsupported pre-tokenizer `{pre_name}` (tokenizer.ggml.pre); supported: {}",
                PreTokenizerKind::supported_names().join(", ")
            )
        })?;
        let merges = string_array(content, "tokenizer.ggml.merges")?
            .into_iter()
            .map(|merge| {
                // llama.cpp splits at the first space after the first byte (a space byte is
                // never inside a multi-byte character, so both halves are valid UTF-8).
                let space = merge.as_bytes().iter().skip(1).position(|&b| b == b' ');
                match space.map(|pos| pos + 1) {
                    Some(pos) => Ok((merge[..pos].to_string(), merge[pos + 1..].to_string())),
                    None => Err(anyhow!("malformed BPE merge `{merge}` (no separating space)")),
                }
            })
            .collect::<Result<Vec<_>>>()?;

        let bpe_vocab: Vocab = text_to_id.iter().map(|(t, &id)| (t.clone(), id)).collect();
        let bpe = BPE::builder()
            .vocab_and_merges(bpe_vocab, merges)
            .ignore_merges(pre.spec().ignore_merges)
            .build()
            .map_err(|e| anyhow!("building the BPE model from GGUF vocab and merges: {e}"))?;

        let mut encoder = tokenizers::Tokenizer::new(bpe);
        let mut pre_tokenizers = pre.splits()?;
        // Words are already split; ByteLevel only maps bytes to the byte-level alphabet.
        pre_tokenizers.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)));
        encoder.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(pre_tokenizers))));

        // Control / user-defined / unknown tokens are matched whole in text (parse_special).
        let whole_tokens: Vec<AddedToken> = vocab
            .texts
            .iter()
            .zip(kinds)
            .filter(|(text, kind)| kind.is_matched_whole() && !text.is_empty())
            .map(|(text, kind)| AddedToken::from(text.clone(), *kind != TokenKind::UserDefined).normalized(false))
            .collect();
        encoder
            .add_special_tokens(whole_tokens.iter().filter(|t| t.special).cloned())
            .map_err(|e| anyhow!("registering control tokens: {e}"))?;
        encoder
            .add_tokens(whole_tokens.iter().filter(|t| !t.special).cloned())
            .map_err(|e| anyhow!("registering user-defined tokens: {e}"))?;
        Ok((encoder, pre))
    }

    /// The parts every vocabulary shares: end-of-turn and stop ids, decoded pieces.
    fn finish(
        content: &Content,
        vocab: GgufVocab,
        text_to_id: HashMap<String, u32>,
        kinds: Vec<TokenKind>,
        encoder: Encoder,
        pre: Option<PreTokenizerKind>,
    ) -> Result<Self> {
        let eot = match content.metadata.get("tokenizer.ggml.eot_token_id") {
            Some(v) => Some(
                u32::try_from(integer(v).context("reading tokenizer.ggml.eot_token_id")?)
                    .ok()
                    .filter(|&id| (id as usize) < vocab.texts.len())
                    .ok_or_else(|| anyhow!("tokenizer.ggml.eot_token_id is out of range"))?,
            ),
            // First match in list order, so ChatML models get `<|im_end|>`, not `<|endoftext|>`.
            None => EOT_TOKEN_TEXTS.iter().find_map(|t| text_to_id.get(*t).copied()),
        };
        let mut stop_ids: Vec<u32> = EOG_TOKEN_TEXTS
            .iter()
            .chain(FIM_EOG_TOKEN_TEXTS)
            .filter_map(|t| text_to_id.get(*t).copied())
            .chain(vocab.eos)
            .chain(eot)
            .collect();
        for key in [
            "tokenizer.ggml.eom_token_id",
            "tokenizer.ggml.fim_pad_token_id",
            "tokenizer.ggml.fim_rep_token_id",
            "tokenizer.ggml.fim_sep_token_id",
        ] {
            if let Some(v) = content.metadata.get(key) {
                let id = integer(v).with_context(|| format!("reading {key}"))?;
                if let Some(id) = u32::try_from(id).ok().filter(|&id| (id as usize) < kinds.len()) {
                    stop_ids.push(id);
                }
            }
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();

        let pieces = vocab.texts.iter().zip(&kinds).map(|(text, &kind)| piece_bytes(vocab.model, text, kind)).collect();
        Ok(Self {
            encoder,
            pre,
            texts: vocab.texts,
            kinds,
            pieces,
            text_to_id,
            bos: vocab.bos,
            eos: vocab.eos,
            eot,
            add_bos: vocab.add_bos,
            add_eos: vocab.add_eos,
            stop_ids,
        })
    }

    /// Reads only the GGUF header of `path` (metadata and tensor infos) and builds the tokenizer.
    pub fn from_gguf_file(path: &Path) -> Result<Self> {
        let content = read_gguf_header(path)?;
        Self::from_gguf(&content)
    }

    /// Text → token ids. Special tokens written in the text (`<|im_start|>`) become single
    /// tokens. With `add_special`, BOS/EOS are added when the GGUF asks for them.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let body = match &self.encoder {
            Encoder::Bpe(bpe) => {
                bpe.encode_fast(text, false).map_err(|e| anyhow!("tokenizing text: {e}"))?.get_ids().to_vec()
            }
            Encoder::Spm(spm) => spm.encode(text),
        };
        let mut ids = Vec::with_capacity(body.len() + 2);
        if add_special && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(&body);
        if add_special && self.add_eos {
            ids.extend(self.eos);
        }
        Ok(ids)
    }

    /// Token ids → text. Control tokens are left out with `skip_special`. Byte sequences that
    /// are not valid UTF-8 (a cut-off multi-byte character) come out as U+FFFD.
    /// Ids outside the vocabulary decode to nothing.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.piece(id, skip_special));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The raw bytes one token contributes to decoded text (may be part of a character).
    pub fn piece(&self, id: u32, skip_special: bool) -> &[u8] {
        match (self.pieces.get(id as usize), self.kinds.get(id as usize)) {
            (Some(_), Some(kind)) if skip_special && kind.is_skippable() => &[],
            (Some(bytes), _) => bytes,
            _ => &[],
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }

    /// A control token (`<|im_end|>`, `<bos>`): matched whole, left out of text by `decode`
    /// with `skip_special`.
    pub fn is_control(&self, id: u32) -> bool {
        self.kinds.get(id as usize).is_some_and(|k| k.is_skippable())
    }

    /// The token's text as stored in the GGUF (byte-level alphabet, e.g. `Ġthe`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }

    /// The id of a token given its GGUF text (e.g. `<|im_end|>`, `Ġthe`).
    pub fn id_of(&self, text: &str) -> Option<u32> {
        self.text_to_id.get(text).copied()
    }

    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-turn token (`tokenizer.ggml.eot_token_id`, else found by text like `<|im_end|>`).
    pub fn eot_id(&self) -> Option<u32> {
        self.eot
    }

    /// Every id that ends generation (EOS, EOT, `<|im_end|>`, `<|endoftext|>`, ...), sorted.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_ids.binary_search(&id).is_ok()
    }

    /// Whether `encode(.., add_special = true)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// The BPE pre-tokenizer; `None` for SentencePiece vocabularies.
    pub fn pre_tokenizer(&self) -> Option<PreTokenizerKind> {
        self.pre
    }
}

/// Reads a GGUF header (metadata and tensor infos, no tensor data).
pub fn read_gguf_header(path: &Path) -> Result<Content> {
    let mut file = std::fs::File::open(path).with_context(|| format!("opening GGUF file {}", path.display()))?;
    Content::read(&mut file).with_context(|| format!("reading GGUF header of {}", path.display()))
}

/// What a token decodes to: the raw text for special tokens, byte-level-decoded bytes for
/// normal ones, nothing for unused ones (llama.cpp's `token_to_piece` with special = true).
/// SentencePiece vocabularies: `▁` is a space, `<0xXX>` byte tokens their byte, unknown `▅`.
fn piece_bytes(model: VocabModel, text: &str, kind: TokenKind) -> Vec<u8> {
    if model == VocabModel::Spm {
        return match kind {
            TokenKind::Normal | TokenKind::UserDefined => text.replace(SPACE_MARK, " ").into_bytes(),
            TokenKind::Byte => text
                .strip_prefix("<0x")
                .and_then(|h| h.strip_suffix('>'))
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .map(|b| vec![b])
                .unwrap_or_default(),
            TokenKind::Unknown => "\u{2585}".as_bytes().to_vec(),
            TokenKind::Control => text.as_bytes().to_vec(),
            TokenKind::Unused => Vec::new(),
        };
    }
    match kind {
        TokenKind::Normal => {
            let mut bytes = Vec::with_capacity(text.len());
            for ch in text.chars() {
                match byte_of_char(ch) {
                    Some(b) => bytes.push(b),
                    // Not in the byte alphabet: keep the character itself.
                    None => bytes.extend_from_slice(ch.encode_utf8(&mut [0u8; 4]).as_bytes()),
                }
            }
            bytes
        }
        TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown => text.as_bytes().to_vec(),
        TokenKind::Unused | TokenKind::Byte => Vec::new(),
    }
}

/// GPT-2's `bytes_to_unicode` keeps printable Latin-1 bytes as themselves.
const fn byte_stands_for_itself(b: u32) -> bool {
    (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)
}

/// The other 68 bytes, in byte order; they were shifted to U+0100, U+0101, ...
const SHIFTED_BYTES: [u8; 68] = {
    let mut out = [0u8; 68];
    let mut n = 0;
    let mut b = 0u32;
    while b < 256 {
        if !byte_stands_for_itself(b) {
            out[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    out
};

/// Inverse of GPT-2's `bytes_to_unicode`.
fn byte_of_char(ch: char) -> Option<u8> {
    let c = ch as u32;
    if c < 0x100 {
        return byte_stands_for_itself(c).then_some(c as u8);
    }
    SHIFTED_BYTES.get((c - 0x100) as usize).copied()
}

fn metadata_string(content: &Content, key: &str) -> Result<String> {
    let value = content.metadata.get(key).ok_or_else(|| anyhow!("GGUF metadata has no `{key}`"))?;
    value.to_string().cloned().map_err(|e| anyhow!("GGUF metadata `{key}` is not a string: {e}"))
}

fn metadata_bool(content: &Content, key: &str) -> Result<Option<bool>> {
    content
        .metadata
        .get(key)
        .map(|v| v.to_bool().map_err(|e| anyhow!("GGUF metadata `{key}` is not a bool: {e}")))
        .transpose()
}

pub(crate) fn metadata_opt_string(content: &Content, key: &str) -> Result<Option<String>> {
    content
        .metadata
        .get(key)
        .map(|v| v.to_string().cloned().map_err(|e| anyhow!("GGUF metadata `{key}` is not a string: {e}")))
        .transpose()
}

fn string_array(content: &Content, key: &str) -> Result<Vec<String>> {
    let values = content
        .metadata
        .get(key)
        .ok_or_else(|| anyhow!("GGUF metadata has no `{key}`"))?
        .to_vec()
        .map_err(|e| anyhow!("GGUF metadata `{key}` is not an array: {e}"))?;
    values
        .iter()
        .enumerate()
        .map(|(i, v)| v.to_string().cloned().map_err(|e| anyhow!("GGUF metadata `{key}`[{i}] is not a string: {e}")))
        .collect()
}

fn integer(value: &Value) -> Result<i64> {
    Ok(match value {
        Value::U8(v) => i64::from(*v),
        Value::I8(v) => i64::from(*v),
        Value::U16(v) => i64::from(*v),
        Value::I16(v) => i64::from(*v),
        Value::U32(v) => i64::from(*v),
        Value::I32(v) => i64::from(*v),
        Value::U64(v) => i64::try_from(*v).map_err(|_| anyhow!("integer {v} too large"))?,
        Value::I64(v) => *v,
        other => bail!("expected an integer, found {other:?}"),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::tokenize::test_models::{self, ROUND_TRIP_TEXTS};
    use candle_core::quantized::gguf_file::VersionedMagic;

    fn char_of_byte(b: u8) -> char {
        if byte_stands_for_itself(u32::from(b)) {
            char::from(b)
        } else {
            let index = SHIFTED_BYTES.iter().position(|&s| s == b).expect("shifted byte");
            char::from_u32(0x100 + index as u32).expect("valid char")
        }
    }

    /// A tiny byte-level vocabulary: the 256 byte tokens, a few merges, and special tokens.
    pub(crate) fn toy_content(model: &str, pre: Option<&str>, chat_template: Option<&str>) -> Content {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| char_of_byte(b).to_string()).collect();
        let mut types = vec![1i32; tokens.len()];
        let merges = ["h e", "l l", "he ll", "hell o", "! h", "!h i", "2 0", "Ġ w", "Ġw o", "Ã ©"];
        for merge in merges {
            tokens.push(merge.replace(' ', ""));
            types.push(1);
        }
        for (text, kind) in [("<|im_start|>", 3), ("<|im_end|>", 3), ("<|endoftext|>", 3), ("<tool>", 4)] {
            tokens.push(text.to_string());
            types.push(kind);
        }
        let id_of = |t: &str| tokens.iter().position(|x| x == t).expect("toy token") as u32;
        let mut metadata = HashMap::new();
        metadata.insert("tokenizer.ggml.model".into(), Value::String(model.into()));
        if let Some(pre) = pre {
            metadata.insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
        }
        if let Some(template) = chat_template {
            metadata.insert("tokenizer.chat_template".into(), Value::String(template.into()));
        }
        metadata.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(id_of("<|im_start|>")));
        metadata.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(id_of("<|im_end|>")));
        metadata.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
        metadata.insert(
            "tokenizer.ggml.merges".into(),
            Value::Array(merges.iter().map(|m| Value::String((*m).into())).collect()),
        );
        metadata.insert("tokenizer.ggml.token_type".into(), Value::Array(types.into_iter().map(Value::I32).collect()));
        metadata.insert("tokenizer.ggml.tokens".into(), Value::Array(tokens.into_iter().map(Value::String).collect()));
        Content { magic: VersionedMagic::GgufV3, metadata, tensor_infos: HashMap::new(), tensor_data_offset: 0 }
    }

    fn texts(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&id| tok.token_text(id).unwrap_or("?").to_string()).collect()
    }

    #[test]
    fn refuses_unknown_pre_tokenizer_and_model() {
        let err = Tokenizer::from_gguf(&toy_content("gpt2", Some("not-a-pre-tokenizer"), None)).unwrap_err();
        let message = err.to_string();
        assert!(message.contains("unsupported pre-tokenizer `not-a-pre-tokenizer`"), "{message}");
        // The message lists every supported name, straight from the table.
        for name in PreTokenizerKind::supported_names() {
            assert!(message.contains(name), "{name} missing from: {message}");
        }
        assert!(message.contains("llama-bpe") && message.contains("tekken") && message.contains("gpt-4o"));
        let err = Tokenizer::from_gguf(&toy_content("gpt2", None, None)).unwrap_err();
        assert!(format!("{err:#}").contains("tokenizer.ggml.pre"), "{err:#}");
        let err = Tokenizer::from_gguf(&toy_content("t5", Some("smollm"), None)).unwrap_err();
        assert!(err.to_string().contains("unsupported tokenizer model `t5`"), "{err}");
    }

    #[test]
    fn every_table_name_is_unique_and_every_regex_compiles() {
        let names = PreTokenizerKind::supported_names();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len(), "a name appears twice in PRE_TOKENIZERS");
        for spec in PRE_TOKENIZERS {
            assert_eq!(spec.kind.spec().names, spec.names, "{:?} has two table entries", spec.kind);
            for name in spec.names {
                assert_eq!(PreTokenizerKind::from_gguf_name(name), Some(spec.kind));
                Tokenizer::from_gguf(&toy_content("gpt2", Some(name), None)).unwrap();
            }
        }
    }

    #[test]
    fn llama3_and_tekken_add_bos_unless_the_gguf_says_otherwise() {
        let mut content = toy_content("gpt2", Some("llama-bpe"), None);
        content.metadata.remove("tokenizer.ggml.add_bos_token");
        assert!(Tokenizer::from_gguf(&content).unwrap().add_bos());
        content.metadata.insert("tokenizer.ggml.pre".into(), Value::String("tekken".into()));
        assert!(Tokenizer::from_gguf(&content).unwrap().add_bos());
        content.metadata.insert("tokenizer.ggml.pre".into(), Value::String("gpt-4o".into()));
        assert!(!Tokenizer::from_gguf(&content).unwrap().add_bos());
        content.metadata.insert("tokenizer.ggml.pre".into(), Value::String("llama-bpe".into()));
        content.metadata.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
        assert!(!Tokenizer::from_gguf(&content).unwrap().add_bos());
    }

    #[test]
    fn ignore_merges_takes_a_whole_word_token_the_merges_cannot_reach() {
        // "hi" is a vocabulary token but no merge builds it ("!h"+"i" and "h"+"e" exist, "h i"
        // does not): Llama 3 takes it whole, GPT-2-style vocabularies spell it out.
        let mut content = toy_content("gpt2", Some("llama-bpe"), None);
        let Some(Value::Array(tokens)) = content.metadata.get_mut("tokenizer.ggml.tokens") else { unreachable!() };
        tokens.push(Value::String("hi".into()));
        let Some(Value::Array(types)) = content.metadata.get_mut("tokenizer.ggml.token_type") else { unreachable!() };
        types.push(Value::I32(1));
        let llama3 = Tokenizer::from_gguf(&content).unwrap();
        assert_eq!(texts(&llama3, &llama3.encode("hi", false).unwrap()), ["hi"]);
        content.metadata.insert("tokenizer.ggml.pre".into(), Value::String("dbrx".into()));
        let dbrx = Tokenizer::from_gguf(&content).unwrap();
        assert_eq!(texts(&dbrx, &dbrx.encode("hi", false).unwrap()), ["h", "i"]);
    }

    #[test]
    fn bad_merges_are_errors_not_panics() {
        let mut content = toy_content("gpt2", Some("llama-bpe"), None);
        content.metadata.insert("tokenizer.ggml.merges".into(), Value::Array(vec![Value::String("nospace".into())]));
        let err = Tokenizer::from_gguf(&content).unwrap_err();
        assert!(err.to_string().contains("malformed BPE merge"), "{err}");
        content.metadata.insert("tokenizer.ggml.merges".into(), Value::Array(vec![Value::String("q \u{2603}".into())]));
        let err = Tokenizer::from_gguf(&content).unwrap_err();
        assert!(format!("{err:#}").contains("BPE model"), "{err:#}");
    }

    #[test]
    fn case_aware_splits_cut_at_lower_to_upper_changes() {
        let words = PreTokenizerKind::Tekken.word_splitter().unwrap().split("helloWorld HTTPServer 2024").unwrap();
        assert_eq!(words, ["hello", "World", " HTTPServer", " ", "2", "0", "2", "4"]);
        let words = PreTokenizerKind::Gpt4o.word_splitter().unwrap().split("I'LL say 12345").unwrap();
        assert_eq!(words, ["I'LL", " say", " ", "123", "45"]);
        let words = PreTokenizerKind::Llama3.word_splitter().unwrap().split("I'LL say 12345").unwrap();
        assert_eq!(words, ["I", "'LL", " say", " ", "123", "45"]);
    }

    #[test]
    fn smollm_isolates_digits_and_splits_punctuation_from_letters() {
        let tok = Tokenizer::from_gguf(&toy_content("gpt2", Some("smollm"), None)).unwrap();
        // "2 0" is a merge, but SmolLM isolates every digit before BPE.
        let ids = tok.encode("2020 x!hi", false).unwrap();
        // GPT-2 split: "!" and "hi" are separate words, so the "! h" merge cannot apply.
        assert_eq!(texts(&tok, &ids), ["2", "0", "2", "0", "Ġ", "x", "!", "h", "i"]);
    }

    #[test]
    fn qwen2_glues_one_leading_symbol_to_a_word() {
        let tok = Tokenizer::from_gguf(&toy_content("gpt2", Some("qwen2"), None)).unwrap();
        // Qwen2's `[^\r\n\p{L}\p{N}]?\p{L}+` keeps "!hi" together, so the "!h"+"i" merges apply.
        let ids = tok.encode("x!hi hello wo", false).unwrap();
        assert_eq!(texts(&tok, &ids), ["x", "!hi", "Ġ", "hello", "Ġwo"]);
        let ids = tok.encode("2020", false).unwrap();
        assert_eq!(texts(&tok, &ids), ["2", "0", "2", "0"]);
    }

    #[test]
    fn special_tokens_in_text_are_single_tokens_and_bos_follows_the_gguf() {
        let tok = Tokenizer::from_gguf(&toy_content("gpt2", Some("smollm"), None)).unwrap();
        let start = tok.id_of("<|im_start|>").unwrap();
        let end = tok.id_of("<|im_end|>").unwrap();
        let tool = tok.id_of("<tool>").unwrap();
        let ids = tok.encode("<|im_start|>hello<tool><|im_end|>", false).unwrap();
        assert_eq!(ids, [start, tok.id_of("hello").unwrap(), tool, end]);
        // add_bos_token = true in the toy GGUF, and BOS is <|im_start|>.
        assert_eq!(tok.encode("hello", true).unwrap(), [start, tok.id_of("hello").unwrap()]);
        assert_eq!(tok.decode(&ids, false), "<|im_start|>hello<tool><|im_end|>");
        // Control tokens are skipped, user-defined ones are text.
        assert_eq!(tok.decode(&ids, true), "hello<tool>");
        assert!(tok.is_stop(end) && tok.is_stop(tok.id_of("<|endoftext|>").unwrap()));
        assert!(!tok.is_stop(start));
        assert_eq!(tok.eot_id(), Some(end));
    }

    #[test]
    fn merges_whose_first_symbol_is_multibyte_are_split_correctly() {
        let tok = Tokenizer::from_gguf(&toy_content("gpt2", Some("smollm"), None)).unwrap();
        // "Ã ©" (both halves two-byte characters) must merge: "é" is bytes C3 A9 = "Ã©".
        let ids = tok.encode("é", false).unwrap();
        assert_eq!(texts(&tok, &ids), ["Ã©"]);
        assert_eq!(tok.decode(&ids, false), "é");
    }

    #[test]
    fn byte_alphabet_round_trips_every_byte() {
        for b in 0..=255u8 {
            assert_eq!(byte_of_char(char_of_byte(b)), Some(b));
        }
        assert_eq!(char_of_byte(b' '), 'Ġ');
        assert_eq!(char_of_byte(b'\n'), 'Ċ');
        assert_eq!(byte_of_char('\u{0144}'), None);
    }

    #[test]
    fn prompt_token_counts_match_llama_cpp_completions() {
        for (key, model, counts) in test_models::all_available() {
            for case in counts.iter().filter(|c| !c.chat) {
                let ids = model.tokenizer.encode(case.prompt, true).unwrap();
                assert_eq!(ids.len(), case.prompt_tokens, "{key}: {:?} -> {ids:?}", case.prompt);
            }
        }
    }

    #[test]
    fn smollm2_once_upon_a_time_is_four_tokens_without_bos() {
        let Some(model) = test_models::smollm2() else {
            return;
        };
        let tok = &model.tokenizer;
        let ids = tok.encode("Once upon a time", true).unwrap();
        assert_eq!(texts(tok, &ids), ["Once", "Ġupon", "Ġa", "Ġtime"]);
        assert!(!tok.add_bos());
        assert_eq!(tok.vocab_size(), 49152);
        assert_eq!((tok.bos_id(), tok.eos_id()), (Some(1), Some(2)));
        assert_eq!(tok.id_of("<|im_end|>"), Some(2));
        assert_eq!(tok.eot_id(), Some(2));
        assert!(tok.is_stop(2) && tok.is_stop(0), "stop ids {:?}", tok.stop_ids());
        assert_eq!(tok.pre_tokenizer(), Some(PreTokenizerKind::StarCoder));
    }

    #[test]
    fn reference_files_agree_on_counts_and_generated_text() {
        for (key, model, _) in test_models::all_available() {
            let Some(reference) = test_models::reference_json(key) else {
                continue;
            };
            let results = reference["results"].as_array().expect("results array");
            for result in results {
                let prompt = result["prompt"].as_str().unwrap();
                let expected = result["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
                let text = if result["mode"] == "chat" {
                    let messages = [crate::tokenize::ChatMessage::user(prompt)];
                    model.template.as_ref().unwrap().render(&messages, true).unwrap()
                } else {
                    prompt.to_string()
                };
                let ids = model.tokenizer.encode(&text, true).unwrap();
                assert_eq!(ids.len(), expected, "{key} {}: {prompt:?}", result["mode"]);
                // Generated ids must decode to llama.cpp's text.
                if let Some(generated) = result["token_ids"].as_array() {
                    let generated: Vec<u32> = generated.iter().map(|v| v.as_u64().unwrap() as u32).collect();
                    let decoded = model.tokenizer.decode(&generated, false);
                    assert_eq!(decoded, result["text"].as_str().unwrap(), "{key}: {prompt:?}");
                    // And re-encoding that text gives llama.cpp's exact ids (the model emitted
                    // the canonical tokenization for these continuations).
                    let reencoded = model.tokenizer.encode(&decoded, false).unwrap();
                    assert_eq!(reencoded, generated, "{key}: {prompt:?}");
                }
            }
        }
    }

    #[test]
    fn decode_inverts_encode() {
        for (key, model, _) in test_models::all_available() {
            for text in ROUND_TRIP_TEXTS {
                let ids = model.tokenizer.encode(text, false).unwrap();
                assert_eq!(model.tokenizer.decode(&ids, false), *text, "{key}: {ids:?}");
            }
            let ids = model.tokenizer.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
            assert_eq!(ids[0], model.tokenizer.id_of("<|im_start|>").unwrap(), "{key}");
            assert_eq!(*ids.last().unwrap(), model.tokenizer.id_of("<|im_end|>").unwrap(), "{key}");
            assert_eq!(model.tokenizer.decode(&ids, true), "user\nhi", "{key}");
        }
    }
}

#[cfg(test)]
mod spm_tests {
    use crate::tokenize::test_models::{self, ROUND_TRIP_TEXTS};

    /// Gemma 3's SentencePiece vocabulary: every text comes back byte for byte (byte fallback
    /// for characters without a token), control tokens in the text are single tokens, and the
    /// word-boundary mark decodes to a space. Prompt ids are checked against llama.cpp's counts
    /// in `tests/reference_parity.rs`.
    #[test]
    fn gemma3_round_trips_and_parses_control_tokens() {
        let Some(model) = test_models::gemma3() else { return };
        let tok = &model.tokenizer;
        for text in ROUND_TRIP_TEXTS.iter().chain(&["\n\n\tx\n", "💡 ﷽ \u{0}"]) {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(tok.decode(&ids, false), *text, "{ids:?}");
        }
        let ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>", true).unwrap();
        assert_eq!(ids[0], tok.bos_id().unwrap());
        assert_eq!(ids[1], tok.id_of("<start_of_turn>").unwrap());
        assert_eq!(*ids.last().unwrap(), tok.id_of("<end_of_turn>").unwrap());
        assert!(tok.is_stop(tok.id_of("<end_of_turn>").unwrap()));
        assert_eq!(tok.decode(&ids, true), "user\nhi");
        // "\n" is a user-defined token in this vocabulary: matched whole, decoded as itself.
        assert_eq!(tok.encode("a\nb", false).unwrap()[1], tok.id_of("\n").unwrap());
        assert_eq!(tok.encode(" the", false).unwrap(), vec![tok.id_of("\u{2581}the").unwrap()]);
    }
}
