//! The drafter's output vocabulary: the target tokens it can draft. A reduced vocabulary (the
//! N most frequent response tokens of the training mix) makes the drafter's LM head cheaper;
//! a token outside it can never be drafted, so what matters is how much of the answers it
//! covers, and that is logged for every run.

use super::examples::TrainExample;
use std::collections::BTreeMap;

/// The `n` most frequent response tokens (ties: lower id first), sorted by id.
pub fn frequent_tokens(examples: &[TrainExample], vocab: usize, n: usize) -> Vec<u32> {
    let mut counts = vec![0u64; vocab];
    for e in examples {
        for (&t, &m) in e.tokens.iter().zip(&e.loss_mask) {
            if m == 1 && (t as usize) < vocab {
                counts[t as usize] += 1;
            }
        }
    }
    let mut ids: Vec<u32> = (0..vocab as u32).collect();
    ids.sort_by_key(|&id| (std::cmp::Reverse(counts[id as usize]), id));
    ids.truncate(n.min(vocab));
    ids.sort_unstable();
    ids
}

/// Response tokens covered by a vocabulary, per prompt set (the part of the key before `/`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Coverage {
    /// Set → (covered, total) response tokens.
    pub sets: BTreeMap<String, (u64, u64)>,
}

impl Coverage {
    /// `ids`: the vocabulary (sorted target ids); None: the target's whole vocabulary.
    pub fn of<'e>(examples: impl IntoIterator<Item = &'e TrainExample>, ids: Option<&[u32]>, vocab: usize) -> Self {
        let mut member = vec![ids.is_none(); vocab];
        for &t in ids.unwrap_or(&[]) {
            if let Some(m) = member.get_mut(t as usize) {
                *m = true;
            }
        }
        let mut sets: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        for e in examples {
            let set = e.key.split('/').next().unwrap_or("").to_string();
            let slot = sets.entry(set).or_default();
            for (&t, &m) in e.tokens.iter().zip(&e.loss_mask) {
                if m == 1 {
                    slot.1 += 1;
                    slot.0 += member.get(t as usize).copied().unwrap_or(false) as u64;
                }
            }
        }
        Self { sets }
    }

    pub fn total(&self) -> f64 {
        let (c, t) = self.sets.values().fold((0, 0), |(c, t), (a, b)| (c + a, t + b));
        c as f64 / t.max(1) as f64
    }

    /// `92.1% (sharegpt 93.0%, codeio-completion 89.2%)`.
    pub fn describe(&self) -> String {
        let per: Vec<String> =
            self.sets.iter().map(|(s, (c, t))| format!("{s} {:.1}%", 100.0 * *c as f64 / (*t).max(1) as f64)).collect();
        format!("{:.1}% ({})", 100.0 * self.total(), per.join(", "))
    }
}

/// Where each token of `new` sits in `old` (both sorted target ids): `Some(row)` for tokens
/// the two vocabularies share, so a drafter's per-token rows can be carried over.
pub fn shared_rows(old: &[u32], new: &[u32]) -> Vec<Option<usize>> {
    new.iter().map(|t| old.binary_search(t).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(key: &str, tokens: &[u32], mask: &[u8]) -> TrainExample {
        TrainExample { key: key.into(), prompt_hash: 0, tokens: tokens.to_vec(), loss_mask: mask.to_vec(), source: 0 }
    }

    #[test]
    fn coverage_counts_response_tokens_per_set() {
        let e = [ex("a/1", &[9, 1, 2, 3], &[0, 1, 1, 1]), ex("b/1", &[1, 4, 4], &[0, 1, 1])];
        let c = Coverage::of(&e, Some(&[1, 2, 4]), 10);
        assert_eq!(c.sets["a"], (2, 3));
        assert_eq!(c.sets["b"], (2, 2));
        assert!((c.total() - 0.8).abs() < 1e-12);
        assert_eq!(Coverage::of(&e, None, 10).total(), 1.0);
        // Token 4 twice, then the lowest id of the ties.
        assert_eq!(frequent_tokens(&e, 10, 2), vec![1, 4]);
        assert_eq!(shared_rows(&[1, 2, 4], &[2, 3, 4]), vec![Some(1), None, Some(2)]);
    }
}
