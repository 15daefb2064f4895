//! Rotary position embeddings applied in place on rows of `[heads, head_dim]`.

use super::config::RopeStyle;

pub struct Rope {
    style: RopeStyle,
    rope_dim: usize,
    head_dim: usize,
    /// Inverse frequency per rotated pair.
    inv_freq: Vec<f32>,
}

/// cos/sin of every rotated pair for a list of positions, computed once per forward and
/// shared by all layers.
pub struct RopeTables {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    pub fn new(style: RopeStyle, theta: f32, rope_dim: usize, head_dim: usize) -> Self {
        let inv_freq = (0..rope_dim / 2).map(|i| 1.0 / theta.powf(2.0 * i as f32 / rope_dim as f32)).collect();
        Self { style, rope_dim, head_dim, inv_freq }
    }

    /// Each pair's frequency divided by its divisor (Llama 3's `rope_freqs`, linear scaling);
    /// `divisors` has one entry per rotated pair.
    pub fn with_divisors(mut self, divisors: &[f32]) -> anyhow::Result<Self> {
        if divisors.len() != self.inv_freq.len() {
            anyhow::bail!(
                "RoPE frequency divisors: {} values for {} rotated pairs",
                divisors.len(),
                self.inv_freq.len()
            );
        }
        if let Some(bad) = divisors.iter().find(|d| !(d.is_finite() && **d > 0.0)) {
            anyhow::bail!("RoPE frequency divisor {bad} is not a positive number");
        }
        for (f, d) in self.inv_freq.iter_mut().zip(divisors) {
            *f /= d;
        }
        Ok(self)
    }

    pub fn tables(&self, positions: &[usize]) -> RopeTables {
        let half = self.rope_dim / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &pos in positions {
            for &f in &self.inv_freq {
                // Angles in f64, so long positions keep their precision.
                let a = pos as f64 * f as f64;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        RopeTables { half, cos, sin }
    }

    /// Rotates every head of the token row that is entry `i` of `tables`.
    pub fn apply(&self, row: &mut [f32], tables: &RopeTables, i: usize) {
        let half = tables.half;
        let cos = &tables.cos[i * half..(i + 1) * half];
        let sin = &tables.sin[i * half..(i + 1) * half];
        for head in row.chunks_exact_mut(self.head_dim) {
            match self.style {
                RopeStyle::Interleaved => {
                    for j in 0..half {
                        let (x0, x1) = (head[2 * j], head[2 * j + 1]);
                        head[2 * j] = x0 * cos[j] - x1 * sin[j];
                        head[2 * j + 1] = x0 * sin[j] + x1 * cos[j];
                    }
                }
                RopeStyle::Halves => {
                    for j in 0..half {
                        let (x0, x1) = (head[j], head[j + half]);
                        head[j] = x0 * cos[j] - x1 * sin[j];
                        head[j + half] = x0 * sin[j] + x1 * cos[j];
                    }
                }
            }
        }
    }
}
