//! N-gram prompt-lookup proposer: no model. The sequence's own prompt and output are the
//! drafter. Find the most recent earlier occurrence of the sequence's last n tokens (longest n
//! first, from `max_ngram` down to `min_ngram`) and propose the tokens that followed it.
//!
//! The lookup is an index from every n-gram (n in `min_ngram..=max_ngram`) to the position of
//! its most recent occurrence that is followed by at least one token. It grows with the committed
//! tokens, so a step costs O(max_ngram + draft) instead of a scan over the whole sequence.

use super::proposer::Proposer;
use super::verify::Draft;
use anyhow::{bail, Result};
use candle_core::Tensor;
use std::collections::HashMap;
use std::ops::Range;

/// Longest n-gram accepted by [`NgramProposer::new`] (long keys rarely match and cost hashing).
pub const MAX_NGRAM_LIMIT: usize = 16;

/// Distinct continuations a draft tree holds, and the nodes each one after the first gets.
const TREE_CONTINUATIONS: usize = 3;
const TREE_BRANCH_NODES: usize = 2;

pub struct NgramProposer {
    min_ngram: usize,
    max_ngram: usize,
    /// The tokens indexed so far (a copy of the committed sequence's prefix).
    seen: Vec<u32>,
    /// `index[n - min_ngram]`: hash of an n-gram → start of its most recent occurrence in
    /// `seen` that has a following token. Hash collisions are caught by comparing tokens.
    index: Vec<HashMap<u64, u32>>,
    /// Draft trees of several matches' continuations ([`Proposer::set_trees`]).
    trees: bool,
}

impl NgramProposer {
    /// Matches n-grams of `min_ngram..=max_ngram` tokens, preferring the longest.
    pub fn new(min_ngram: usize, max_ngram: usize) -> Result<Self> {
        if min_ngram == 0 || min_ngram > max_ngram || max_ngram > MAX_NGRAM_LIMIT {
            bail!("n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram}) <= {MAX_NGRAM_LIMIT}");
        }
        Ok(Self {
            min_ngram,
            max_ngram,
            seen: Vec::new(),
            index: vec![HashMap::new(); max_ngram - min_ngram + 1],
            trees: false,
        })
    }

    fn hash(gram: &[u32]) -> u64 {
        // FxHash-style mixing: fast, and good enough since every hit is verified.
        let mut h = gram.len() as u64;
        for &t in gram {
            h = (h.rotate_left(5) ^ t as u64).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
        h
    }

    /// Brings the index up to `tokens`. Committed tokens only grow within a sequence; anything
    /// else (a new sequence without `begin`) rebuilds from scratch.
    fn sync(&mut self, tokens: &[u32]) {
        let consistent = tokens.len() >= self.seen.len() && tokens[..self.seen.len()] == self.seen[..];
        if !consistent {
            self.seen.clear();
            self.index.iter_mut().for_each(HashMap::clear);
        }
        let old_len = self.seen.len();
        self.seen.extend_from_slice(&tokens[old_len..]);
        // An occurrence at `start` of length n is indexable once a token follows it:
        // start + n < len. Newly indexable ones have start + n in [old_len, new_len).
        let new_len = self.seen.len();
        for (slot, n) in (self.min_ngram..=self.max_ngram).enumerate() {
            let first = old_len.saturating_sub(n);
            for start in first..new_len.saturating_sub(n) {
                let h = Self::hash(&self.seen[start..start + n]);
                self.index[slot].insert(h, start as u32);
            }
        }
    }

    /// The draft for the current `seen`: the continuation of the longest, most recent match.
    fn lookup(&self, max_len: usize) -> Vec<u32> {
        self.continuations(max_len, 1).pop().unwrap_or_default()
    }

    /// Up to `most` distinct continuations, from the most recent match of each suffix length,
    /// longest first; each `max_len` tokens long.
    fn continuations(&self, max_len: usize, most: usize) -> Vec<Vec<u32>> {
        let mut found: Vec<Vec<u32>> = Vec::new();
        let len = self.seen.len();
        for n in (self.min_ngram..=self.max_ngram).rev() {
            if found.len() == most {
                break;
            }
            if n > len {
                continue;
            }
            let suffix = &self.seen[len - n..];
            let Some(&start) = self.index[n - self.min_ngram].get(&Self::hash(suffix)) else {
                continue;
            };
            let start = start as usize;
            if self.seen[start..start + n] != *suffix {
                continue; // hash collision
            }
            // Copy what followed the match. The copy may run into the suffix itself (a
            // repeating pattern): continue with the tokens drafted so far, like an
            // overlapping LZ77 copy, so a loop of period p drafts beyond p tokens.
            let from = start + n;
            let mut draft = Vec::with_capacity(max_len);
            for i in 0..max_len {
                let at = from + i;
                let t = if at < len { self.seen[at] } else { draft[at - len] };
                draft.push(t);
            }
            if !found.contains(&draft) {
                found.push(draft);
            }
        }
        found
    }

    /// A tree of the distinct continuations of the longest matches: the longest match's gets
    /// half of the nodes or more, the others share the rest (a shared start is one path).
    fn lookup_tree(&self, max_nodes: usize) -> Draft {
        let found = self.continuations(max_nodes, TREE_CONTINUATIONS);
        let others = found.len().saturating_sub(1);
        let main = max_nodes.saturating_sub(others * TREE_BRANCH_NODES).max(max_nodes.div_ceil(2));
        let mut tokens: Vec<u32> = Vec::new();
        let mut parents: Vec<u32> = Vec::new();
        for (i, continuation) in found.iter().enumerate() {
            let mut take = if i == 0 { main } else { TREE_BRANCH_NODES };
            let mut row = 0u32;
            for &t in continuation {
                if take == 0 || tokens.len() == max_nodes {
                    break;
                }
                // Follow a path already in the tree, else branch off it.
                match (0..tokens.len()).find(|&n| parents[n] == row && tokens[n] == t) {
                    Some(n) => row = n as u32 + 1,
                    None => {
                        tokens.push(t);
                        parents.push(row);
                        row = tokens.len() as u32;
                        take -= 1;
                    }
                }
            }
        }
        Draft::tree(tokens, parents)
    }
}

impl Proposer for NgramProposer {
    fn name(&self) -> &str {
        "ngram"
    }

