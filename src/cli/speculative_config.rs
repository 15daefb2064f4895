//! vLLM's `--speculative-config` JSON, read as the `--drafter` and `--draft-max` it means.
//!
//! vLLM names the method, the drafter's weights and how many tokens to propose per step:
//! `{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}` or
//! `{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 3}`. specula's drafts adapt
//! their length per step, so `num_speculative_tokens` becomes the longest draft.

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

use crate::speculative::MAX_DRAFT;

/// What a `--speculative-config` asks for, in specula's terms.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeConfig {
    /// A `--drafter` spec.
    pub drafter: String,
    /// `num_speculative_tokens`: the longest draft per step.
    pub draft_max: Option<usize>,
}

/// Every key read; anything else is refused rather than silently ignored.
const KEYS: &[&str] = &[
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
];

impl SpeculativeConfig {
    pub fn parse(json: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(json).context("--speculative-config is not valid JSON")?;
        let Value::Object(fields) = value else { bail!("--speculative-config must be a JSON object") };
        if let Some(unknown) = fields.keys().find(|k| !KEYS.contains(&k.as_str())) {
            bail!("--speculative-config: unsupported key `{unknown}` (supported: {})", KEYS.join(", "));
        }
        let model = string_field(&fields, "model")?;
        let method = match string_field(&fields, "method")? {
            Some(method) => method,
            // vLLM's inference when only a model is named.
            None => match model {
                Some("ngram" | "[ngram]") => "ngram",
                Some(_) => "draft_model",
                None => bail!("--speculative-config needs a `method` (ngram, draft_model, eagle3, dflash or suffix)"),
            },
        };
        let needs_model = |what: &str| -> Result<String> {
            match model {
                Some(m) if !m.is_empty() => Ok(m.to_string()),
                _ => bail!("--speculative-config: method `{method}` needs `model` ({what})"),
            }
        };
        let drafter = match method {
            "ngram" => {
                if let Some(min) = count_field(&fields, "prompt_lookup_min")? {
                    if min != 2 {
                        bail!(
                            "--speculative-config: prompt_lookup_min {min} is not supported (specula matches n-grams down to 2 tokens)"
                        );
                    }
                }
                match count_field(&fields, "prompt_lookup_max")? {
                    Some(max) => format!("ngram:{max}"),
                    None => "ngram".to_string(),
                }
            }
            "draft_model" => format!("draft-model:{}", needs_model("a model key or GGUF path")?),
            "eagle3" => format!("eagle3:{}", needs_model("an EAGLE-3 drafter directory")?),
            "dflash" => format!("dflash:{}", needs_model("a DFlash drafter directory")?),
            "suffix" => {
                let mut options = Vec::new();
                if let Some(depth) = count_field(&fields, "suffix_decoding_max_tree_depth")? {
                    options.push(format!("depth={depth}"));
                }
                if let Some(factor) = number_field(&fields, "suffix_decoding_max_spec_factor")? {
                    options.push(format!("factor={factor}"));
                }
                if let Some(p) = number_field(&fields, "suffix_decoding_min_token_prob")? {
                    options.push(format!("min-prob={p}"));
                }
                if options.is_empty() {
                    "suffix".to_string()
                } else {
                    format!("suffix:{}", options.join(","))
                }
            }
            "eagle" | "medusa" | "mlp_speculator" | "mtp" => bail!(
                "--speculative-config: method `{method}` is not supported (supported: ngram, draft_model, eagle3, dflash, suffix)"
            ),
            other => bail!(
                "--speculative-config: unknown method `{other}` (supported: ngram, draft_model, eagle3, dflash, suffix)"
            ),
        };
        // Options of another method are a mistake worth saying, not something to ignore.
        for key in fields.keys() {
            let belongs = match key.as_str() {
                "prompt_lookup_max" | "prompt_lookup_min" => method == "ngram",
                k if k.starts_with("suffix_decoding_") => method == "suffix",
                _ => true,
            };
            if !belongs {
                bail!("--speculative-config: `{key}` does not apply to method `{method}`");
            }
        }
        let draft_max = count_field(&fields, "num_speculative_tokens")?;
        if let Some(n) = draft_max {
            if !(1..=MAX_DRAFT).contains(&n) {
                bail!("--speculative-config: num_speculative_tokens must be in 1..={MAX_DRAFT}, got {n}");
            }
        }
        Ok(Self { drafter, draft_max })
    }
}

