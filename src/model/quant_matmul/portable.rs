//! The kernels' arithmetic as plain loops: activation quantisation where the CPU has no
//! vector code for it, and the whole matmul for tests, with the same integer sums and the
//! same float operations in the same order as the vector kernels.

use super::*;

pub(super) fn largest_untaken_portable(xs: &[f32], taken: u32) -> (usize, f32) {
    let (mut top, mut next) = (BLOCK, 0f32);
    for (i, &v) in xs[..BLOCK].iter().enumerate() {
        if taken & (1 << i) != 0 {
            continue;
        }
        if top == BLOCK || v.abs() > xs[top].abs() {
            if top != BLOCK {
                next = next.max(xs[top].abs());
            }
            top = i;
        } else {
            next = next.max(v.abs());
        }
    }
    (top, next)
}

#[inline(always)]
pub(super) fn quantize_range_portable(x: &[f32], q: &mut [i8], r: &mut [i8], blocks: &mut [ActBlock], two_level: bool) {
    for (b, xs) in x.chunks_exact(BLOCK).enumerate() {
        let qs = &mut q[b * BLOCK..(b + 1) * BLOCK];
        let (d, sum) = quantize_block_portable(xs, qs);
        let sum_lo = qs[..BLOCK / 2].iter().map(|&q| q as i32).sum();
        if !two_level {
            blocks[b] = ActBlock { d, sum, sum_lo, s: d * sum as f32, ..ActBlock::default() };
            continue;
        }
        // What the first level leaves over, with one rounding (fused, as the vector code).
        let rest: Vec<f32> = xs.iter().zip(qs.iter()).map(|(&x, &q)| (-(q as f32)).mul_add(d, x)).collect();
        let rs = &mut r[b * BLOCK..(b + 1) * BLOCK];
        let (d_r, sum_r) = quantize_block_portable(&rest, rs);
        let sum_r_lo = rs[..BLOCK / 2].iter().map(|&r| r as i32).sum();
        blocks[b] =
            ActBlock { d, d_r, sum, sum_r, sum_lo, sum_r_lo, s: d_r.mul_add(sum_r as f32, d * sum as f32), taken: 0 };
    }
}

/// One level of one block of 32 values: `q = round(x / d)` (ties to even), `d = max|x| / 127`;
/// returns `d` and Σq. `q` stays within ±127, even for non-finite input (the AVX2 kernels'
/// 16-bit sums rely on it), and a block of values so small that `1/d` overflows is zeros.
#[inline(always)]
pub(super) fn quantize_block_portable(xs: &[f32], qs: &mut [i8]) -> (f32, i32) {
    let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
    let (d, id) = block_scale(amax);
    let mut sum = 0;
    for (q, x) in qs.iter_mut().zip(xs) {
        *q = (x * id).round_ties_even().max(-127.0) as i8;
        sum += *q as i32;
    }
    (d, sum)
}

