//! The two inner loops of paged attention, over one cached block at a time: scores of one
//! query head against the block's keys, and the weighted sum of the block's values.
//!
//! They read the cache in its stored type, so f16 keys and values are widened in registers
//! (F16C) instead of being copied into an f32 scratch buffer first. x86 CPUs with AVX2 and
//! F16C take the vector path, chosen once per call; others take the portable loops.
//! Both paths do the same arithmetic in the same order (no fused multiply-add: a 30-layer
//! model turns that last-bit difference into visible log-prob shifts), and a query head's
//! result depends only on its own inputs, never on which other rows or heads share the forward.

use half::f16;

/// A run of cached K or V elements in their stored type.
#[derive(Clone, Copy)]
pub enum KvView<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

/// `out[j] = scale * (q · key_j)` for the first `out.len()` keys of `keys` (each `q.len()` wide).
pub fn block_scores(q: &[f32], keys: KvView<'_>, scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2_f16c() {
        // SAFETY: the CPU has the features these functions are compiled for.
        unsafe {
            match keys {
                KvView::F16(k) => x86::scores_f16(q, k, scale, out),
                KvView::F32(k) => x86::scores_f32(q, k, scale, out),
            }
        }
        return;
    }
    scores_portable(q, keys, scale, out);
}

/// `out += Σ_j (weights[j] * inv) * value_j` over the first `weights.len()` values, in order.
pub fn block_accumulate(weights: &[f32], inv: f32, values: KvView<'_>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2_f16c() {
        // SAFETY: as above.
        unsafe {
            match values {
                KvView::F16(v) => x86::accumulate_f16(weights, inv, v, out),
                KvView::F32(v) => x86::accumulate_f32(weights, inv, v, out),
            }
        }
        return;
    }
    accumulate_portable(weights, inv, values, out);
}

#[cfg(target_arch = "x86_64")]
fn avx2_f16c() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"))
}

fn scores_portable(q: &[f32], keys: KvView<'_>, scale: f32, out: &mut [f32]) {
    let hd = q.len();
    for (j, s) in out.iter_mut().enumerate() {
        *s = match keys {
            KvView::F16(k) => dot_portable(q, &k[j * hd..(j + 1) * hd], |x| x.to_f32()),
            KvView::F32(k) => dot_portable(q, &k[j * hd..(j + 1) * hd], |x| *x),
        } * scale;
    }
}

fn accumulate_portable(weights: &[f32], inv: f32, values: KvView<'_>, out: &mut [f32]) {
    let hd = out.len();
    for (j, &w) in weights.iter().enumerate() {
        let alpha = w * inv;
        match values {
            KvView::F16(v) => out.iter_mut().zip(&v[j * hd..(j + 1) * hd]).for_each(|(o, x)| *o += alpha * x.to_f32()),
            KvView::F32(v) => out.iter_mut().zip(&v[j * hd..(j + 1) * hd]).for_each(|(o, x)| *o += alpha * x),
        }
    }
}