    fn begin(&mut self, prompt: &[u32]) -> Result<()> {
        self.seen.clear();
        self.index.iter_mut().for_each(HashMap::clear);
        self.sync(prompt);
        Ok(())
    }

    fn observe(&mut self, _tokens: &[u32], _cached: Range<usize>, _taps: &[Tensor]) -> Result<()> {
        // Only committed tokens are ever indexed (at propose time), so a rejected draft
        // leaves nothing behind.
        Ok(())
    }

    fn set_trees(&mut self, on: bool) -> bool {
        self.trees = on;
        true
    }

    fn propose(&mut self, tokens: &[u32], max_len: usize) -> Result<Draft> {
        self.sync(tokens);
        if self.trees {
            return Ok(self.lookup_tree(max_len));
        }
        Ok(Draft::deterministic(self.lookup(max_len)))
    }

    fn has_draft(&mut self, tokens: &[u32]) -> Option<bool> {
        self.sync(tokens);
        Some(!self.lookup(1).is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(p: &mut NgramProposer, tokens: &[u32], k: usize) -> Vec<u32> {
        p.propose(tokens, k).unwrap().tokens
    }

    /// The reference: a plain backwards scan for the longest, most recent match.
    fn brute_force(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (min_n..=max_n).rev() {
            if n > len {
                continue;
            }
            let suffix = &tokens[len - n..];
            for start in (0..len - n).rev() {
                if &tokens[start..start + n] == suffix {
                    let mut ext = tokens.to_vec();
                    for i in 0..k {
                        let t = ext[start + n + i];
                        ext.push(t);
                    }
                    return ext[len..].to_vec();
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn proposes_what_followed_the_longest_most_recent_match() {
        let mut p = NgramProposer::new(1, 3).unwrap();
        // "5 6 7" occurs twice; the most recent earlier occurrence is followed by 9 10.
        let tokens = [1, 5, 6, 7, 8, 2, 5, 6, 7, 9, 10, 3, 4, 5, 6, 7];
        p.begin(&tokens).unwrap();
        assert_eq!(propose(&mut p, &tokens, 2), vec![9, 10]);
        // Longest wins over more recent shorter matches: suffix "4 7" has no 2-gram match,
        // so the unigram "7" (most recent: followed by 9) decides.
        let tokens2 = [7, 1, 2, 7, 9, 4, 7];
        assert_eq!(propose(&mut NgramProposer::new(1, 3).unwrap(), &tokens2, 1), vec![9]);
        // A 3-gram match beats a more recent unigram match.
        let tokens3 = [1, 2, 3, 50, 9, 3, 60, 1, 2, 3];
        assert_eq!(propose(&mut NgramProposer::new(1, 3).unwrap(), &tokens3, 2), vec![50, 9]);
    }

    #[test]
    fn no_match_proposes_nothing_and_min_ngram_is_respected() {
        let mut p = NgramProposer::new(2, 3).unwrap();
        assert!(propose(&mut p, &[1, 2, 3, 4], 4).is_empty());
        // Only a unigram match exists ("3"), below min_ngram = 2.
        assert!(propose(&mut p, &[3, 9, 5, 3], 4).is_empty());
        assert!(propose(&mut NgramProposer::new(1, 1).unwrap(), &[3, 9, 5, 3], 4) == vec![9, 5, 3, 9]);
        assert!(propose(&mut p, &[7], 3).is_empty());
    }

    #[test]
    fn repeating_pattern_drafts_past_its_period() {
        let mut p = NgramProposer::new(1, 3).unwrap();
        let tokens = [4, 1, 2, 1, 2, 1, 2];
        assert_eq!(propose(&mut p, &tokens, 5), vec![1, 2, 1, 2, 1]);
        // A run of one token continues the run.
        assert_eq!(propose(&mut NgramProposer::new(1, 3).unwrap(), &[8, 8, 8], 4), vec![8, 8, 8, 8]);
    }

    #[test]
    fn incremental_index_matches_a_brute_force_scan() {
        // Small alphabet so matches of every length are common; the index grows step by step
        // as in decoding (a few committed tokens per step) and must agree with a full scan.
        let mut rng = crate::sample::SamplerRng::from_seed(7);
        for (min_n, max_n) in [(1, 3), (2, 4), (1, 1), (3, 5)] {
            let mut p = NgramProposer::new(min_n, max_n).unwrap();
            let mut tokens: Vec<u32> = (0..5).map(|_| (rng.next_u64() % 4) as u32).collect();
            p.begin(&tokens).unwrap();
            for _ in 0..300 {
                let k = (rng.next_u64() % 6) as usize;
                assert_eq!(propose(&mut p, &tokens, k), brute_force(&tokens, min_n, max_n, k), "{tokens:?}");
                for _ in 0..=(rng.next_u64() % 3) {
                    tokens.push((rng.next_u64() % 4) as u32);
                }
            }
        }
    }

    #[test]
    fn a_different_sequence_rebuilds_the_index() {
        let mut p = NgramProposer::new(1, 2).unwrap();
        assert_eq!(propose(&mut p, &[1, 2, 3, 1], 2), vec![2, 3]);
        // Not an extension of the previous tokens: nothing of them may leak into the lookup.
        assert!(propose(&mut p, &[9, 1], 2).is_empty());
        assert_eq!(propose(&mut p, &[9, 1, 9], 1), vec![1]);
    }

    #[test]
    fn a_tree_holds_the_continuations_of_several_matches() {
        let mut p = NgramProposer::new(1, 3).unwrap();
        assert!(p.set_trees(true));
        // "5 6" last continued with 7 8; "6" alone last continued with 9.
        let tokens = [5, 6, 7, 8, 1, 6, 9, 2, 5, 6];
        let d = p.propose(&tokens, 6).unwrap();
        assert!(d.is_tree());
        assert_eq!(d.children()[0].len(), 2, "two first tokens: {d:?}");
        assert_eq!(d.path_tokens(0)[0], 7, "the longest match's continuation ranks first");
        assert!(d.tokens.contains(&9));
        assert!(d.len() <= 6);
        // A single match is a chain.
        let mut p = NgramProposer::new(2, 2).unwrap();
        p.set_trees(true);
        assert!(!p.propose(&[1, 2, 3, 1, 2], 3).unwrap().is_tree());
    }

    #[test]
    fn rejects_bad_sizes() {
        assert!(NgramProposer::new(0, 3).is_err());
        assert!(NgramProposer::new(3, 2).is_err());
        assert!(NgramProposer::new(1, MAX_NGRAM_LIMIT + 1).is_err());
    }
}
