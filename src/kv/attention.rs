//! Causal attention over paged K/V on the CPU.
//!
//! Queries of a packed batch attend to their own sequence's cached keys plus the keys of the
//! rows written in this forward, causally. Reading the block table directly avoids gathering
//! each sequence's cache into a contiguous tensor every step.

use super::block_kernels as kernels;
use super::pool::PoolStorage;
use crate::parallel::SyncPtr;

/// One sequence's part of a packed batch, as attention sees it.
#[derive(Debug, Clone)]
pub struct AttentionSeq<'a> {
    /// First row of this sequence in the packed batch.
    pub row_start: usize,
    /// Rows (new tokens) of this sequence in the batch.
    pub n_rows: usize,
    /// Tokens cached before this forward; row i's K/V sit in slot `cached + i`.
    pub cached: usize,
    pub blocks: &'a [u32],
    /// A draft tree: row i's parent row (`NO_PARENT`: it follows the cached tokens). Row i
    /// then attends to the cache and to its ancestors among the new rows, and sits at
    /// position `cached + depth`. None: a chain, row i at position `cached + i`.
    pub parents: Option<&'a [u32]>,
}

/// A tree row that follows the cached tokens directly.
pub const NO_PARENT: u32 = u32::MAX;

/// Row `row`'s ancestors among a tree's new rows and the row itself, root first.
pub fn tree_path(parents: &[u32], row: usize, path: &mut Vec<usize>) {
    path.clear();
    let mut r = row;
    loop {
        path.push(r);
        match parents[r] {
            NO_PARENT => break,
            p => r = p as usize,
        }
    }
    path.reverse();
}

