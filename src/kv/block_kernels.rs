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
    let hd = q.len();
    for (j, s) in out.iter_mut().enumerate() {
        *s = match keys {
            KvView::F16(k) => dot_portable(q, &k[j * hd..(j + 1) * hd], |x| x.to_f32()),
            KvView::F32(k) => dot_portable(q, &k[j * hd..(j + 1) * hd], |x| *x),
        } * scale;
    }
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
    let hd = out.len();
    for (j, &w) in weights.iter().enumerate() {
        let alpha = w * inv;
        match values {
            KvView::F16(v) => out.iter_mut().zip(&v[j * hd..(j + 1) * hd]).for_each(|(o, x)| *o += alpha * x.to_f32()),
            KvView::F32(v) => out.iter_mut().zip(&v[j * hd..(j + 1) * hd]).for_each(|(o, x)| *o += alpha * x),
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_f16c() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"))
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

    #[inline(always)]
    unsafe fn scores<T: Lanes>(q: &[f32], keys: &[T], scale: f32, out: &mut [f32]) {
        let hd = q.len();
        assert!(keys.len() >= out.len() * hd, "block holds fewer keys than asked for");
        for (j, s) in out.iter_mut().enumerate() {
            *s = unsafe { dot(q, &keys[j * hd..(j + 1) * hd]) } * scale;
        }
    }

    #[inline(always)]
    unsafe fn accumulate<T: Lanes>(weights: &[f32], inv: f32, values: &[T], out: &mut [f32]) {
        let hd = out.len();
        let full = hd / 8 * 8;
        assert!(values.len() >= weights.len() * hd, "block holds fewer values than asked for");
        for (j, &w) in weights.iter().enumerate() {
            let alpha = w * inv;
            let v = &values[j * hd..(j + 1) * hd];
            unsafe {
                let a = _mm256_set1_ps(alpha);
                let mut i = 0;
                while i < full {
                    let o = _mm256_loadu_ps(out.as_ptr().add(i));
                    _mm256_storeu_ps(
                        out.as_mut_ptr().add(i),
                        _mm256_add_ps(o, _mm256_mul_ps(a, T::load8(v.as_ptr().add(i)))),
                    );
                    i += 8;
                }
                while i < hd {
                    out[i] += alpha * v[i].widen();
                    i += 1;
                }
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

    /// The vector path and the portable path agree to rounding on f16 and f32 blocks,
    /// including head sizes that are not a multiple of eight.
    #[test]
    fn vector_and_portable_paths_agree() {
        for hd in [64usize, 80, 13] {
            let n = 5;
            let q: Vec<f32> = (0..hd).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1).collect();
            let k32: Vec<f32> = (0..n * hd).map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.125).collect();
            let k16: Vec<f16> = k32.iter().map(|&x| f16::from_f32(x)).collect();
            for keys in [KvView::F32(&k32), KvView::F16(&k16)] {
                let mut got = vec![0f32; n];
                block_scores(&q, keys, 0.5, &mut got);
                let mut acc = vec![0.25f32; hd];
                block_accumulate(&got, 2.0, keys, &mut acc);
                for j in 0..n {
                    let want: f32 = q.iter().zip(&k32[j * hd..(j + 1) * hd]).map(|(a, b)| a * b).sum::<f32>() * 0.5;
                    assert!((got[j] - want).abs() < 1e-4, "hd {hd} key {j}: {} vs {want}", got[j]);
                }
                for i in 0..hd {
                    let want = 0.25 + (0..n).map(|j| got[j] * 2.0 * k32[j * hd + i]).sum::<f32>();
                    assert!((acc[i] - want).abs() < 1e-4, "hd {hd} dim {i}: {} vs {want}", acc[i]);
                }
            }
        }
    }
}
