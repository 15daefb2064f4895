//! The suffix drafter's memory across requests: one truncated suffix tree over the text of
//! recent requests, a root per scope, bounded in bytes. When a request ends its text is
//! added; the oldest whole sequences are evicted to make room.
//!
//! Scopes keep one caller's text out of another's drafts. Drafts never change outputs (the
//! verifier is lossless), but how fast a request runs tells how well its text was predicted,
//! so a cache shared between callers can hint at what another wrote.
//!
//! The cache is written to disk only when asked ([`SuffixCache::save`], atomically), and a
//! file is read like any untrusted input: every length is checked against what is left of
//! the file, every token against the vocabulary, and a checksum covers the whole.

use super::trie::{SuffixTrie, BYTES_PER_NODE};
use anyhow::{bail, ensure, Context, Result};
use sha2::{Digest, Sha256};
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{RwLock, RwLockReadGuard};

/// Whose text a request's drafts may come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SuffixScope {
    /// Every request's: the most reuse, and the weakest isolation.
    Global,
    /// Requests sent with the same API key (`Authorization: Bearer`), and requests without
    /// one among themselves.
    #[default]
    ApiKey,
    /// The request's own prompt and output only: nothing is shared or kept.
    Request,
}

impl SuffixScope {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "global" => Self::Global,
            "api-key" => Self::ApiKey,
            "request" => Self::Request,
            other => bail!("--suffix-scope must be global, api-key or request, not `{other}`"),
        })
    }
}

/// Default budget of the shared cache.
pub const DEFAULT_CACHE_MB: usize = 64;

#[derive(Debug, Clone, PartialEq)]
pub struct SuffixCacheConfig {
    pub max_bytes: usize,
    pub scope: SuffixScope,
    /// Depth of the suffix tree: the longest context match plus continuation it holds.
    pub max_depth: usize,
}

impl Default for SuffixCacheConfig {
    fn default() -> Self {
        Self { max_bytes: DEFAULT_CACHE_MB << 20, scope: SuffixScope::default(), max_depth: super::DEFAULT_DEPTH }
    }
}

#[derive(Debug)]
pub struct SuffixCache {
    config: SuffixCacheConfig,
    inner: RwLock<Shared>,
}

/// The tree and what is in it, behind the cache's lock.
#[derive(Debug)]
pub struct Shared {
    trie: SuffixTrie,
    roots: HashMap<u64, u32>,
    /// Indexed sequences, oldest first, with their scope: eviction replays them.
    sequences: VecDeque<(u64, Vec<u32>)>,
    stored_tokens: usize,
    pub evicted_sequences: u64,
}

impl Shared {
    pub fn trie(&self) -> &SuffixTrie {
        &self.trie
    }

    pub fn root(&self, scope: u64) -> Option<u32> {
        self.roots.get(&scope).copied()
    }

    pub fn sequences(&self) -> usize {
        self.sequences.len()
    }

    /// Bytes the cache holds: its tree's nodes and the sequences kept for eviction.
    pub fn bytes(&self) -> usize {
        self.trie.live_nodes() * BYTES_PER_NODE + self.stored_tokens * 4
    }

    fn bytes_for(&self, tokens: usize) -> usize {
        self.trie.nodes_for(tokens) * BYTES_PER_NODE + tokens * 4
    }

    fn evict_oldest(&mut self) -> bool {
        let Some((scope, tokens)) = self.sequences.pop_front() else { return false };
        if let Some(&root) = self.roots.get(&scope) {
            self.trie.remove(root, &tokens);
            if self.trie.is_empty_root(root) {
                self.trie.free_root(root);
                self.roots.remove(&scope);
            }
        }
        self.stored_tokens -= tokens.len();
        self.evicted_sequences += 1;
        true
    }
}

/// The scope key of a caller's API key (none: the key of requests without one). A digest, so
/// that neither memory nor a cache file holds the key itself.
pub fn api_key_scope(key: Option<&str>) -> u64 {
    match key {
        None => 1,
        Some(k) => {
            let d = Sha256::digest(format!("specula suffix scope\0{k}").as_bytes());
            u64::from_le_bytes(d[..8].try_into().unwrap()) | 2
        }
    }
}

const MAGIC: &[u8; 8] = b"SPSUFX01";

impl SuffixCache {
    pub fn new(config: SuffixCacheConfig) -> Self {
        let inner = Shared {
            trie: SuffixTrie::new(config.max_depth),
            roots: HashMap::new(),
            sequences: VecDeque::new(),
            stored_tokens: 0,
            evicted_sequences: 0,
        };
        Self { config, inner: RwLock::new(inner) }
    }

