//! Suffix decoding: a drafter with no model that remembers text. Two truncated suffix trees
//! (see [`trie`]) answer "what followed this context before, and how often": one over the
//! request's own prompt and output, extended as tokens commit, and one shared by recent
//! requests of the same scope ([`cache`]). Each step the longest suffixes of the context are
//! matched in both, and the speculation tree below each match is scored by how often its
//! paths continued; the best-scoring one is the draft. Its size grows with the match length
//! (at most `factor` × the match length nodes), since a long match predicts further.
//!
//! A draft's match length says how far to trust it, so the drafter presents itself to the
//! draft planner as three sources, long, medium and short matches, each with acceptance
//! statistics of its own.

pub mod cache;
pub mod trie;

use super::proposer::Proposer;
use super::verify::Draft;
use super::MAX_DRAFT;
use anyhow::{bail, Context, Result};
use cache::SuffixCache;
use candle_core::Tensor;
use std::ops::Range;
use std::sync::Arc;
use trie::SuffixTrie;

/// Depth of the suffix trees: the longest match plus its continuation.
pub const DEFAULT_DEPTH: usize = 24;

/// Match lengths from which a draft counts as long (source 0) or medium (source 1).
const LONG_MATCH: usize = 8;
const MEDIUM_MATCH: usize = 4;
/// Sources the drafter presents to the planner: long, medium and short matches.
pub const SOURCES: usize = 3;

/// Drafting settings of `suffix[:depth=N][,min-match=N][,factor=F][,min-prob=P][,prompts=on|off]`.
#[derive(Debug, Clone, PartialEq)]
pub struct SuffixSettings {
    /// Depth of the request's own tree (the shared one's is the cache's).
    pub depth: usize,
    /// Shortest context match that drafts: what follows a single token is too seldom right
    /// (as for prompt lookup) to pay for verifying it on a CPU.
    pub min_match: usize,
    /// Nodes per matched token at most.
    pub factor: f64,
    /// Nodes whose path is estimated less likely than this are not drafted.
    pub min_prob: f64,
    /// Whether a finished request's prompt joins the shared cache, or only its output.
    pub prompts: bool,
}

impl Default for SuffixSettings {
    fn default() -> Self {
        Self { depth: DEFAULT_DEPTH, min_match: 2, factor: 1.0, min_prob: 0.1, prompts: true }
    }
}

/// Parses the options after `suffix:`.
pub fn parse_settings(arg: &str) -> Result<SuffixSettings> {
    let mut s = SuffixSettings::default();
    for opt in arg.split(',').filter(|o| !o.is_empty()) {
        let (key, value) = opt.split_once('=').with_context(|| format!("suffix option `{opt}` needs a value"))?;
        let bad = || format!("suffix option `{opt}`");
        match key {
            "depth" => {
                s.depth = value
                    .parse()
                    .ok()
                    .filter(|d| (2..=64).contains(d))
                    .with_context(|| format!("{}: depth in 2..=64", bad()))?
            }
            "min-match" => {
                s.min_match = value
                    .parse()
                    .ok()
                    .filter(|m| (1..=16).contains(m))
                    .with_context(|| format!("{}: min-match in 1..=16", bad()))?
            }
            "factor" => {
                s.factor = value
                    .parse()
                    .ok()
                    .filter(|f: &f64| (0.1..=16.0).contains(f))
                    .with_context(|| format!("{}: factor in 0.1..=16", bad()))?
            }
            "min-prob" => {
                s.min_prob = value
                    .parse()
                    .ok()
                    .filter(|p: &f64| (0.0..=1.0).contains(p))
                    .with_context(|| format!("{}: min-prob in 0..=1", bad()))?
            }
            "prompts" => {
                s.prompts = match value {
                    "on" => true,
                    "off" => false,
                    _ => bail!("{}: prompts=on or prompts=off", bad()),
                }
            }
            _ => bail!("unknown suffix option `{key}` (depth, min-match, factor, min-prob, prompts)"),
        }
    }
    Ok(s)
}

pub fn label(s: &SuffixSettings) -> String {
    let d = SuffixSettings::default();
    let mut opts = Vec::new();
    if s.depth != d.depth {
        opts.push(format!("depth={}", s.depth));
    }
    if s.min_match != d.min_match {
        opts.push(format!("min-match={}", s.min_match));
    }
    if s.factor != d.factor {
        opts.push(format!("factor={}", s.factor));
    }
    if s.min_prob != d.min_prob {
        opts.push(format!("min-prob={}", s.min_prob));
    }
    if !s.prompts {
        opts.push("prompts=off".into());
    }
    if opts.is_empty() {
        "suffix".into()
    } else {
        format!("suffix:{}", opts.join(","))
    }
}