/// The kernels' arithmetic written as plain loops, for tests: the same integer sums and the
/// same float operations in the same order.
#[cfg(test)]
pub(super) fn matmul_portable(p: &PackedMatrix, x: &[f32]) -> Vec<f32> {
    let (n, k) = (p.n, p.k);
    let kb_n = k / BLOCK;
    let m = x.len() / k;
    let mut out = vec![0f32; m * n];
    for row in 0..m {
        let (mut q, mut r) = (vec![0i8; k], vec![0i8; k]);
        let mut blocks = vec![ActBlock::default(); kb_n];
        let mut outliers = vec![Outlier::default(); kb_n * MAX_OUTLIERS_PER_BLOCK];
        let xs = &x[row * k..(row + 1) * k];
        if p.levels == ActivationLevels::Outliers {
            let count = quantize_row_outliers(
                xs,
                &mut q,
                &mut blocks,
                &mut outliers,
                quantize_range_portable,
                largest_untaken_portable,
            );
            outliers.truncate(count);
        } else {
            quantize_range_portable(xs, &mut q, &mut r, &mut blocks, p.levels == ActivationLevels::Two);
            outliers.clear();
        }
        for col in 0..n {
            let (nt, lane) = (col / TILE_N, col % TILE_N);
            // Block b's weights as stored, what they carry on top (Q8_0 +128, Q5_0 +16, Q6_K
            // +32), the scale (of the first 16 inputs when there is a second one) and the
            // minimum.
            let weights = |b: usize| -> (Vec<i32>, i32, f32, Option<f32>, Option<f32>) {
                let at = (nt * kb_n + b) * TILE_N + lane;
                let sb = b / BLOCKS_PER_SUPER;
                let at_sb = (nt * (k / SUPER_BLOCK) + sb) * TILE_N + lane;
                // Input i's four low bits in the Q4_1 nibble layout the 4/5/6-bit types share.
                let nibble = |qs: &[u8], i: usize| -> u8 {
                    let byte = qs[(nt * kb_n + b) * TILE_N * BLOCK / 2 + ((i % 16) / 4 * TILE_N + lane) * 4 + i % 4];
                    if i < 16 {
                        byte & 0x0F
                    } else {
                        byte >> 4
                    }
                };
                match &p.weights {
                    Packed::Q8_0 { qs, d } => {
                        let tile = (nt * kb_n + b) * TILE_N * BLOCK;
                        let w = (0..BLOCK).map(|i| qs[tile + (i / 4 * TILE_N + lane) * 4 + i % 4] as i32).collect();
                        (w, 128, d[at].to_f32(), None, None)
                    }
                    Packed::Q4_1 { qs, d, m } => {
                        let w = (0..BLOCK).map(|i| nibble(qs, i) as i32).collect();
                        (w, 0, d[at].to_f32(), None, Some(m[at].to_f32()))
                    }
                    Packed::Q5_0 { qs, qh, d } => {
                        let w = (0..BLOCK).map(|i| (nibble(qs, i) | (((qh[at] >> i) & 1) as u8) << 4) as i32).collect();
                        (w, 16, d[at].to_f32(), None, None)
                    }
                    Packed::Q4K { qs, sc, m, d, dmin_neg } => {
                        let w = (0..BLOCK).map(|i| nibble(qs, i) as i32).collect();
                        let scale = sc[at] as f32 * d[at_sb].to_f32();
                        (w, 0, scale, None, Some(m[at] as f32 * dmin_neg[at_sb].to_f32()))
                    }
                    Packed::Q6K { qs, qh, sc, d } => {
                        let high_tile = (nt * kb_n + b) * TILE_N * BLOCK / 4;
                        let w = (0..BLOCK)
                            .map(|i| {
                                let low = nibble(qs, i);
                                let g = i / 4;
                                let high = (qh[high_tile + ((g / 4) * TILE_N + lane) * 4 + i % 4] >> (2 * (g % 4))) & 3;
                                (low | high << 4) as i32
                            })
                            .collect();
                        let row_d = d[at_sb].to_f32();
                        let (lo, hi) = ((nt * kb_n + b) * 2 * TILE_N + lane, ((nt * kb_n + b) * 2 + 1) * TILE_N + lane);
                        (w, 32, sc[lo] as f32 * row_d, Some(sc[hi] as f32 * row_d), None)
                    }
                    Packed::Q4_0 { qs, d } => {
                        let w = (0..BLOCK).map(|i| nibble(qs, i) as i32).collect();
                        (w, 8, d[at].to_f32(), None, None)
                    }
                    Packed::Q5_1 { qs, qh, d, m } => {
                        let w = (0..BLOCK).map(|i| (nibble(qs, i) | (((qh[at] >> i) & 1) as u8) << 4) as i32).collect();
                        (w, 0, d[at].to_f32(), None, Some(m[at].to_f32()))
                    }
                    Packed::Q5K { qs, qh, sc, m, d, dmin_neg } => {
                        let w = (0..BLOCK).map(|i| (nibble(qs, i) | (((qh[at] >> i) & 1) as u8) << 4) as i32).collect();
                        let scale = sc[at] as f32 * d[at_sb].to_f32();
                        (w, 0, scale, None, Some(m[at] as f32 * dmin_neg[at_sb].to_f32()))
                    }
                }
            };
            let mut acc = 0f32;
            for (b, a) in blocks.iter().enumerate() {
                let (w, offset, d, d_hi, min) = weights(b);
                let dot = |acts: &[i8], sum: i32, range: std::ops::Range<usize>| -> i32 {
                    range.map(|i| w[i] * acts[i] as i32).sum::<i32>() - offset * sum
                };
                let (qa, ra) = (&q[b * BLOCK..][..BLOCK], &r[b * BLOCK..][..BLOCK]);
                let two = p.levels == ActivationLevels::Two && a.d_r != 0.0;
                if let Some(d_hi) = d_hi {
                    acc = (dot(qa, a.sum_lo, 0..16) as f32).mul_add(d * a.d, acc);
                    acc = (dot(qa, a.sum - a.sum_lo, 16..32) as f32).mul_add(d_hi * a.d, acc);
                    if two {
                        acc = (dot(ra, a.sum_r_lo, 0..16) as f32).mul_add(d * a.d_r, acc);
                        acc = (dot(ra, a.sum_r - a.sum_r_lo, 16..32) as f32).mul_add(d_hi * a.d_r, acc);
                    }
                } else {
                    acc = (dot(qa, a.sum, 0..BLOCK) as f32).mul_add(d * a.d, acc);
                    if two {
                        acc = (dot(ra, a.sum_r, 0..BLOCK) as f32).mul_add(d * a.d_r, acc);
                    }
                }
                if let Some(m) = min {
                    acc = m.mul_add(a.s, acc);
                }
            }
            for o in &outliers {
                let (w, offset, d, d_hi, min) = weights(o.block as usize);
                let i = o.at as usize;
                let scale = if i >= 16 { d_hi.unwrap_or(d) } else { d };
                let w = match min {
                    Some(m) => (w[i] as f32).mul_add(scale, m),
                    None => ((w[i] - offset) as f32) * scale,
                };
                acc = w.mul_add(o.x, acc);
            }
            out[row * n + col] = acc;
        }
    }
    out
}
