//! Tokenizers and chat templates.
//!
//! - [`gguf_bpe`]: tokenizers built from GGUF metadata, matching llama.cpp: byte-level BPE
//!   with its pre-tokenizers (the table in [`gguf_bpe::PRE_TOKENIZERS`]), SentencePiece-style vocabularies
//!   ([`gguf_spm`]), and special-token parsing.
//! - [`chat_template`]: the GGUF's Jinja chat template rendered with minijinja.
//! - [`detok_stream`]: incremental detokenisation that never splits a UTF-8 character.

pub mod chat_template;
pub mod detok_stream;
pub mod gguf_bpe;
pub mod gguf_spm;
pub mod hf_json;

pub use chat_template::{parse_template_kwargs, ChatMessage, ChatTemplate, TemplateKwargs, TemplateOrigin};
pub use detok_stream::StreamDecoder;
pub use gguf_bpe::{
    read_gguf_header, PreTokenizerKind, PreTokenizerSpec, TokenKind, Tokenizer, VocabModel, PRE_TOKENIZERS,
};

/// Model files and llama.cpp ground truth shared by this module's tests.
#[cfg(test)]
pub(crate) mod test_models {
    use std::collections::HashMap;
    use std::path::PathBuf;
    use std::sync::{Arc, Mutex, OnceLock};

    use super::{ChatTemplate, Tokenizer};

    /// A prompt and the prompt token count llama.cpp reported for it
    /// (`usage.prompt_tokens` in tests/fixtures/llamacpp-greedy/*.json).
    pub struct ReferenceCount {
        pub chat: bool,
        pub prompt: &'static str,
        pub prompt_tokens: usize,
    }

    const fn count(chat: bool, prompt: &'static str, prompt_tokens: usize) -> ReferenceCount {
        ReferenceCount { chat, prompt, prompt_tokens }
    }

    /// SmolLM2-135M-Instruct.Q4_1.json
    pub const SMOLLM2_COUNTS: &[ReferenceCount] = &[
        count(false, "Once upon a time", 4),
        count(false, "def fibonacci(n):", 6),
        count(false, "The capital of France is", 5),
        count(true, "What is 12 * 7? Answer briefly.", 42),
        count(true, "Write a Python function that reverses a string.", 40),
    ];

    /// qwen2.5-coder-{0.5b,1.5b}-instruct-q4_k_m.json (identical for both sizes).
    pub const QWEN25_CODER_COUNTS: &[ReferenceCount] = &[
        count(false, "Once upon a time", 4),
        count(false, "def fibonacci(n):", 4),
        count(false, "The capital of France is", 5),
        count(true, "What is 12 * 7? Answer briefly.", 41),
        count(true, "Write a Python function that reverses a string.", 39),
    ];

    /// Round-trip texts: ASCII, code with tabs/newlines/runs of spaces, multi-byte text,
    /// and special tokens written in the text.
    pub const ROUND_TRIP_TEXTS: &[&str] = &[
        "Once upon a time",
        "def f(x):\n\tif x  >  0:\n\t\treturn x * 2   # twice\n    \n\n\nprint(f(21))\r\n",
        "héllo 世界 🚀",
        "naïve café — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ½ Ⅻ ٣ 12345 '' \"quoted\" don't I'LL",
        "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
        "  leading and trailing spaces  ",
    ];

    pub struct LoadedModel {
        pub tokenizer: Tokenizer,
        /// `None` for base models whose GGUF has no chat template (Gemma 3 270M).
        pub template: Option<ChatTemplate>,
    }

    fn skip_model_tests() -> bool {
        std::env::var("SPECULA_SKIP_MODEL_TESTS").is_ok_and(|v| v == "1")
    }

    /// The model's tokenizer and template, read once per process. A required model is fetched
    /// (once per process, [`crate::fetch::fetch_once`]); an optional one is used only when it is
    /// already in the cache (the Qwen models are large: `specula fetch` them to run those cases).
    fn load(key: &str, required: bool) -> Option<Arc<LoadedModel>> {
        if skip_model_tests() {
            return None;
        }
        if !required && !crate::fetch::find_asset(key).is_some_and(|a| a.path().is_file()) {
            eprintln!("skipping {key}: optional model not in the cache (`specula fetch {key}` to include it)");
            return None;
        }
        let path = match crate::fetch::fetch_once(key, true) {
            Ok(path) => path,
            Err(err) => panic!(
                "fetching {key} for the tokenizer tests failed: {err:#}\n(set SPECULA_SKIP_MODEL_TESTS=1 to skip \
                 tests that need real models)"
            ),
        };
        static CACHE: OnceLock<Mutex<HashMap<String, Arc<LoadedModel>>>> = OnceLock::new();
        let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        let loaded = cache.entry(key.to_string()).or_insert_with(|| {
            let content = super::read_gguf_header(&path).expect("reading GGUF header");
            Arc::new(LoadedModel {
                tokenizer: Tokenizer::from_gguf(&content).expect("building tokenizer"),
                template: content
                    .metadata
                    .contains_key("tokenizer.chat_template")
                    .then(|| ChatTemplate::from_gguf(&content).expect("reading chat template")),
            })
        });
        Some(Arc::clone(loaded))
    }

    /// SmolLM2, fetched on first use unless SPECULA_SKIP_MODEL_TESTS=1.
    pub fn smollm2() -> Option<Arc<LoadedModel>> {
        load("smollm2-135m", true)
    }

    /// Gemma 3 270M (SentencePiece vocabulary), fetched on first use unless
    /// SPECULA_SKIP_MODEL_TESTS=1.
    pub fn gemma3() -> Option<Arc<LoadedModel>> {
        load("gemma3-270m", true)
    }

    /// The Qwen2.5-Coder models are optional: only those already fetched.
    pub fn qwen25_coder() -> Vec<(&'static str, Arc<LoadedModel>)> {
        ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
            .into_iter()
            .filter_map(|key| load(key, false).map(|m| (key, m)))
            .collect()
    }

    /// Every available model with its reference counts.
    pub fn all_available() -> Vec<(&'static str, Arc<LoadedModel>, &'static [ReferenceCount])> {
        let mut models: Vec<_> = smollm2().map(|m| ("smollm2-135m", m, SMOLLM2_COUNTS)).into_iter().collect();
        models.extend(qwen25_coder().into_iter().map(|(k, m)| (k, m, QWEN25_CODER_COUNTS)));
        models
    }

    /// The llama.cpp reference file for a model key (tests/fixtures/llamacpp-greedy).
    pub fn reference_json(key: &str) -> Option<serde_json::Value> {
        let file = match key {
            "smollm2-135m" => "SmolLM2-135M-Instruct.Q4_1.json",
            "qwen2.5-coder-0.5b" => "qwen2.5-coder-0.5b-instruct-q4_k_m.json",
            "qwen2.5-coder-1.5b" => "qwen2.5-coder-1.5b-instruct-q4_k_m.json",
            _ => return None,
        };
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llamacpp-greedy").join(file);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        Some(serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display())))
    }
}