/// The best speculation found for the current context, at the largest budget: the planner
/// asks about the match before it chooses a length, and a best-first draft cut to fewer nodes
/// is the best-first draft of that size.
#[derive(Debug, Clone, Default)]
struct Speculation {
    /// Tokens the context had when it was computed, and the shape asked for.
    for_len: usize,
    tree: bool,
    match_len: usize,
    draft: Draft,
}

pub struct SuffixProposer {
    settings: SuffixSettings,
    local: SuffixTrie,
    local_root: u32,
    /// The tokens indexed in `local` (the committed sequence so far).
    seen: Vec<u32>,
    prompt_len: usize,
    shared: Option<(Arc<SuffixCache>, u64)>,
    trees: bool,
    last: Option<Speculation>,
}

impl SuffixProposer {
    /// `shared`: the cache of recent requests and this request's scope in it (None: only the
    /// request's own text).
    pub fn new(settings: SuffixSettings, shared: Option<(Arc<SuffixCache>, u64)>) -> Self {
        let mut local = SuffixTrie::new(settings.depth);
        let local_root = local.new_root();
        Self { settings, local, local_root, seen: Vec::new(), prompt_len: 0, shared, trees: false, last: None }
    }

    /// Forgets the request's own text.
    fn reset(&mut self) {
        self.local = SuffixTrie::new(self.settings.depth);
        self.local_root = self.local.new_root();
        self.seen.clear();
        self.last = None;
    }

    fn sync(&mut self, tokens: &[u32]) {
        let extends = tokens.len() >= self.seen.len() && tokens[..self.seen.len()] == self.seen[..];
        if !extends {
            self.reset();
        }
        let from = self.seen.len();
        if from < tokens.len() {
            self.local.extend(self.local_root, tokens, from);
            self.seen.extend_from_slice(&tokens[from..]);
        }
    }

    /// The best-scoring speculation for `tokens` of up to [`MAX_DRAFT`] nodes, over every
    /// match length in both trees.
    fn speculate(&mut self, tokens: &[u32]) -> &Speculation {
        let max_len = MAX_DRAFT;
        let fresh = self.last.as_ref().is_some_and(|s| s.for_len == tokens.len() && s.tree == self.trees);
        if fresh {
            return self.last.as_ref().unwrap();
        }
        self.sync(tokens);
        let mut best = (0.0f64, 0usize, Vec::new());
        let min_match = self.settings.min_match;
        let mut consider = |trie: &SuffixTrie, root: u32, own: bool| {
            let longest = tokens.len().min(trie.max_depth() - 1);
            for m in 1..=longest {
                let Some(node) = trie.find(root, &tokens[tokens.len() - m..]) else { break };
                if m < min_match {
                    continue;
                }
                // In the request's own tree the context's own occurrence has no continuation yet.
                let seen = trie.count(node).saturating_sub(u32::from(own));
                if seen == 0 {
                    continue;
                }
                let budget = max_len.min((self.settings.factor * m as f64).ceil() as usize);
                let c = trie.speculate(node, m, seen, budget, self.settings.min_prob, self.trees);
                let score: f64 = c.iter().map(|c| c.score).sum();
                if score > best.0 || (score == best.0 && m > best.1 && score > 0.0) {
                    best = (score, m, c);
                }
            }
        };
        consider(&self.local, self.local_root, true);
        if let Some((cache, scope)) = &self.shared {
            let s = cache.read();
            if let Some(root) = s.root(*scope) {
                consider(s.trie(), root, false);
            }
        }
        let (_, match_len, c) = best;
        let draft = Draft::tree(c.iter().map(|c| c.token).collect(), c.iter().map(|c| c.parent_row).collect());
        self.last.insert(Speculation { for_len: tokens.len(), tree: self.trees, match_len, draft })
    }
}

impl Proposer for SuffixProposer {
    fn name(&self) -> &str {
        "suffix"
    }

    fn sources(&self) -> usize {
        SOURCES
    }

    fn next_source(&mut self, tokens: &[u32]) -> usize {
        match self.speculate(tokens).match_len {
            m if m >= LONG_MATCH => 0,
            m if m >= MEDIUM_MATCH => 1,
            _ => 2,
        }
    }

    fn has_draft(&mut self, tokens: &[u32]) -> Option<bool> {
        Some(!self.speculate(tokens).draft.is_empty())
    }

    fn set_trees(&mut self, on: bool) -> bool {
        self.trees = on;
        true
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.reset();
        self.sync(prompt);
        self.prompt_len = prompt.len();
        Ok(())
    }

    fn observe(&mut self, tokens: &[u32], _cached: Range<usize>, _taps: &[Tensor]) -> Result<()> {
        // Only committed tokens are indexed, so a rejected draft leaves nothing behind.
        self.sync(tokens);
        Ok(())
    }

