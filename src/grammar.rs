//! Structured outputs: a request's grammar (a JSON schema, any JSON object, a regex or a Lark
//! grammar), compiled by llguidance (the constrained-decoding library llama.cpp and vLLM use)
//! against the target's vocabulary, and applied to the target's rows before sampling.
//!
//! Under speculation the mask applies to every verification row: row `i` is masked in the
//! grammar state after the first `i` draft tokens, so a draft token the grammar forbids has
//! probability 0 and is rejected like any other mismatch, and the correction or bonus token is
//! drawn from the masked row. The output is then exactly the constrained target's: greedy
//! output equals constrained greedy decoding, and at temperature > 0 each token is a draw from
//! the normalised masked distribution. Drafts are also cut before their first forbidden token,
//! so no verification row is spent on it.

use anyhow::{anyhow, bail, Context, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;

use crate::tokenize::Tokenizer;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// A JSON schema (OpenAI's `json_schema`).
    JsonSchema(Value),
    /// A regular expression over the output text.
    Regex(String),
    /// A grammar in llguidance's Lark syntax.
    Lark(String),
}

impl GrammarSpec {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(with_json_layout(json!({"type": "object"}))),
            GrammarSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_json_layout(schema.clone())),
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// JSON as people write it on one line (`{"a": 1, "b": [2, 3]}`), not with any whitespace
/// between tokens: a model allowed free whitespace can spend its whole budget on newlines.
/// A schema's own `x-guidance` settings win.
fn with_json_layout(mut schema: Value) -> Value {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance").or_insert(json!({
            "whitespace_flexible": false,
            "item_separator": ", ",
            "key_separator": ": ",
        }));
    }
    schema
}

/// Compiles grammars against one model's vocabulary (built once per model: the token trie).
pub struct GrammarCompiler {
    factory: ParserFactory,
    /// The ids that end a request; any of them is allowed where the grammar may end.
    stop_ids: Vec<u32>,
    vocab: usize,
}

impl GrammarCompiler {
    /// `vocab` is the width of the model's logits rows (it may exceed the tokenizer's).
    pub fn new(tokenizer: &Tokenizer, stop_ids: &[u32], vocab: usize) -> Result<Self> {
        let eos = *stop_ids.first().context("structured outputs need an end-of-sequence token")?;
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                let piece = tokenizer.piece(id, false);
                if tokenizer.is_control(id) {
                    // llguidance's mark for special tokens: never part of text.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(piece);
                    w
                } else {
                    piece.to_vec()
                }
            })
            .collect();
        let info = TokRxInfo::new(vocab as u32, eos);
        // Literal text in a grammar is tokenised greedily over the trie; llguidance allows any
        // tokenisation of it, so this only affects how forced text is first proposed.
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        // Only ids with a logits column (the mask is `vocab` wide and unchecked).
        let stop_ids = stop_ids.iter().copied().filter(|&s| (s as usize) < vocab).collect();
        Ok(Self { factory, stop_ids, vocab })
    }

    /// A fresh constraint for one request; an error names what is wrong with the grammar.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint> {
        let parser = self.factory.create_parser(spec.top_level()).map_err(|e| anyhow!("{e}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            bail!("{e}");
        }
        Ok(Constraint { matcher, stop_ids: self.stop_ids.clone(), vocab: self.vocab })
    }
}

/// One request's grammar state: the committed output so far.
pub struct Constraint {
    matcher: Matcher,
    stop_ids: Vec<u32>,
    vocab: usize,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Self { matcher: self.matcher.deep_clone(), stop_ids: self.stop_ids.clone(), vocab: self.vocab }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

impl Constraint {
    /// How many leading tokens of `draft` the grammar allows from the current state.
    pub fn allowed_prefix(&mut self, draft: &[u32]) -> usize {
        let in_vocab = draft.iter().take_while(|&&t| (t as usize) < self.vocab).count();
        self.matcher.validate_tokens(&draft[..in_vocab]).unwrap_or(0)
    }

    /// Masks verification rows in place: row `i` (`0..=draft.len()`) gets −∞ wherever the
    /// grammar forbids a token after the first `i` draft tokens. Rows after a forbidden draft
    /// token are left as they are: the verifier rejects that token first and never reads them.
    /// The grammar state is unchanged afterwards.
    pub fn mask_rows<R: AsMut<[f32]>>(&mut self, rows: &mut [R], draft: &[u32]) -> Result<()> {
        let mut consumed = 0;
        let mut result = Ok(());
        for (i, row) in rows.iter_mut().enumerate() {
            if let Err(e) = self.mask_row(row.as_mut()) {
                result = Err(e);
                break;
            }
            let Some(&d) = draft.get(i) else { break };
            let row = row.as_mut();
            if !row.get(d as usize).is_some_and(|&l| l > f32::NEG_INFINITY) || self.matcher.consume_token(d).is_err() {
                break;
            }
            consumed += 1;
        }
        if consumed > 0 {
            self.matcher.rollback(consumed).map_err(|e| anyhow!("grammar rollback: {e}"))?;
        }
        result
    }

    /// [`Self::mask_rows`] for a draft tree: row 0 in the current state, the row of node `i`
    /// (row `i + 1`, whose parent row is `parents[i + 1]`) after the tokens on its path.
    /// Rows below a forbidden token are left as they are (the verifier never reaches them).
    /// The grammar state is unchanged afterwards.
    pub fn mask_tree_rows<R: AsMut<[f32]>>(&mut self, rows: &mut [R], tokens: &[u32], parents: &[u32]) -> Result<()> {
        let mut path = Vec::new();
        for (r, row) in rows.iter_mut().enumerate() {
            crate::kv::tree_path(parents, r, &mut path);
            // The tokens of the nodes on the path (row 0 is the committed state).
            let mut consumed = 0;
            let reachable = path[1..].iter().all(|&pr| {
                let ok = self.matcher.consume_token(tokens[pr - 1]).is_ok();
                consumed += usize::from(ok);
                ok
            });
            let masked = if reachable { self.mask_row(row.as_mut()) } else { Ok(()) };
            if consumed > 0 {
                self.matcher.rollback(consumed).map_err(|e| anyhow!("grammar rollback: {e}"))?;
            }
            masked?;
        }
        Ok(())
    }

    /// Forbidden tokens of one row to −∞; where the grammar may end, every stop token stays.
    fn mask_row(&mut self, row: &mut [f32]) -> Result<()> {
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| anyhow!("grammar: {e}"))?;
        let eos_allowed = self.stop_ids.iter().any(|&s| mask.is_allowed(s));
        for (t, l) in row.iter_mut().enumerate() {
            let t = t as u32;
            if !(mask.is_allowed(t) || (eos_allowed && self.stop_ids.contains(&t))) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances the grammar over tokens the request committed (a stop token ends it).
    pub fn commit(&mut self, tokens: &[u32]) -> Result<()> {
        for &t in tokens {
            if self.stop_ids.contains(&t) || self.matcher.is_stopped() {
                break;
            }
            self.matcher.consume_token(t).map_err(|e| anyhow!("grammar: token {t} does not fit: {e}"))?;
        }
        Ok(())
    }
}