fn string_field<'a>(fields: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match fields.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(other) => bail!("--speculative-config: `{key}` must be a string, got {other}"),
    }
}

fn count_field(fields: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match fields.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64().and_then(|n| usize::try_from(n).ok()) {
            Some(n) => Ok(Some(n)),
            None => bail!("--speculative-config: `{key}` must be a non-negative integer, got {v}"),
        },
    }
}

fn number_field(fields: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match fields.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x)),
            _ => bail!("--speculative-config: `{key}` must be a number, got {v}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> SpeculativeConfig {
        SpeculativeConfig::parse(json).unwrap()
    }

    fn refused(json: &str) -> String {
        format!("{:#}", SpeculativeConfig::parse(json).unwrap_err())
    }

    #[test]
    fn vllm_configs_become_drafter_specs() {
        let ngram = parse(r#"{"method":"ngram","num_speculative_tokens":5}"#);
        assert_eq!(ngram, SpeculativeConfig { drafter: "ngram".into(), draft_max: Some(5) });
        assert_eq!(parse(r#"{"method":"ngram","prompt_lookup_max":4,"prompt_lookup_min":2}"#).drafter, "ngram:4");
        assert_eq!(
            parse(r#"{"method":"eagle3","model":"drafters/x","num_speculative_tokens":3}"#),
            SpeculativeConfig { drafter: "eagle3:drafters/x".into(), draft_max: Some(3) }
        );
        assert_eq!(parse(r#"{"method":"dflash","model":"d"}"#).drafter, "dflash:d");
        assert_eq!(
            parse(r#"{"method":"draft_model","model":"qwen2.5-coder-0.5b"}"#).drafter,
            "draft-model:qwen2.5-coder-0.5b"
        );
        // vLLM infers the method from the model when none is named.
        assert_eq!(parse(r#"{"model":"qwen2.5-coder-0.5b"}"#).drafter, "draft-model:qwen2.5-coder-0.5b");
        assert_eq!(parse(r#"{"model":"[ngram]","num_speculative_tokens":4}"#).drafter, "ngram");
        assert_eq!(
            parse(r#"{"method":"suffix","suffix_decoding_max_tree_depth":24,"suffix_decoding_min_token_prob":0.2}"#)
                .drafter,
            "suffix:depth=24,min-prob=0.2"
        );
        // Every spec made here is one the drafter parser accepts.
        for json in [
            r#"{"method":"ngram","prompt_lookup_max":4}"#,
            r#"{"method":"suffix","suffix_decoding_max_spec_factor":2.0}"#,
            r#"{"method":"draft_model","model":"m"}"#,
        ] {
            crate::speculative::DrafterSpec::parse(&parse(json).drafter).unwrap();
        }
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_with_its_reason() {
        assert!(refused("[1]").contains("JSON object"));
        assert!(refused("{").contains("not valid JSON"));
        assert!(refused(r#"{"method":"ngram","draft_tensor_parallel_size":1}"#).contains("unsupported key"));
        assert!(refused(r#"{"method":"medusa","model":"m"}"#).contains("not supported"));
        assert!(refused(r#"{"method":"bogus"}"#).contains("unknown method `bogus`"));
        assert!(refused(r#"{"method":"eagle3"}"#).contains("needs `model`"));
        assert!(refused(r#"{"num_speculative_tokens":3}"#).contains("needs a `method`"));
        assert!(refused(r#"{"method":"ngram","num_speculative_tokens":0}"#).contains("1..=15"));
        assert!(refused(r#"{"method":"ngram","num_speculative_tokens":99}"#).contains("1..=15"));
        assert!(refused(r#"{"method":"ngram","num_speculative_tokens":-1}"#).contains("non-negative integer"));
        assert!(refused(r#"{"method":"ngram","prompt_lookup_min":1}"#).contains("down to 2"));
        assert!(refused(r#"{"method":"eagle3","model":"d","prompt_lookup_max":3}"#).contains("does not apply"));
        assert!(refused(r#"{"method":"ngram","model":7}"#).contains("must be a string"));
    }
}