/// Eight independent partial sums (the compiler vectorises this), then their sum in order.
#[inline]
fn dot_portable<T>(a: &[f32], b: &[T], widen: impl Fn(&T) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * widen(&y[i]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * widen(y);
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;
    use half::f16;

    /// Loads eight elements as f32.
    trait Lanes: Copy {
        unsafe fn load8(p: *const Self) -> __m256;
        fn widen(self) -> f32;
    }

    impl Lanes for f16 {
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
        }
        #[inline(always)]
        fn widen(self) -> f32 {
            self.to_f32()
        }
    }

    impl Lanes for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        fn widen(self) -> f32 {
            self
        }
    }

    /// The same arithmetic as `dot_portable` (eight lanes, multiply then add, lanes summed
    /// in order), so both paths round identically and the cache type is the only difference.
    #[inline(always)]
    unsafe fn dot<T: Lanes>(q: &[f32], k: &[T]) -> f32 {
        let hd = q.len();
        let full = hd / 8 * 8;
        unsafe {
            let mut acc = _mm256_setzero_ps();
            let mut i = 0;
            while i < full {
                acc =
                    _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q.as_ptr().add(i)), T::load8(k.as_ptr().add(i))));
                i += 8;
            }
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
            let mut s: f32 = lanes.iter().sum();
            while i < hd {
                s += q[i] * k[i].widen();
                i += 1;
            }
            s
        }
    }

    /// Eight keys at a time: their eight-lane partial sums are transposed so that one vector
    /// add per lane sums all eight keys, in the same lane order `dot` uses (identical results).
    #[inline(always)]
    unsafe fn scores<T: Lanes>(q: &[f32], keys: &[T], scale: f32, out: &mut [f32]) {
        let hd = q.len();
        assert!(keys.len() >= out.len() * hd, "block holds fewer keys than asked for");
        let mut j = 0;
        if hd % 8 == 0 {
            unsafe {
                let scale8 = _mm256_set1_ps(scale);
                while j + 8 <= out.len() {
                    let mut acc = [_mm256_setzero_ps(); 8];
                    let mut i = 0;
                    while i < hd {
                        let qv = _mm256_loadu_ps(q.as_ptr().add(i));
                        for (key, a) in acc.iter_mut().enumerate() {
                            let kv = T::load8(keys.as_ptr().add((j + key) * hd + i));
                            *a = _mm256_add_ps(*a, _mm256_mul_ps(qv, kv));
                        }
                        i += 8;
                    }
                    let lanes = transpose8(acc);
                    let mut sum = lanes[0];
                    for lane in &lanes[1..] {
                        sum = _mm256_add_ps(sum, *lane);
                    }
                    _mm256_storeu_ps(out.as_mut_ptr().add(j), _mm256_mul_ps(sum, scale8));
                    j += 8;
                }
            }
        }
        for (jj, s) in out.iter_mut().enumerate().skip(j) {
            *s = unsafe { dot(q, &keys[jj * hd..(jj + 1) * hd]) } * scale;
        }
    }

    /// `rows[r]` lane `c` → result `[c]` lane `r`.
    #[inline(always)]
    unsafe fn transpose8(rows: [__m256; 8]) -> [__m256; 8] {
        unsafe {
            let t0 = _mm256_unpacklo_ps(rows[0], rows[1]);
            let t1 = _mm256_unpackhi_ps(rows[0], rows[1]);
            let t2 = _mm256_unpacklo_ps(rows[2], rows[3]);
            let t3 = _mm256_unpackhi_ps(rows[2], rows[3]);
            let t4 = _mm256_unpacklo_ps(rows[4], rows[5]);
            let t5 = _mm256_unpackhi_ps(rows[4], rows[5]);
            let t6 = _mm256_unpacklo_ps(rows[6], rows[7]);
            let t7 = _mm256_unpackhi_ps(rows[6], rows[7]);
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ]
        }
    }

    /// The output is walked in slices of 32 floats held in registers across all the values,
    /// so each output element still sees the values in order (identical results).
    #[inline(always)]
    unsafe fn accumulate<T: Lanes>(weights: &[f32], inv: f32, values: &[T], out: &mut [f32]) {
        let hd = out.len();
        assert!(values.len() >= weights.len() * hd, "block holds fewer values than asked for");
        let mut i = 0;
        unsafe {
            while i + 32 <= hd {
                let mut o = [_mm256_setzero_ps(); 4];
                for (x, v) in o.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(out.as_ptr().add(i + 8 * x));
                }
                for (j, &w) in weights.iter().enumerate() {
                    let a = _mm256_set1_ps(w * inv);
                    let v = values.as_ptr().add(j * hd + i);
                    for (x, ov) in o.iter_mut().enumerate() {
                        *ov = _mm256_add_ps(*ov, _mm256_mul_ps(a, T::load8(v.add(8 * x))));
                    }
                }
                for (x, v) in o.iter().enumerate() {
                    _mm256_storeu_ps(out.as_mut_ptr().add(i + 8 * x), *v);
                }
                i += 32;
            }
            while i + 8 <= hd {
                let mut o = _mm256_loadu_ps(out.as_ptr().add(i));
                for (j, &w) in weights.iter().enumerate() {
                    o = _mm256_add_ps(
                        o,
                        _mm256_mul_ps(_mm256_set1_ps(w * inv), T::load8(values.as_ptr().add(j * hd + i))),
                    );
                }
                _mm256_storeu_ps(out.as_mut_ptr().add(i), o);
                i += 8;
            }
        }
        for (d, o) in out.iter_mut().enumerate().skip(i) {
            for (j, &w) in weights.iter().enumerate() {
                *o += (w * inv) * values[j * hd + d].widen();
            }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn scores_f16(q: &[f32], keys: &[f16], scale: f32, out: &mut [f32]) {
        unsafe { scores(q, keys, scale, out) }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn scores_f32(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
        unsafe { scores(q, keys, scale, out) }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn accumulate_f16(weights: &[f32], inv: f32, values: &[f16], out: &mut [f32]) {
        unsafe { accumulate(weights, inv, values, out) }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn accumulate_f32(weights: &[f32], inv: f32, values: &[f32], out: &mut [f32]) {
        unsafe { accumulate(weights, inv, values, out) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whichever path this CPU takes gives bit-for-bit the portable loops' results (that is
    /// what keeps outputs identical across machines' cache types and batch shapes), for full
    /// groups of eight keys and a tail, and for head sizes that are not a multiple of eight.
    #[test]
    fn kernels_equal_the_portable_loops_bitwise() {
        for hd in [64usize, 128, 80, 13] {
            let n = 13;
            let q: Vec<f32> = (0..hd).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.137).collect();
            let k32: Vec<f32> = (0..n * hd).map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.0913).collect();
            let k16: Vec<f16> = k32.iter().map(|&x| f16::from_f32(x)).collect();
            for keys in [KvView::F32(&k32), KvView::F16(&k16)] {
                let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
                block_scores(&q, keys, 0.125, &mut got);
                scores_portable(&q, keys, 0.125, &mut want);
                assert_eq!(
                    got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "scores, hd {hd}"
                );
                let exact: f32 = q.iter().zip(&k32[..hd]).map(|(a, b)| a * b).sum::<f32>() * 0.125;
                assert!((want[0] - exact).abs() < 1e-2, "hd {hd}: {} vs {exact}", want[0]);

                let (mut acc, mut acc_want) = (vec![0.25f32; hd], vec![0.25f32; hd]);
                block_accumulate(&got, 0.37, keys, &mut acc);
                accumulate_portable(&got, 0.37, keys, &mut acc_want);
                assert_eq!(
                    acc.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    acc_want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "values, hd {hd}"
                );
            }
        }
    }
}