    pub fn config(&self) -> &SuffixCacheConfig {
        &self.config
    }

    /// The scope a request's drafts read from and its text goes to; None when nothing is
    /// shared (`request` scope).
    pub fn scope_of(&self, api_key: Option<&str>) -> Option<u64> {
        match self.config.scope {
            SuffixScope::Global => Some(0),
            SuffixScope::ApiKey => Some(api_key_scope(api_key)),
            SuffixScope::Request => None,
        }
    }

    pub fn read(&self) -> RwLockReadGuard<'_, Shared> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds one finished sequence to `scope`, evicting the oldest sequences until it fits. A
    /// sequence larger than the whole budget keeps its last tokens.
    pub fn insert(&self, scope: u64, tokens: &[u32]) {
        if tokens.is_empty() || self.config.max_bytes == 0 {
            return;
        }
        let mut s = self.inner.write().unwrap_or_else(|e| e.into_inner());
        let fit = (self.config.max_bytes / (s.bytes_for(1) + 1)).max(1);
        let tokens = &tokens[tokens.len().saturating_sub(fit)..];
        while s.bytes() + s.bytes_for(tokens.len()) > self.config.max_bytes && s.evict_oldest() {}
        let root = match s.roots.get(&scope) {
            Some(&r) => r,
            None => {
                let r = s.trie.new_root();
                s.roots.insert(scope, r);
                r
            }
        };
        s.trie.extend(root, tokens, 0);
        s.stored_tokens += tokens.len();
        s.sequences.push_back((scope, tokens.to_vec()));
    }

    /// Writes the cache's sequences to `path` atomically (a temporary file renamed over it).
    /// `model` names the vocabulary the tokens belong to; [`Self::load`] checks it.
    pub fn save(&self, path: &Path, model: &str) -> Result<()> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(model.len() as u32).to_le_bytes());
        out.extend_from_slice(model.as_bytes());
        {
            let s = self.read();
            out.extend_from_slice(&(s.sequences.len() as u64).to_le_bytes());
            for (scope, tokens) in &s.sequences {
                out.extend_from_slice(&scope.to_le_bytes());
                out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
                tokens.iter().for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
            }
        }
        let digest = Sha256::digest(&out);
        out.extend_from_slice(&digest);
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, &out).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("renaming {} into place", tmp.display()))
    }

    /// Reads a cache written by [`Self::save`] for the same `model` and a vocabulary of
    /// `vocab` tokens. Anything else is an error that says what is wrong; nothing is kept.
    pub fn load(config: SuffixCacheConfig, path: &Path, model: &str, vocab: usize) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let sequences =
            parse(&bytes, model, vocab).with_context(|| format!("{} is not a usable suffix cache", path.display()))?;
        let cache = Self::new(config);
        for (scope, tokens) in sequences {
            cache.insert(scope, &tokens);
        }
        Ok(cache)
    }
}

fn parse(bytes: &[u8], model: &str, vocab: usize) -> Result<Vec<(u64, Vec<u32>)>> {
    ensure!(bytes.len() >= MAGIC.len() + 32 && bytes.starts_with(MAGIC), "not a suffix cache file");
    let (body, digest) = bytes.split_at(bytes.len() - 32);
    ensure!(Sha256::digest(body).as_slice() == digest, "checksum mismatch (the file is corrupt or truncated)");
    let mut r = Reader { bytes: &body[MAGIC.len()..] };
    let name_len = r.u32()? as usize;
    let name = r.take(name_len)?;
    ensure!(name == model.as_bytes(), "written for model `{}`, not `{model}`", String::from_utf8_lossy(name));
    let count = r.u64()?;
    // Each sequence takes at least 12 bytes: a count beyond that is a lie.
    ensure!(count <= (r.bytes.len() / 12) as u64, "{count} sequences cannot fit in the file");
    let mut sequences = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let scope = r.u64()?;
        let len = r.u32()? as usize;
        ensure!(len <= r.bytes.len() / 4, "a sequence of {len} tokens runs past the end of the file");
        let raw = r.take(len * 4)?;
        let tokens: Vec<u32> = raw.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("token id {bad} is outside the vocabulary of {vocab}");
        }
        sequences.push((scope, tokens));
    }
    ensure!(r.bytes.is_empty(), "{} bytes after the last sequence", r.bytes.len());
    Ok(sequences)
}

struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        ensure!(n <= self.bytes.len(), "the file ends early");
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(max_bytes: usize, scope: SuffixScope) -> SuffixCacheConfig {
        SuffixCacheConfig { max_bytes, scope, max_depth: 8 }
    }

    #[test]
    fn stays_within_its_budget_by_evicting_whole_old_sequences() {
        let cache = SuffixCache::new(config(512 << 10, SuffixScope::Global));
        let mut peak = 0;
        for i in 0..2000u32 {
            let seq: Vec<u32> = (0..40).map(|j| (i * 7 + j * 13) % 5000).collect();
            cache.insert(0, &seq);
            peak = peak.max(cache.read().bytes());
        }
        let s = cache.read();
        assert!(peak <= 512 << 10, "{peak}");
        assert!(s.evicted_sequences > 0 && s.sequences() > 10, "{} kept", s.sequences());
        // What is left is exactly the newest sequences: their text is found, the oldest not.
        let root = s.root(0).unwrap();
        let newest: Vec<u32> = (0..40).map(|j| (1999 * 7 + j * 13) % 5000).collect();
        assert!(s.trie().find(root, &newest[..8]).is_some());
        let oldest: Vec<u32> = (0..40).map(|j| (j * 13) % 5000).collect();
        assert!(s.trie().find(root, &oldest[..8]).is_none());
    }

    #[test]
    fn requests_read_while_others_are_added_from_other_threads() {
        let cache = std::sync::Arc::new(SuffixCache::new(config(256 << 10, SuffixScope::Global)));
        let workers: Vec<_> = (0..4u32)
            .map(|t| {
                let cache = cache.clone();
                std::thread::spawn(move || {
                    let mut found = 0;
                    for i in 0..300u32 {
                        let seq: Vec<u32> = (0..30).map(|j| (t * 1000 + i * 3 + j) % 997).collect();
                        let s = cache.read();
                        found += s.root(0).and_then(|r| s.trie().find(r, &seq[..3])).is_some() as usize;
                        drop(s);
                        cache.insert(0, &seq);
                    }
                    found
                })
            })
            .collect();
        let found: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
        let s = cache.read();
        assert!(found > 0 && s.bytes() <= 256 << 10 && s.evicted_sequences > 0, "{found} {}", s.bytes());
    }

    #[test]
    fn scopes_keep_callers_apart() {
        let cache = SuffixCache::new(config(1 << 20, SuffixScope::ApiKey));
        let (a, b) = (cache.scope_of(Some("key-a")).unwrap(), cache.scope_of(Some("key-b")).unwrap());
        assert_ne!(a, b);
        assert_eq!(cache.scope_of(None), Some(api_key_scope(None)));
        cache.insert(a, &[1, 2, 3, 4]);
        let s = cache.read();
        assert!(s.trie().find(s.root(a).unwrap(), &[2, 3, 4]).is_some());
        assert!(s.root(b).is_none());
        drop(s);
        assert_eq!(SuffixCache::new(config(1 << 20, SuffixScope::Request)).scope_of(Some("key-a")), None);
        assert_eq!(SuffixCache::new(config(1 << 20, SuffixScope::Global)).scope_of(Some("key-a")), Some(0));
    }

    #[test]
    fn a_saved_cache_loads_back_and_a_damaged_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("suffix.cache");
        let cache = SuffixCache::new(config(1 << 20, SuffixScope::ApiKey));
        cache.insert(5, &[10, 11, 12, 13]);
        cache.insert(6, &[20, 21]);
        cache.save(&path, "m").unwrap();
        let loaded = SuffixCache::load(config(1 << 20, SuffixScope::ApiKey), &path, "m", 100).unwrap();
        assert_eq!(loaded.read().sequences(), 2);
        assert!(loaded.read().trie().find(loaded.read().root(5).unwrap(), &[11, 12]).is_some());

        let good = std::fs::read(&path).unwrap();
        let refuse = |bytes: &[u8], model: &str, vocab: usize| {
            std::fs::write(&path, bytes).unwrap();
            format!("{:#}", SuffixCache::load(config(1 << 20, SuffixScope::ApiKey), &path, model, vocab).unwrap_err())
        };
        assert!(refuse(&good, "other", 100).contains("written for model `m`"));
        assert!(refuse(&good, "m", 13).contains("outside the vocabulary"));
        assert!(refuse(&good[..good.len() - 3], "m", 100).contains("checksum"));
        let mut flipped = good.clone();
        flipped[20] ^= 1;
        assert!(refuse(&flipped, "m", 100).contains("checksum"));
        assert!(refuse(b"garbage", "m", 100).contains("not a suffix cache"));
        // A count that claims more than the file holds, with a valid checksum.
        let mut body = good[..good.len() - 32].to_vec();
        body[8 + 4 + 1..8 + 4 + 1 + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let digest = Sha256::digest(&body);
        body.extend_from_slice(&digest);
        assert!(refuse(&body, "m", 100).contains("cannot fit"));
    }
}
