//! Builds a proposer from a `--drafter` string.

use super::combined::CombinedProposer;
use super::draft_model::{check_vocab_compatible, DraftModelProposer, DraftModelSettings};
use super::ngram::{NgramProposer, MAX_NGRAM_LIMIT};
use super::suffix::cache::SuffixCache;
use super::suffix::SuffixProposer;
use super::weight_cache::WeightCache;
use super::Proposer;
use crate::model::{GgufFile, KernelSettings, Transformer};
use crate::tokenize::Tokenizer;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::sync::Arc;

/// Shortest n-gram the `ngram` drafter matches (unless `ngram:1` asks for single tokens).
pub const MIN_NGRAM: usize = 2;

/// A parsed `--drafter` value.
#[derive(Debug, Clone, PartialEq)]
pub enum DrafterSpec {
    /// `ngram` or `ngram:N`: n-grams of N tokens (default 3) down to 2 are matched, longest
    /// first (`ngram:1` matches single tokens). Single-token matches are not tried otherwise:
    /// their drafts are accepted too rarely (~10–20% on chat output) to pay for verifying them
    /// where verification is dear, as on a CPU.
    Ngram { max_ngram: usize },
    /// `draft-model:KEY|PATH[,weights=FORMAT][,vocab=N]`.
    DraftModel { model: String, settings: DraftModelSettings },
    /// `dflash:PATH[,block=N][,draft-max=N][,window=N]`: a z-lab DFlash drafter directory (docs/dflash.md).
    Dflash { path: PathBuf, settings: super::dflash::DflashSettings },
    /// `eagle3:PATH[,draft-max=N]`: an EAGLE-3 drafter directory in the published layout (docs/eagle3.md).
    Eagle3 { path: PathBuf, settings: super::eagle3::Eagle3Settings },
    /// `suffix[:depth=N][,factor=F][,min-prob=P][,prompts=on|off]`: suffix decoding over the
    /// request's own text and the server's recent requests (docs/speculative.md).
    Suffix { settings: super::suffix::SuffixSettings },
    /// `A+B`: A drafts first, B when A proposes nothing (`ngram+dflash:DIR`).
    Combined { first: Box<DrafterSpec>, then: Box<DrafterSpec> },
}

/// Prompt lookup's longest n-gram when `ngram` names none (and what `auto` uses).
const DEFAULT_MAX_NGRAM: usize = 3;

impl DrafterSpec {
    pub fn parse(s: &str) -> Result<Self> {
        // `A+B`, split at the first `+` where both sides are drafters (a path may hold a `+`).
        // Two at most: each side is one drafter, so parsing stays linear in the `+` count.
        for (at, _) in s.match_indices('+') {
            let Ok(first) = Self::parse_one(&s[..at]) else { continue };
            if let Ok(then) = Self::parse_one(&s[at + 1..]) {
                return Ok(DrafterSpec::Combined { first: Box::new(first), then: Box::new(then) });
            }
        }
        Self::parse_one(s)
    }

    /// [`Self::parse`], plus `auto` for the target `model` (a model key or a GGUF path): prompt
    /// lookup with the repository's DFlash drafter for that model behind it where there is one
    /// (lookup's free drafts where the context has a match, the learned drafter's elsewhere),
    /// prompt lookup alone otherwise.
    pub fn parse_for_model(s: &str, model: &str) -> Result<Self> {
        if !s.trim().eq_ignore_ascii_case("auto") {
            return Self::parse(s);
        }
        let lookup = DrafterSpec::Ngram { max_ngram: DEFAULT_MAX_NGRAM };
        Ok(match shipped_dflash_drafter(model) {
            Some(path) => DrafterSpec::Combined {
                first: Box::new(lookup),
                then: Box::new(DrafterSpec::Dflash { path, settings: Default::default() }),
            },
            None => lookup,
        })
    }

    fn parse_one(s: &str) -> Result<Self> {
        let (kind, arg) = s.split_once(':').map_or((s, None), |(k, a)| (k, Some(a)));
        Ok(match kind {
            "ngram" => {
                let max_ngram = match arg {
                    None => DEFAULT_MAX_NGRAM,
                    Some(a) => a
                        .parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_NGRAM_LIMIT).contains(n))
                        .with_context(|| format!("ngram:N needs N in 1..={MAX_NGRAM_LIMIT}, got `{a}`"))?,
                };
                DrafterSpec::Ngram { max_ngram }
            }
            "suffix" => DrafterSpec::Suffix { settings: super::suffix::parse_settings(arg.unwrap_or(""))? },
            "draft-model" => {
                let (model, settings) = super::draft_model::parse_drafter_arg(arg.unwrap_or(""))?;
                DrafterSpec::DraftModel { model, settings }
            }
            "dflash" => {
                let (path, settings) = super::dflash::parse_drafter_arg(arg.unwrap_or(""))?;
                DrafterSpec::Dflash { path, settings }
            }
            "eagle3" => {
                let (path, settings) = super::eagle3::parse_drafter_arg(arg.unwrap_or(""))?;
                DrafterSpec::Eagle3 { path, settings }
            }
            "auto" => bail!("`auto` picks the drafter for the target model in serve and generate; name one here"),
            other => {
                bail!(
                    "unknown drafter `{other}` (available: ngram[:N], suffix[:OPTIONS], draft-model:MODEL, dflash:PATH, \
                     eagle3:PATH, or two joined by `+`)"
                )
            }
        })
    }

    /// Short label for tables and logs (`ngram:3`, `draft-model:qwen2.5-coder-0.5b`).
    pub fn label(&self) -> String {
        match self {
            DrafterSpec::Ngram { max_ngram } => format!("ngram:{max_ngram}"),
            DrafterSpec::Suffix { settings } => super::suffix::label(settings),
            DrafterSpec::DraftModel { model, settings } => super::draft_model::drafter_label(model, settings),
            DrafterSpec::Dflash { path, settings } => super::dflash::drafter_label(path, settings),
            DrafterSpec::Eagle3 { path, settings } => super::eagle3::drafter_label(path, settings),
            DrafterSpec::Combined { first, then } => format!("{}+{}", first.label(), then.label()),
        }
    }
}

