//! Rotary position embeddings applied in place on rows of `[heads, head_dim]`.

use super::config::RopeStyle;

pub struct Rope {
    style: RopeStyle,
    rope_dim: usize,
    head_dim: usize,
    /// Inverse frequency per rotated pair.
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(style: RopeStyle, theta: f32, rope_dim: usize, head_dim: usize) -> Self {
        let inv_freq = (0..rope_dim / 2)
            .map(|i| 1.0 / theta.powf(2.0 * i as f32 / rope_dim as f32))
            .collect();
        Self { style, rope_dim, head_dim, inv_freq }
    }

    /// Rotates every head of one token row at absolute position `pos`.
    pub fn apply(&self, row: &mut [f32], pos: usize) {
        let half = self.rope_dim / 2;
        // Angles computed in f64 then rounded, so long positions keep their precision.
        let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
        for i in 0..half {
            let a = pos as f64 * self.inv_freq[i] as f64;
            cos[i] = a.cos() as f32;
            sin[i] = a.sin() as f32;
        }
        for head in row.chunks_exact_mut(self.head_dim) {
            match self.style {
                RopeStyle::Interleaved => {
                    for i in 0..half {
                        let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                        head[2 * i] = x0 * cos[i] - x1 * sin[i];
                        head[2 * i + 1] = x0 * sin[i] + x1 * cos[i];
                    }
                }
                RopeStyle::Halves => {
                    for i in 0..half {
                        let (x0, x1) = (head[i], head[i + half]);
                        head[i] = x0 * cos[i] - x1 * sin[i];
                        head[i + half] = x0 * sin[i] + x1 * cos[i];
                    }
                }
            }
        }
    }
}
