//! Teacher-forced accuracy of a weight path against exact arithmetic: one forward over prompt +
//! a fixed continuation with logits for every row, compared row by row with the same forward
//! on f32 weights (the file's own weights dequantised, dense f32 matmuls, no activation
//! quantisation). docs/kernels.md reports the numbers; `tests/kernel_accuracy.rs` holds them.
//!
//! One definition everywhere: at each continuation step, the row that predicts continuation
//! token `t`,
//! - **top-1 agreement**: the path's argmax equals the f32 argmax;
//! - **|Δ log-prob|**: `|lp_path(t) − lp_f32(t)|`, log-softmax of the row at the continuation
//!   token (for llama.cpp, whose greedy tokens make the continuation, that is its own pick).
//! Maximum and mean are over all steps of all prompts.

use super::batch::{ForwardBatch, LogitsRows};
use super::transformer::Transformer;
use anyhow::Result;

/// Log-softmax rows predicting each continuation token: row `i` is the distribution after
/// `prompt` + `continuation[..i]`.
pub fn teacher_forced_logprobs(model: &Transformer, prompt: &[u32], continuation: &[u32]) -> Result<Vec<Vec<f32>>> {
    let mut input = prompt.to_vec();
    input.extend_from_slice(continuation);
    let pool = model.new_kv_pool(input.len().next_multiple_of(16));
    let mut cache = pool.new_sequence();
    let mut batch = ForwardBatch::new();
    batch.push(&input, &mut cache, LogitsRows::All);
    let out = model.forward(&mut batch)?;
    let rows = out.seq_logits(0)?;
    Ok(rows[prompt.len() - 1..input.len() - 1].iter().map(|r| crate::sample::log_softmax(r)).collect())
}

/// Running top-1 agreement and |Δ log-prob| of one path against f32 (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Agreement {
    pub steps: usize,
    pub top1_same: usize,
    pub max_abs: f32,
    pub sum_abs: f64,
}

impl Agreement {
    /// Adds one step: the path's argmax and its log-prob of the continuation token, against
    /// the f32 row.
    pub fn add(&mut self, path_argmax: u32, path_lp: f32, f32_row: &[f32], token: u32) {
        let diff = (path_lp - f32_row[token as usize]).abs();
        self.steps += 1;
        self.top1_same += (path_argmax == crate::sample::argmax(f32_row)) as usize;
        self.max_abs = self.max_abs.max(diff);
        self.sum_abs += diff as f64;
    }

    /// Adds one step where the path's whole row is known.
    pub fn add_row(&mut self, path_row: &[f32], f32_row: &[f32], token: u32) {
        self.add(crate::sample::argmax(path_row), path_row[token as usize], f32_row, token);
    }

    pub fn mean_abs(&self) -> f32 {
        (self.sum_abs / self.steps.max(1) as f64) as f32
    }
}