/// The DFlash drafter this repository ships for the model `key` (`drafters/KEY-dflash`, beside
/// the working directory or in the source tree the binary was built from), if any.
pub fn shipped_dflash_drafter(key: &str) -> Option<PathBuf> {
    // Model keys only: a path or anything odd names no shipped drafter.
    if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')) {
        return None;
    }
    let name = format!("{}-dflash", key.to_ascii_lowercase());
    [PathBuf::from("drafters"), std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("drafters")]
        .into_iter()
        .map(|dir| dir.join(&name))
        .find(|dir| dir.join("config.json").is_file() && dir.join("model.safetensors").is_file())
}

/// The model a drafter drafts for: its weights and its vocabulary.
#[derive(Clone, Copy)]
pub struct Target<'a> {
    pub model: &'a Transformer,
    pub tokenizer: &'a Tokenizer,
}

/// Whose request a proposer drafts for, and what it may share with that caller's other
/// requests (the suffix drafter's cache of recent requests).
#[derive(Clone, Copy, Default)]
pub struct Caller<'a> {
    pub suffix_cache: Option<&'a Arc<SuffixCache>>,
    /// The API key the request came with (`Authorization: Bearer`), for the cache's scopes.
    pub api_key: Option<&'a str>,
}

impl DrafterSpec {
    /// Whether a `suffix` drafter is part of this spec (it then wants a shared cache).
    pub fn uses_suffix(&self) -> bool {
        match self {
            DrafterSpec::Suffix { .. } => true,
            DrafterSpec::Combined { first, then } => first.uses_suffix() || then.uses_suffix(),
            _ => false,
        }
    }
}

/// A fresh proposer for one sequence generated by `target`. A draft model's weights are loaded
/// once per process and shared by every proposer built from them; each proposer has its own KV.
pub fn build_proposer(spec: &DrafterSpec, target: Target<'_>, caller: Caller<'_>) -> Result<Box<dyn Proposer>> {
    match spec {
        DrafterSpec::Suffix { settings } => {
            let shared = caller
                .suffix_cache
                .and_then(|cache| cache.scope_of(caller.api_key).map(|scope| (cache.clone(), scope)));
            Ok(Box::new(SuffixProposer::new(settings.clone(), shared)))
        }
        DrafterSpec::Ngram { max_ngram } => Ok(Box::new(NgramProposer::new(MIN_NGRAM.min(*max_ngram), *max_ngram)?)),
        DrafterSpec::DraftModel { model, settings } => {
            let path = crate::fetch::resolve_model(model, true)?;
            let draft = load_draft_model(&path, settings, target.tokenizer)
                .with_context(|| format!("{} cannot draft for this target", path.display()))?;
            let kv_tokens = target.model.config.context_len.min(draft.model.config.context_len).min(32_768);
            Ok(Box::new(DraftModelProposer::new(draft.model.clone(), kv_tokens, target.tokenizer.stop_ids().to_vec())))
        }
        DrafterSpec::Dflash { path, settings } => {
            Ok(Box::new(super::dflash::build_proposer(path, settings, target.model)?))
        }
        DrafterSpec::Eagle3 { path, settings } => {
            Ok(Box::new(super::eagle3::build_proposer(path, settings, target.model)?))
        }
        DrafterSpec::Combined { first, then } => Ok(Box::new(CombinedProposer::new(
            build_proposer(first, target, caller)?,
            build_proposer(then, target, caller)?,
        ))),
    }
}

/// A draft model's weights and tokenizer, shared across requests.
struct DraftAssets {
    model: Arc<Transformer>,
    tokenizer: Tokenizer,
}