    fn propose(&mut self, tokens: &[u32], max_len: usize) -> Result<Draft> {
        if max_len == 0 {
            return Ok(Draft::default());
        }
        let mut draft = self.speculate(tokens).draft.clone();
        draft.truncate(max_len);
        Ok(draft)
    }
}

impl Drop for SuffixProposer {
    /// The finished request's text joins the shared cache.
    fn drop(&mut self) {
        if let Some((cache, scope)) = &self.shared {
            let from = if self.settings.prompts { 0 } else { self.prompt_len.min(self.seen.len()) };
            cache.insert(*scope, &self.seen[from..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::cache::{SuffixCacheConfig, SuffixScope};
    use super::*;

    fn propose(p: &mut SuffixProposer, tokens: &[u32], k: usize) -> Vec<u32> {
        p.propose(tokens, k).unwrap().tokens
    }

    #[test]
    fn drafts_what_followed_the_longest_match_in_the_request() {
        let mut p = SuffixProposer::new(SuffixSettings::default(), None);
        let prompt = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3];
        p.begin(&prompt).unwrap();
        // [1, 2, 3] matched (3 tokens): up to 3 nodes, what followed it.
        assert_eq!(propose(&mut p, &prompt, 8), [4, 5, 6]);
        assert_eq!(p.next_source(&prompt), 2);
        // Nothing to match: no draft.
        let fresh = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3, 77];
        assert!(propose(&mut p, &fresh, 8).is_empty());
        assert_eq!(p.has_draft(&fresh), Some(false));
    }

    #[test]
    fn finished_requests_teach_later_ones_in_the_same_scope_only() {
        let cache = Arc::new(SuffixCache::new(SuffixCacheConfig {
            max_bytes: 1 << 20,
            scope: SuffixScope::ApiKey,
            max_depth: DEFAULT_DEPTH,
        }));
        let alice = cache.scope_of(Some("alice")).unwrap();
        let bob = cache.scope_of(Some("bob")).unwrap();
        let answer: Vec<u32> = (100..130).collect();
        {
            let mut p = SuffixProposer::new(SuffixSettings::default(), Some((cache.clone(), alice)));
            p.begin(&[1, 2]).unwrap();
            let mut tokens = vec![1, 2];
            tokens.extend(&answer);
            p.observe(&tokens, 0..tokens.len(), &[]).unwrap();
        }
        let context = [7, 8, 100, 101, 102, 103, 104, 105, 106, 107, 108];
        let mut later = SuffixProposer::new(SuffixSettings::default(), Some((cache.clone(), alice)));
        later.begin(&context).unwrap();
        assert_eq!(later.next_source(&context), 0, "a 9-token match is long");
        assert_eq!(propose(&mut later, &context, 5), [109, 110, 111, 112, 113]);
        let mut other = SuffixProposer::new(SuffixSettings::default(), Some((cache.clone(), bob)));
        other.begin(&context).unwrap();
        assert!(propose(&mut other, &context, 5).is_empty());
    }

    #[test]
    fn trees_hold_the_other_continuations() {
        let mut p = SuffixProposer::new(SuffixSettings { min_prob: 0.05, factor: 4.0, ..Default::default() }, None);
        // After [5, 6]: 7 three times, 9 twice.
        let prompt = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7, 4, 5, 6, 9, 3, 5, 6, 9, 8, 5, 6];
        p.begin(&prompt).unwrap();
        assert_eq!(propose(&mut p, &prompt, 8)[0], 7);
        p.set_trees(true);
        let d = p.propose(&prompt, 8).unwrap();
        assert!(d.is_tree(), "{d:?}");
        let firsts: Vec<u32> = (0..d.len()).filter(|&i| d.parent_row(i) == 0).map(|i| d.tokens[i]).collect();
        assert_eq!(firsts, [7, 9]);
    }

    #[test]
    fn settings_parse_and_label() {
        assert_eq!(parse_settings("").unwrap(), SuffixSettings::default());
        let s = parse_settings("depth=16,min-match=3,factor=2,min-prob=0.2,prompts=off").unwrap();
        assert_eq!((s.depth, s.min_match, s.factor, s.min_prob, s.prompts), (16, 3, 2.0, 0.2, false));
        assert_eq!(label(&s), "suffix:depth=16,min-match=3,factor=2,min-prob=0.2,prompts=off");
        for bad in ["depth=1", "depth=x", "min-match=0", "factor=0", "min-prob=2", "prompts=maybe", "nope=1", "depth"] {
            assert!(parse_settings(bad).is_err(), "{bad}");
        }
    }
}