/// `q`: `[rows, n_heads, head_dim]` (already rotated); `out`: same shape. The K/V of every
/// row must already be in the pool at its slot. Scores are `q·k · scale`; with a
/// `window`, a row at position p attends to positions `p+1−window ..= p` only.
///
/// A tree row's keys are laid out as its chain twin's would be: the cached keys, then its
/// ancestors' in depth order, so its scores, softmax and weighted sum are the same
/// arithmetic in the same order, and its output is bit for bit that of a chain row with
/// the same ancestors.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    storage: &PoolStorage,
    layer: usize,
    q: &[f32],
    n_heads: usize,
    seqs: &[AttentionSeq<'_>],
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    let layout = storage.layout;
    let hd = layout.head_dim;
    let group = n_heads / layout.n_kv_heads;
    let bs = layout.block_size;
    let keys = &storage.k[layer];
    let values = &storage.v[layer];

    // Map each row to (its sequence, its row within the sequence).
    let rows = q.len() / (n_heads * hd);
    let mut row_seq = vec![(0usize, 0usize); rows];
    for (si, s) in seqs.iter().enumerate() {
        for i in 0..s.n_rows {
            row_seq[s.row_start + i] = (si, i);
        }
    }

    // One work item per (row, kv head): each cached block is read, and widened from f16,
    // once for all `group` query heads that share it (GQA). Each query head's arithmetic runs
    // in the same order as it would alone, so results do not depend on the grouping.
    let n_kv = layout.n_kv_heads;
    let item_len = group * hd;
    assert_eq!(out.len(), rows * n_kv * item_len, "attention output shape");
    let out_ptr = SyncPtr(out.as_mut_ptr());
    // candle's own worker pool runs the matmuls; running attention on it too keeps a second
    // pool from competing for the same cores while the first one's workers spin.
    candle_core::utils::barrier_pool().execute_chunked(rows * n_kv, |items| {
        let mut scores = Vec::new();
        let mut path = Vec::new();
        let (mut max, mut inv) = (vec![0f32; group], vec![0f32; group]);
        for item in items {
            let row = item / n_kv;
            let kv_head = item % n_kv;
            let (si, i) = row_seq[row];
            let s = &seqs[si];
            let blocks = s.blocks;
            // The keys: slots `0..contiguous`, read block by block, then (tree rows) the
            // ancestors' slots one by one.
            let contiguous = match s.parents {
                None => {
                    path.clear();
                    s.cached + i + 1
                }
                Some(parents) => {
                    tree_path(parents, i, &mut path);
                    s.cached
                }
            };
            let n_keys = contiguous + path.len();
            let n_blocks = contiguous.div_ceil(bs);
            // A sliding window sees keys `first..n_keys`; blocks before `first`'s are skipped,
            // and the keys from there to `first` are masked out.
            let first = window.map_or(0, |w| n_keys.saturating_sub(w.max(1)));
            let b0 = first / bs;
            let q_heads = &q[item * item_len..(item + 1) * item_len];
            // SAFETY: items are disjoint, and item `i` writes only `out[i*item_len..(i+1)*item_len]`,
            // which is in bounds by the assert above; `out` outlives this call.
            let out_heads = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(item * item_len), item_len) };

            scores.clear();
            scores.resize(group * n_keys, 0f32);
            // Block `bi`'s keys or values. The next block is always requested before this one
            // is computed on: the blocks lie scattered over the pool, and streaming them is
            // most of attention's time at decode (prefetching: batch-8 steps 7% faster at
            // 128 cached tokens, 16% at 400).
            let n_at = |bi: usize| (contiguous - bi * bs).min(bs);
            let key_block = |bi: usize| keys.view(storage.head_offset(blocks[bi], kv_head), n_at(bi) * hd);
            let value_block = |bi: usize| values.view(storage.head_offset(blocks[bi], kv_head), n_at(bi) * hd);
            let slot_offset =
                |r: usize| storage.head_offset(blocks[(s.cached + r) / bs], kv_head) + (s.cached + r) % bs * hd;
            for bi in b0..n_blocks {
                if bi + 1 < n_blocks {
                    key_block(bi + 1).prefetch();
                } else {
                    value_block(b0).prefetch();
                }
                kernels::group_scores(q_heads, hd, key_block(bi), n_at(bi), scale, &mut scores[bi * bs..], n_keys);
            }
            for (t, &r) in path.iter().enumerate() {
                let key = keys.view(slot_offset(r), hd);
                kernels::group_scores(q_heads, hd, key, 1, scale, &mut scores[contiguous + t..], n_keys);
            }
            for g in 0..group {
                let row_scores = &mut scores[g * n_keys..(g + 1) * n_keys];
                row_scores[(b0 * bs).min(first)..first].fill(f32::NEG_INFINITY);
                max[g] = row_scores[b0 * bs..].iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                inv[g] = 1.0 / kernels::exp_shifted_sum(&mut row_scores[b0 * bs..], max[g]);
            }
            out_heads.fill(0.0);
            for bi in b0..n_blocks {
                if bi + 1 < n_blocks {
                    value_block(bi + 1).prefetch();
                }
                kernels::group_accumulate(&scores[bi * bs..], n_keys, n_at(bi), &inv, value_block(bi), out_heads);
            }
            for (t, &r) in path.iter().enumerate() {
                let value = values.view(slot_offset(r), hd);
                kernels::group_accumulate(&scores[contiguous + t..], n_keys, 1, &inv, value, out_heads);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvDtype, KvLayout, KvPool};

    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// Softmax attention of one query head over keys `first..=pos`, in f64.
    fn reference(q: &[f32], keys: &[Vec<f32>], vals: &[Vec<f32>], first: usize, pos: usize, scale: f32) -> Vec<f32> {
        let scores: Vec<f64> = (first..=pos)
            .map(|j| q.iter().zip(&keys[j]).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>() * scale as f64)
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = w.iter().sum();
        (0..q.len())
            .map(|d| (first..=pos).zip(&w).map(|(j, w)| w * vals[j][d] as f64).sum::<f64>() / total)
            .map(|x| x as f32)
            .collect()
    }

    /// Rows alone and in blocks of several sizes get the same bits, with and without a sliding
    /// window. (Tree rows against their chain twins: `tests/forward_equivalence.rs`.)
    #[test]
    fn a_row_alone_and_in_a_block_get_the_same_bits() {
        let (hd, n_kv, group, bs, len) = (64, 3, 3, 16, 53);
        let n_heads = n_kv * group;
        let row_len = n_heads * hd;
        let layout = KvLayout { dtype: KvDtype::F16, n_layers: 1, n_kv_heads: n_kv, head_dim: hd, block_size: bs };
        let pool = KvPool::new(layout, 64);
        let mut cache = pool.new_sequence();
        let mut storage = pool.lock();
        cache.reserve_locked(&mut storage, len).unwrap();
        for p in 0..len {
            storage.write(0, cache.blocks(), p, &values(p as u64, n_kv * hd), &values(500 + p as u64, n_kv * hd));
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        let run = |q: &[f32], seq: &AttentionSeq, window: Option<usize>| {
            let mut out = vec![0f32; q.len()];
            paged_attention(&storage, 0, q, n_heads, std::slice::from_ref(seq), 0.125, window, &mut out);
            out
        };
        for window in [None, Some(20), Some(5)] {
            for new in [2, 5, 16, 23] {
                let q = values(9 + new as u64, new * row_len);
                let block = AttentionSeq {
                    row_start: 0,
                    n_rows: new,
                    cached: len - new,
                    blocks: cache.blocks(),
                    parents: None,
                };
                let together = run(&q, &block, window);
                for r in 0..new {
                    let one = AttentionSeq { n_rows: 1, cached: len - new + r, ..block.clone() };
                    let alone = run(&q[r * row_len..(r + 1) * row_len], &one, window);
                    assert_eq!(
                        bits(&alone),
                        bits(&together[r * row_len..(r + 1) * row_len]),
                        "{window:?}, {new} rows, row {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn windowed_rows_attend_to_their_last_positions_only() {
        let (hd, n_heads, bs, len) = (16, 2, 4, 11);
        let layout = KvLayout { dtype: KvDtype::F32, n_layers: 1, n_kv_heads: 1, head_dim: hd, block_size: bs };
        let pool = KvPool::new(layout, 64);
        let mut cache = pool.new_sequence();
        let mut storage = pool.lock();
        cache.reserve_locked(&mut storage, len).unwrap();
        let keys: Vec<Vec<f32>> = (0..len).map(|p| values(p as u64, hd)).collect();
        let vals: Vec<Vec<f32>> = (0..len).map(|p| values(100 + p as u64, hd)).collect();
        for p in 0..len {
            storage.write(0, cache.blocks(), p, &keys[p], &vals[p]);
        }
        // The last 3 positions as new rows; windows that start mid-block, at a block edge,
        // cover everything, and a window of one.
        let q = values(7, 3 * n_heads * hd);
        let seq = AttentionSeq { row_start: 0, n_rows: 3, cached: len - 3, blocks: cache.blocks(), parents: None };
        for window in [None, Some(5), Some(4), Some(100), Some(1)] {
            let mut out = vec![0f32; q.len()];
            paged_attention(&storage, 0, &q, n_heads, std::slice::from_ref(&seq), 0.3, window, &mut out);
            for row in 0..3 {
                let pos = len - 3 + row;
                let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                for h in 0..n_heads {
                    let at = (row * n_heads + h) * hd;
                    let want = reference(&q[at..at + hd], &keys, &vals, first, pos, 0.3);
                    for (got, want) in out[at..at + hd].iter().zip(&want) {
                        assert!((got - want).abs() < 1e-5, "window {window:?} row {row} head {h}: {got} vs {want}");
                    }
                }
            }
        }
    }
}
