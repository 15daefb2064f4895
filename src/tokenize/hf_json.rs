//! Hugging Face `tokenizer.json` (+ `tokenizer_config.json`) for byte-level BPE models, turned
//! into the same GGUF-style vocabulary metadata the GGUF path reads, so one builder serves both.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value as G, VersionedMagic};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// GGUF token types (llama.cpp's enum).
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// Reads `dir/tokenizer.json` (and `tokenizer_config.json` when present) into GGUF-style
/// tokenizer metadata. `model_type` picks the pre-tokenizer (`qwen2`, `qwen3` → llama.cpp's
/// `qwen2`); other families are refused rather than guessed.
pub fn content_from_hf_dir(dir: &Path, model_type: &str) -> Result<Content> {
    let path = dir.join("tokenizer.json");
    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?,
    )
    .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let pre = match model_type {
        "qwen2" | "qwen3" => "qwen2",
        other => bail!("no known pre-tokenizer for `{other}` tokenizers (supported: qwen2, qwen3)"),
    };
    let model = &json["model"];
    if model["type"].as_str() != Some("BPE") {
        bail!("{}: only BPE tokenizers are supported", path.display());
    }
    let vocab = model["vocab"].as_object().context("tokenizer.json: model.vocab missing")?;
    let mut texts: HashMap<u32, (String, i32)> = HashMap::new();
    for (text, id) in vocab {
        let id = id.as_u64().context("tokenizer.json: non-integer id")? as u32;
        texts.insert(id, (text.clone(), NORMAL));
    }
    for t in json["added_tokens"].as_array().into_iter().flatten() {
        let id = t["id"].as_u64().context("added token without id")? as u32;
        let content = t["content"].as_str().context("added token without content")?.to_string();
        let kind = if t["special"].as_bool().unwrap_or(false) { CONTROL } else { USER_DEFINED };
        texts.insert(id, (content, kind));
    }
    let n = texts.keys().max().map_or(0, |m| *m as usize + 1);
    if n > 4_000_000 {
        bail!("tokenizer.json: implausible vocabulary size {n}");
    }
    let mut tokens = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    for id in 0..n as u32 {
        // Holes (ids with no token) become unused placeholders that never match text.
        let (text, kind) = texts.remove(&id).unwrap_or_else(|| (format!("[PAD{id}]"), USER_DEFINED));
        tokens.push(G::String(text));
        types.push(G::I32(kind));
    }
    let merges: Vec<G> = model["merges"]
        .as_array()
        .context("tokenizer.json: model.merges missing")?
        .iter()
        .map(|m| match m {
            Value::String(s) => Ok(G::String(s.clone())),
            Value::Array(pair) if pair.len() == 2 => {
                Ok(G::String(format!("{} {}", pair[0].as_str().unwrap_or(""), pair[1].as_str().unwrap_or(""))))
            }
            _ => bail!("tokenizer.json: malformed merge {m}"),
        })
        .collect::<Result<_>>()?;

    let mut metadata = HashMap::new();
    metadata.insert("tokenizer.ggml.model".to_string(), G::String("gpt2".into()));
    metadata.insert("tokenizer.ggml.pre".to_string(), G::String(pre.into()));
    metadata.insert("tokenizer.ggml.tokens".to_string(), G::Array(tokens.clone()));
    metadata.insert("tokenizer.ggml.token_type".to_string(), G::Array(types));
    metadata.insert("tokenizer.ggml.merges".to_string(), G::Array(merges));

    let config: Value = std::fs::read_to_string(dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(Value::Null);
    let id_of = |field: &str| -> Option<u32> {
        let text = match &config[field] {
            Value::String(s) => s.clone(),
            Value::Object(o) => o.get("content")?.as_str()?.to_string(),
            _ => return None,
        };
        tokens.iter().position(|t| matches!(t, G::String(s) if *s == text)).map(|i| i as u32)
    };
    if let Some(id) = id_of("bos_token") {
        metadata.insert("tokenizer.ggml.bos_token_id".to_string(), G::U32(id));
    }
    if let Some(id) = id_of("eos_token") {
        metadata.insert("tokenizer.ggml.eos_token_id".to_string(), G::U32(id));
    }
    let add_bos = config["add_bos_token"].as_bool().unwrap_or(false);
    metadata.insert("tokenizer.ggml.add_bos_token".to_string(), G::Bool(add_bos));
    if let Some(t) = config["chat_template"].as_str() {
        metadata.insert("tokenizer.chat_template".to_string(), G::String(t.to_string()));
    }
    Ok(Content { magic: VersionedMagic::GgufV3, metadata, tensor_infos: HashMap::new(), tensor_data_offset: 0 })
}
