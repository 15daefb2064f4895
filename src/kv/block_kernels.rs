//! The two inner loops of paged attention, over one cached block at a time: scores of one
//! query head against the block's keys, and the weighted sum of the block's values.
//!
//! They read the cache in its stored type, so f16 keys and values are widened in registers
//! (F16C) instead of being copied into an f32 scratch buffer first. x86 CPUs with AVX2 and
//! F16C take the vector path, chosen once per call; others take the portable loops.
//! Both paths do the same arithmetic in the same order (no fused multiply-add: a 30-layer
//! model turns that last-bit difference into visible log-prob shifts), and a query head's
//! result depends only on its own inputs, never on which other rows or heads share the forward.

#[cfg(target_arch = "x86_64")]
use crate::vmath::ExpIsa;
use half::f16;

/// A run of cached K or V elements in their stored type.
#[derive(Clone, Copy)]
pub enum KvView<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl KvView<'_> {
    pub fn len(&self) -> usize {
        match self {
            KvView::F16(x) => x.len(),
            KvView::F32(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Asks the CPU to start loading this run into cache. Attention reads each sequence's
    /// blocks from all over the pool, a few KiB at a time, too short for the hardware
    /// prefetcher to catch on before each block is done; so the next block is requested while
    /// this one is computed on. Only a hint: no effect on results.
    #[inline]
    pub fn prefetch(&self) {
        #[cfg(target_arch = "x86_64")]
        {
            use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let (ptr, bytes) = match self {
                KvView::F16(x) => (x.as_ptr() as *const u8, std::mem::size_of_val(*x)),
                KvView::F32(x) => (x.as_ptr() as *const u8, std::mem::size_of_val(*x)),
            };
            for line in (0..bytes).step_by(64) {
                // SAFETY: a prefetch is a hint that never faults; the addresses are in bounds.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(ptr.add(line) as *const i8) };
            }
        }
    }
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

/// Scores of the query heads that share one KV head (GQA), `q_heads` holding them one after
/// another: `out[g * stride + j] = scale * (q_g · key_j)` for the first `n` keys. Each head
/// gets bit for bit what `block_scores` gives it alone; the AVX-512 path widens each key
/// once for all the heads, two keys per register.
pub fn group_scores(
    q_heads: &[f32],
    hd: usize,
    keys: KvView<'_>,
    n: usize,
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    let heads = q_heads.len() / hd;
    assert!(heads == 0 || (heads - 1) * stride + n <= out.len(), "scores output too short");
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(8) && avx512_f16c() {
        assert!(keys.len() >= n * hd, "block holds fewer keys than asked for");
        for (c, q) in q_heads.chunks(GROUP_CHUNK * hd).enumerate() {
            let out = &mut out[c * GROUP_CHUNK * stride..];
            // SAFETY: the CPU has the features; bounds are asserted above.
            unsafe {
                match keys {
                    KvView::F16(k) => x86::group_scores_f16(q, hd, k, n, scale, out, stride),
                    KvView::F32(k) => x86::group_scores_f32(q, hd, k, n, scale, out, stride),
                }
            }
        }
        return;
    }
    for (g, q) in q_heads.chunks_exact(hd).enumerate() {
        block_scores(q, keys, scale, &mut out[g * stride..g * stride + n]);
    }
}

/// The weighted value sums of the heads that share one KV head: for each head `g`,
/// `out[g*hd..][..hd] += Σ_j (weights[g * stride + j] * inv[g]) * value_j` over the first `n`
/// values, in order. Bit for bit what `block_accumulate` gives each head alone; the AVX-512
/// path widens each value once for all the heads.
pub fn group_accumulate(weights: &[f32], stride: usize, n: usize, inv: &[f32], values: KvView<'_>, out: &mut [f32]) {
    let heads = inv.len();
    let hd = out.len().checked_div(heads).unwrap_or(0);
    assert!(heads == 0 || (heads - 1) * stride + n <= weights.len(), "weights too short");
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(16) && avx512_f16c() {
        assert!(values.len() >= n * hd, "block holds fewer values than asked for");
        for (c, (inv, out)) in inv.chunks(GROUP_CHUNK).zip(out.chunks_mut(GROUP_CHUNK * hd)).enumerate() {
            let weights = &weights[c * GROUP_CHUNK * stride..];
            // SAFETY: the CPU has the features; bounds are asserted above.
            unsafe {
                match values {
                    KvView::F16(v) => x86::group_accumulate_f16(weights, stride, n, inv, v, out),
                    KvView::F32(v) => x86::group_accumulate_f32(weights, stride, n, inv, v, out),
                }
            }
        }
        return;
    }
    for (g, out) in out.chunks_exact_mut(hd.max(1)).enumerate().take(heads) {
        block_accumulate(&weights[g * stride..g * stride + n], inv[g], values, out);
    }
}

/// Query heads handled together by the group kernels: their accumulators (4 registers a
/// head) and the shared keys fit AVX-512's 32 registers. Larger groups go in chunks.
const GROUP_CHUNK: usize = 4;

/// `scores[i] = exp(scores[i] - max)`, returning their sum. The vector path evaluates
/// glibc's `expf` algorithm (a 32-entry table of 2^(i/32) and a cubic in double precision)
/// eight lanes at a time, so each value is what `f32::exp` returns on glibc, bit for bit
/// (`exp_matches_libm_bitwise`), and sums in eight lanes: a single running sum was a chain of
/// dependent adds as slow as the exponentials. The order depends only on the slice, so a
/// row's softmax is the same whatever else is in the batch.
pub fn exp_shifted_sum(scores: &mut [f32], max: f32) -> f32 {
    let (mut done, mut sum) = (0, 0f32);
    #[cfg(target_arch = "x86_64")]
    match crate::vmath::exp8_isa() {
        // SAFETY: the CPU has the features each function is compiled for.
        Some(ExpIsa::Avx512) => (done, sum) = unsafe { x86::exp_shifted_avx512(scores, max) },
        Some(ExpIsa::Avx2) => (done, sum) = unsafe { x86::exp_shifted_avx2(scores, max) },
        None => {}
    }
    for s in &mut scores[done..] {
        *s = (*s - max).exp();
        sum += *s;
    }
    sum
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    crate::vmath::exp8_isa() == Some(ExpIsa::Avx512)
}

#[cfg(target_arch = "x86_64")]
fn avx512_f16c() -> bool {
    avx512() && avx2_f16c()
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
    use crate::vmath::x86::{in_range, Exp8, Exp8Avx2, Exp8Avx512};
    use core::arch::x86_64::*;
    use half::f16;

    /// Loads eight elements as f32.
    trait Lanes: Copy {
        unsafe fn load8(p: *const Self) -> __m256;
        fn widen(self) -> f32;
        /// Eight elements from `a` in the low half, eight from `b` in the high half (AVX-512).
        unsafe fn load8x2(a: *const Self, b: *const Self) -> __m512;
        /// Sixteen elements (AVX-512).
        unsafe fn load16(p: *const Self) -> __m512;
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
        #[inline(always)]
        unsafe fn load8x2(a: *const Self, b: *const Self) -> __m512 {
            unsafe {
                let lo = _mm256_castsi128_si256(_mm_loadu_si128(a as *const __m128i));
                _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(lo, _mm_loadu_si128(b as *const __m128i)))
            }
        }
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> __m512 {
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
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
        #[inline(always)]
        unsafe fn load8x2(a: *const Self, b: *const Self) -> __m512 {
            unsafe {
                let lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a)));
                _mm512_castpd_ps(_mm512_insertf64x4::<1>(lo, _mm256_castps_pd(_mm256_loadu_ps(b))))
            }
        }
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
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

    /// `group_scores` for up to four heads. Key pairs share a register (key `j` in the low
    /// half, `j+1` in the high half), so every lane does what `scores`' eight-lane sums do, and
    /// the halves are split back into the same per-key vectors before the same transpose.
    #[inline(always)]
    unsafe fn scores_group<const G: usize, T: Lanes>(
        q: &[f32],
        hd: usize,
        keys: &[T],
        n: usize,
        scale: f32,
        out: &mut [f32],
        stride: usize,
    ) {
        unsafe {
            let scale8 = _mm256_set1_ps(scale);
            let mut j = 0;
            while j + 8 <= n {
                let mut acc = [[_mm512_setzero_ps(); 4]; G];
                let mut i = 0;
                while i < hd {
                    let qd: [__m512; G] = core::array::from_fn(|g| {
                        _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(
                            q.as_ptr().add(g * hd + i),
                        ))))
                    });
                    for p in 0..4 {
                        let k0 = keys.as_ptr().add((j + 2 * p) * hd + i);
                        let kv = T::load8x2(k0, k0.add(hd));
                        for g in 0..G {
                            acc[g][p] = _mm512_add_ps(acc[g][p], _mm512_mul_ps(qd[g], kv));
                        }
                    }
                    i += 8;
                }
                for (g, acc) in acc.iter().enumerate() {
                    let per_key: [__m256; 8] = core::array::from_fn(|r| {
                        let v = _mm512_castps_pd(acc[r / 2]);
                        _mm256_castpd_ps(if r % 2 == 0 {
                            _mm512_castpd512_pd256(v)
                        } else {
                            _mm512_extractf64x4_pd::<1>(v)
                        })
                    });
                    let lanes = transpose8(per_key);
                    let mut sum = lanes[0];
                    for lane in &lanes[1..] {
                        sum = _mm256_add_ps(sum, *lane);
                    }
                    _mm256_storeu_ps(out.as_mut_ptr().add(g * stride + j), _mm256_mul_ps(sum, scale8));
                }
                j += 8;
            }
            for g in 0..G {
                for jj in j..n {
                    out[g * stride + jj] = dot(&q[g * hd..(g + 1) * hd], &keys[jj * hd..(jj + 1) * hd]) * scale;
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn scores_group_any<T: Lanes>(
        q: &[f32],
        hd: usize,
        keys: &[T],
        n: usize,
        scale: f32,
        out: &mut [f32],
        stride: usize,
    ) {
        unsafe {
            match q.len() / hd {
                1 => scores_group::<1, T>(q, hd, keys, n, scale, out, stride),
                2 => scores_group::<2, T>(q, hd, keys, n, scale, out, stride),
                3 => scores_group::<3, T>(q, hd, keys, n, scale, out, stride),
                _ => scores_group::<4, T>(q, hd, keys, n, scale, out, stride),
            }
        }
    }

    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub unsafe fn group_scores_f16(
        q: &[f32],
        hd: usize,
        keys: &[f16],
        n: usize,
        scale: f32,
        out: &mut [f32],
        stride: usize,
    ) {
        unsafe { scores_group_any(q, hd, keys, n, scale, out, stride) }
    }

    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub unsafe fn group_scores_f32(
        q: &[f32],
        hd: usize,
        keys: &[f32],
        n: usize,
        scale: f32,
        out: &mut [f32],
        stride: usize,
    ) {
        unsafe { scores_group_any(q, hd, keys, n, scale, out, stride) }
    }

    /// `group_accumulate` for up to four heads over `NV` × 16 output dims from `d0`: each
    /// value slice is widened once and added into every head's registers, values in order
    /// (each lane does what `accumulate` does).
    #[inline(always)]
    unsafe fn accumulate_group<const G: usize, const NV: usize, T: Lanes>(
        weights: &[f32],
        stride: usize,
        n: usize,
        inv: &[f32],
        values: &[T],
        hd: usize,
        d0: usize,
        out: &mut [f32],
    ) {
        unsafe {
            let mut o = [[_mm512_setzero_ps(); NV]; G];
            for (g, o) in o.iter_mut().enumerate() {
                for (x, v) in o.iter_mut().enumerate() {
                    *v = _mm512_loadu_ps(out.as_ptr().add(g * hd + d0 + 16 * x));
                }
            }
            for j in 0..n {
                let v: [__m512; NV] = core::array::from_fn(|x| T::load16(values.as_ptr().add(j * hd + d0 + 16 * x)));
                for (g, o) in o.iter_mut().enumerate() {
                    let a = _mm512_set1_ps(*weights.get_unchecked(g * stride + j) * inv[g]);
                    for (x, ov) in o.iter_mut().enumerate() {
                        *ov = _mm512_add_ps(*ov, _mm512_mul_ps(a, v[x]));
                    }
                }
            }
            for (g, o) in o.iter().enumerate() {
                for (x, v) in o.iter().enumerate() {
                    _mm512_storeu_ps(out.as_mut_ptr().add(g * hd + d0 + 16 * x), *v);
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn accumulate_group_any<T: Lanes>(
        weights: &[f32],
        stride: usize,
        n: usize,
        inv: &[f32],
        values: &[T],
        out: &mut [f32],
    ) {
        let hd = out.len() / inv.len();
        macro_rules! run {
            ($g:literal) => {{
                let mut d0 = 0;
                while d0 + 64 <= hd {
                    accumulate_group::<$g, 4, T>(weights, stride, n, inv, values, hd, d0, out);
                    d0 += 64;
                }
                while d0 < hd {
                    accumulate_group::<$g, 1, T>(weights, stride, n, inv, values, hd, d0, out);
                    d0 += 16;
                }
            }};
        }
        unsafe {
            match inv.len() {
                1 => run!(1),
                2 => run!(2),
                3 => run!(3),
                _ => run!(4),
            }
        }
    }

    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub unsafe fn group_accumulate_f16(
        weights: &[f32],
        stride: usize,
        n: usize,
        inv: &[f32],
        values: &[f16],
        out: &mut [f32],
    ) {
        unsafe { accumulate_group_any(weights, stride, n, inv, values, out) }
    }

    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub unsafe fn group_accumulate_f32(
        weights: &[f32],
        stride: usize,
        n: usize,
        inv: &[f32],
        values: &[f32],
        out: &mut [f32],
    ) {
        unsafe { accumulate_group_any(weights, stride, n, inv, values, out) }
    }

    /// Whole groups of eight from the start; returns how many were done and their sum (eight
    /// lane sums, then added lane 0 to 7). A group with any |x| ≥ 88 or NaN stops it, and the
    /// caller's `f32::exp` takes over from there.
    #[inline(always)]
    unsafe fn exp_shifted<E: Exp8>(scores: &mut [f32], max: f32) -> (usize, f32) {
        unsafe {
            let exp = E::new();
            let vmax = _mm256_set1_ps(max);
            let mut lanes = _mm256_setzero_ps();
            let mut i = 0;
            while i + 8 <= scores.len() {
                let p = scores.as_mut_ptr().add(i);
                let x = _mm256_sub_ps(_mm256_loadu_ps(p), vmax);
                if !in_range(x) {
                    break;
                }
                let e = exp.exp(x);
                _mm256_storeu_ps(p, e);
                lanes = _mm256_add_ps(lanes, e);
                i += 8;
            }
            let mut out = [0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), lanes);
            (i, out.iter().fold(0f32, |a, &b| a + b))
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_shifted_avx512(scores: &mut [f32], max: f32) -> (usize, f32) {
        unsafe { exp_shifted::<Exp8Avx512>(scores, max) }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted_avx2(scores: &mut [f32], max: f32) -> (usize, f32) {
        unsafe { exp_shifted::<Exp8Avx2>(scores, max) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector exp returns exactly what `f32::exp` (glibc's `expf`) returns, over the range
    /// softmax feeds it and beyond, including the special cases it hands back.
    #[test]
    fn exp_matches_libm_bitwise() {
        let mut x: Vec<f32> = Vec::new();
        let mut s = 12345u64;
        for _ in 0..4_000_000 {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            x.push(-((s >> 40) as f32 / (1u64 << 24) as f32) * 87.99);
        }
        x.extend((0..20_000).map(|i| -(i as f32) * 1e-4));
        x.extend([0.0, -0.0, -87.99, -1e-30, -1e-40, 0.5, 3.0, -1.0]);
        let bulk = x.len() / 8 * 8;
        // Every vector path this CPU has, whichever `exp_shifted_sum` takes: the same bits as
        // `f32::exp` and the same sum.
        #[cfg(target_arch = "x86_64")]
        {
            type Path = unsafe fn(&mut [f32], f32) -> (usize, f32);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let mut paths: Vec<(&str, Path)> = Vec::new();
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                paths.push(("AVX2", x86::exp_shifted_avx2));
            }
            if avx512() {
                paths.push(("AVX-512", x86::exp_shifted_avx512));
            }
            let want: Vec<f32> = x[..bulk].iter().map(|v| v.exp()).collect();
            for (name, path) in paths {
                let mut probe = x[..bulk].to_vec();
                // SAFETY: the CPU has the path's features (checked above).
                let (done, sum) = unsafe { path(&mut probe, 0.0) };
                assert_eq!(done, bulk, "the {name} path ran");
                if cfg!(target_env = "gnu") {
                    assert_eq!(bits(&probe), bits(&want), "{name} exp");
                }
                let mut chosen = x[..bulk].to_vec();
                assert_eq!(exp_shifted_sum(&mut chosen, 0.0).to_bits(), sum.to_bits(), "{name} sum");
            }
        }
        // Then the cases it leaves to the scalar call.
        x.extend([-88.0, -103.9, -104.0, -1e30, f32::NEG_INFINITY, f32::NAN, 88.5, 0.25]);
        let want: Vec<u32> = x.iter().map(|v| v.exp().to_bits()).collect();
        let mut got = x.clone();
        exp_shifted_sum(&mut got, 0.0);
        let bad: Vec<(f32, u32, u32)> = x
            .iter()
            .zip(got.iter().zip(&want))
            // The algorithm is glibc's; another libm may differ from it in the last bit.
            .filter(
                |(_, (g, w))| if cfg!(target_env = "gnu") { g.to_bits() != **w } else { g.to_bits().abs_diff(**w) > 1 },
            )
            .map(|(v, (g, w))| (*v, g.to_bits(), *w))
            .take(5)
            .collect();
        assert!(bad.is_empty(), "{bad:?}");
    }

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

    /// The GQA group kernels give every head bit for bit what the one-head kernels give it,
    /// for group sizes below, at and above the chunk of four, full groups of eight keys and
    /// tails, both cache types, and head sizes the vector path takes or leaves.
    #[test]
    fn group_kernels_equal_one_head_at_a_time_bitwise() {
        for hd in [64usize, 128, 80, 48, 13] {
            for heads in [1usize, 2, 3, 4, 5, 7] {
                for n in [16usize, 13, 5] {
                    let stride = n + 3;
                    let q: Vec<f32> = (0..heads * hd).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.137).collect();
                    let k32: Vec<f32> = (0..n * hd).map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.0913).collect();
                    let k16: Vec<f16> = k32.iter().map(|&x| f16::from_f32(x)).collect();
                    let inv: Vec<f32> = (0..heads).map(|g| 0.3 + g as f32 * 0.07).collect();
                    for keys in [KvView::F32(&k32), KvView::F16(&k16)] {
                        let mut got = vec![0f32; heads * stride];
                        group_scores(&q, hd, keys, n, 0.125, &mut got, stride);
                        let mut want = vec![0f32; heads * stride];
                        for g in 0..heads {
                            scores_portable(
                                &q[g * hd..(g + 1) * hd],
                                keys,
                                0.125,
                                &mut want[g * stride..g * stride + n],
                            );
                        }
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&want), "scores, hd {hd}, {heads} heads, {n} keys");

                        let mut acc = vec![0.25f32; heads * hd];
                        group_accumulate(&got, stride, n, &inv, keys, &mut acc);
                        let mut acc_want = vec![0.25f32; heads * hd];
                        for g in 0..heads {
                            let w = &got[g * stride..g * stride + n];
                            accumulate_portable(w, inv[g], keys, &mut acc_want[g * hd..(g + 1) * hd]);
                        }
                        assert_eq!(bits(&acc), bits(&acc_want), "values, hd {hd}, {heads} heads, {n} keys");
                    }
                }
            }
        }
    }
}
