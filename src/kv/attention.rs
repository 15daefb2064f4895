//! Causal attention over paged K/V on the CPU.
//!
//! Queries of a packed batch attend to their own sequence's cached keys plus the keys of the
//! rows written in this forward, causally. Reading the block table directly avoids gathering
//! each sequence's cache into a contiguous tensor every step.

use super::pool::PoolStorage;
use rayon::prelude::*;

/// One sequence's part of a packed batch, as attention sees it.
#[derive(Debug, Clone)]
pub struct AttentionSeq<'a> {
    /// First row of this sequence in the packed batch.
    pub row_start: usize,
    /// Rows (new tokens) of this sequence in the batch.
    pub n_rows: usize,
    /// Tokens cached before this forward; row i sits at position `cached + i`.
    pub cached: usize,
    pub blocks: &'a [u32],
}

/// `q`: `[rows, n_heads, head_dim]` (already rotated); `out`: same shape. The K/V of every
/// row must already be in the pool at its position.
pub fn paged_attention(
    storage: &PoolStorage,
    layer: usize,
    q: &[f32],
    n_heads: usize,
    seqs: &[AttentionSeq<'_>],
    out: &mut [f32],
) {
    let layout = storage.layout;
    let hd = layout.head_dim;
    let group = n_heads / layout.n_kv_heads;
    let bs = layout.block_size;
    let scale = 1.0 / (hd as f32).sqrt();
    let keys = &storage.k[layer];
    let values = &storage.v[layer];

    // Map each row to (its sequence, its absolute position).
    let rows = q.len() / (n_heads * hd);
    let mut row_seq = vec![(0usize, 0usize); rows];
    for (si, s) in seqs.iter().enumerate() {
        for i in 0..s.n_rows {
            row_seq[s.row_start + i] = (si, s.cached + i);
        }
    }

    out.par_chunks_mut(hd).enumerate().for_each_init(
        || (vec![0f32; bs * hd], Vec::new()),
        |(block_f32, scores), (item, out_head)| {
            let row = item / n_heads;
            let kv_head = (item % n_heads) / group;
            let (si, pos) = row_seq[row];
            let blocks = seqs[si].blocks;
            let q_head = &q[item * hd..(item + 1) * hd];
            let n_keys = pos + 1;

            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for (bi, &block) in blocks.iter().enumerate().take(n_keys.div_ceil(bs)) {
                let n = (n_keys - bi * bs).min(bs);
                let off = storage.head_offset(block, kv_head);
                let chunk = &mut block_f32[..n * hd];
                keys.load(off, chunk);
                for k in chunk.chunks_exact(hd) {
                    let s = dot(q_head, k) * scale;
                    max = max.max(s);
                    scores.push(s);
                }
            }
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let inv = 1.0 / sum;
            out_head.fill(0.0);
            for (bi, &block) in blocks.iter().enumerate().take(n_keys.div_ceil(bs)) {
                let n = (n_keys - bi * bs).min(bs);
                let off = storage.head_offset(block, kv_head);
                let chunk = &mut block_f32[..n * hd];
                values.load(off, chunk);
                for (j, v) in chunk.chunks_exact(hd).enumerate() {
                    axpy(scores[bi * bs + j] * inv, v, out_head);
                }
            }
        },
    );
}

/// Dot product with eight independent accumulators so the compiler can vectorise it.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

#[inline]
fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}
