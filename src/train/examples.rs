//! Training examples as both trainers use them, and the deterministic order they are read in:
//! each epoch a shuffle seeded by `(seed, epoch)`, so a resumed run continues exactly.

use super::data::{read_examples, Example};
use anyhow::{bail, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::path::Path;

/// One training example as the trainers use it.
#[derive(Debug, Clone)]
pub struct TrainExample {
    /// `set/id`.
    pub key: String,
    /// A hash of the prompt text (whitespace-normalised): the same prompt under two ids is the
    /// same prompt to the validation split.
    pub prompt_hash: u64,
    pub tokens: Vec<u32>,
    pub loss_mask: Vec<u8>,
    /// Which of the run's data directories it came from (its feature cache is that
    /// directory's).
    pub source: usize,
}

impl TrainExample {
    pub fn from_example(e: &Example, max_tokens: usize, source: usize) -> Self {
        let n = e.tokens.len().min(max_tokens);
        Self {
            key: format!("{}/{}", e.set, e.id),
            prompt_hash: prompt_hash(&e.prompt),
            tokens: e.tokens[..n].to_vec(),
            loss_mask: e.loss_mask[..n].to_vec(),
            source,
        }
    }

    /// Positions that can anchor a draft: response tokens with at least one token after them.
    pub fn anchor_candidates(&self) -> Vec<usize> {
        (0..self.tokens.len().saturating_sub(1)).filter(|&p| self.loss_mask[p] == 1).collect()
    }

    /// The first response position (where serving's first draft starts), if any.
    pub fn first_response(&self) -> Option<usize> {
        self.loss_mask.iter().position(|&m| m == 1)
    }
}

impl super::features::FeatureRequest for TrainExample {
    fn key(&self) -> &str {
        &self.key
    }

    fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    fn source(&self) -> usize {
        self.source
    }
}

fn prompt_hash(text: &str) -> u64 {
    use sha2::Digest;
    let normalised = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let d = sha2::Sha256::digest(normalised.as_bytes());
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
}

/// Reads a `specula train data` directory into examples (cut to `max_tokens`), marked as
/// coming from the run's data directory number `source`.
pub fn load_examples(dir: &Path, max_tokens: usize, source: usize) -> Result<Vec<TrainExample>> {
    let scan = read_examples(dir, false)?;
    let examples: Vec<TrainExample> = scan
        .examples
        .iter()
        .map(|e| TrainExample::from_example(e, max_tokens, source))
        .filter(|e| !e.anchor_candidates().is_empty())
        .collect();
    if examples.is_empty() {
        bail!("{} holds no example with a response to learn from", dir.display());
    }
    Ok(examples)
}

/// Example indices of step `step` (of `n` examples, `b` per step): consecutive slices of
/// per-epoch shuffles.
pub fn batch_indices(n: usize, b: usize, seed: u64, step: usize) -> Vec<usize> {
    // A step spans at most a few epochs' shuffles; each is made once.
    let mut shuffled: Option<(usize, Vec<usize>)> = None;
    (step * b..(step + 1) * b)
        .map(|global| {
            let (epoch, at) = (global / n, global % n);
            if shuffled.as_ref().is_none_or(|(e, _)| *e != epoch) {
                let mut order: Vec<usize> = (0..n).collect();
                order.shuffle(&mut step_rng(seed, 2, epoch as u64));
                shuffled = Some((epoch, order));
            }
            shuffled.as_ref().expect("set above").1[at]
        })
        .collect()
}

/// The random stream `stream` of item `index` (a step, an epoch, a validation example).
pub fn step_rng(seed: u64, stream: u64, index: u64) -> StdRng {
    StdRng::seed_from_u64(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03))
}

/// A standard normal draw (Box–Muller on two uniforms in (0, 1]).
pub fn standard_normal(rng: &mut StdRng) -> f32 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}