/// Loads (or reuses) a draft model after checking that its vocabulary is `target`'s; an
/// incompatible drafter is refused before its weights are read. Weights use the file's
/// measured default format, as for a target, unless `settings` names another; `settings.vocab`
/// cuts its head to that many tokens.
fn load_draft_model(
    path: &std::path::Path,
    settings: &DraftModelSettings,
    target: &Tokenizer,
) -> Result<Arc<DraftAssets>> {
    static LOADED: WeightCache<DraftAssets> = WeightCache::new();
    LOADED.get_or_load_as(
        path,
        &settings.variant(),
        |assets| check_vocab_compatible(target, &assets.tokenizer).context("its vocabulary differs"),
        || {
            let mut file = GgufFile::open(path)?;
            let tokenizer = Tokenizer::from_gguf(&file.content)
                .with_context(|| format!("{}: cannot build the tokenizer", path.display()))?;
            check_vocab_compatible(target, &tokenizer).context("its vocabulary differs")?;
            let kernels = KernelSettings::from_env().with_weights(settings.weights);
            let mut model = Transformer::load(&mut file, &kernels, &candle_core::Device::Cpu)?.with_source_path(path);
            if let Some(n) = settings.vocab {
                model.keep_head_rows(n, &kernels).with_context(|| format!("draft-model vocab={n}"))?;
            }
            model.warm_up()?;
            Ok(DraftAssets { model: Arc::new(model), tokenizer })
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_puts_the_shipped_drafter_behind_lookup() {
        let spec = DrafterSpec::parse_for_model("auto", "smollm2-135m").unwrap();
        let DrafterSpec::Combined { first, then } = &spec else { panic!("{spec:?}") };
        assert_eq!(**first, DrafterSpec::Ngram { max_ngram: 3 });
        let DrafterSpec::Dflash { path, settings } = &**then else { panic!("{then:?}") };
        assert!(path.ends_with("drafters/smollm2-135m-dflash"), "{}", path.display());
        assert_eq!(*settings, Default::default());
        // No drafter shipped for the model, or a path: lookup alone.
        for model in ["qwen2.5-coder-1.5b", "models/smollm2-135m.gguf", "../drafters/x", ""] {
            assert_eq!(DrafterSpec::parse_for_model("AUTO", model).unwrap(), DrafterSpec::Ngram { max_ngram: 3 });
        }
        assert_eq!(
            DrafterSpec::parse_for_model("ngram:4", "smollm2-135m").unwrap(),
            DrafterSpec::Ngram { max_ngram: 4 }
        );
    }

    #[test]
    fn two_drafters_joined_by_a_plus_combine() {
        let spec = DrafterSpec::parse("ngram:4+dflash:some/dir+x,max=7").unwrap();
        let DrafterSpec::Combined { first, then } = &spec else { panic!("{spec:?}") };
        assert_eq!(**first, DrafterSpec::Ngram { max_ngram: 4 });
        // The `+` inside the path is part of it: `x,max=7` alone is no drafter.
        let DrafterSpec::Dflash { path, settings } = &**then else { panic!("{then:?}") };
        assert_eq!(path, &PathBuf::from("some/dir+x"));
        assert_eq!(settings.max_draft, Some(7));
        assert_eq!(spec.label(), format!("ngram:4+{}", then.label()));
        assert_eq!(DrafterSpec::parse("dflash:a+b").unwrap(), DrafterSpec::parse_one("dflash:a+b").unwrap());
        let err = format!("{:#}", DrafterSpec::parse("ngram+nope").unwrap_err());
        assert!(err.contains("unknown drafter `ngram+nope`") && err.contains("joined by `+`"), "{err}");
        assert!(DrafterSpec::parse("ngram+").is_err());
        // Three drafters are not a combination: the last two would be one path.
        let three = DrafterSpec::parse("ngram+ngram+ngram");
        assert!(three.is_err(), "{three:?}");
        // Many `+` in a path parse in linear time.
        let long = format!("dflash:{}", "a+".repeat(5000));
        assert!(DrafterSpec::parse(&long).is_ok());
    }

    #[test]
    fn a_draft_model_takes_its_weights_and_vocabulary_after_the_model() {
        use crate::model::WeightFormat;
        let spec = DrafterSpec::parse("draft-model:dir/m,x.gguf,vocab=32768,weights=q4_0").unwrap();
        let DrafterSpec::DraftModel { model, settings } = &spec else { panic!("{spec:?}") };
        // A comma without `=` after it belongs to the path.
        assert_eq!(model, "dir/m,x.gguf");
        assert_eq!((settings.weights, settings.vocab), (Some(WeightFormat::Q4_0), Some(32768)));
        assert_eq!(spec.label(), "draft-model:dir/m,x.gguf,weights=q4_0,vocab=32768");
        assert_eq!(DrafterSpec::parse("draft-model:m").unwrap().label(), "draft-model:m");
        for (bad, says) in [
            ("draft-model:", "needs a model"),
            ("draft-model:,vocab=5", "needs a model"),
            ("draft-model:m,vocab=0", "positive whole number"),
            ("draft-model:m,vocab=x", "positive whole number"),
            ("draft-model:m,weights=q3", "unknown weight format"),
            ("draft-model:m,vocab=5,vocab=6", "given twice"),
        ] {
            let err = format!("{:#}", DrafterSpec::parse(bad).unwrap_err());
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
