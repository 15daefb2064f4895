//! Vector math shared by the model, attention and sampling: glibc's `expf`, eight lanes at a
//! time, bit for bit. Softmax and SiLU both call `exp`, and both must round exactly as the scalar
//! `f32::exp` does, or a 30-layer model turns last-bit differences into visible log-prob
//! shifts (and single steps would stop matching verified blocks).

/// Which vector `exp` this CPU runs: [`x86::Exp8Avx512`], or [`x86::Exp8Avx2`] on CPUs with
/// AVX2 and FMA but no AVX-512. Both give the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpIsa {
    Avx512,
    Avx2,
}

pub(crate) fn exp8_isa() -> Option<ExpIsa> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static ISA: OnceLock<Option<ExpIsa>> = OnceLock::new();
        *ISA.get_or_init(|| {
            if is_x86_feature_detected!("avx512f") {
                Some(ExpIsa::Avx512)
            } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                Some(ExpIsa::Avx2)
            } else {
                None
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use core::arch::x86_64::*;

    /// glibc's `__exp2f_data`: `TABLE[i]` = bits of 2^(i/32) minus `i << 47`, so that adding
    /// `k << 47` puts k/32's integer part into the exponent.
    fn exp_table() -> &'static [u64; 32] {
        use std::sync::OnceLock;
        static TABLE: OnceLock<[u64; 32]> = OnceLock::new();
        TABLE.get_or_init(|| std::array::from_fn(|i| (i as f64 / 32.0).exp2().to_bits() - ((i as u64) << 47)))
    }
    const INV_LN2_32: f64 = std::f64::consts::LOG2_E * 32.0; // 0x1.71547652b82fep+0 · 32
    const SHIFT: u64 = 0x4338_0000_0000_0000; // 0x1.8p+52: adding it rounds to an integer
    const C0: u64 = 0x3FAC_6AF8_4B91_2394; // 0x1.c6af84b912394p-5, scaled by 32^-3 below
    const C1: u64 = 0x3FCE_BFCE_50FA_C4F3; // 0x1.ebfce50fac4f3p-3, by 32^-2
    const C2: u64 = 0x3FE6_2E42_FF0C_52D6; // 0x1.62e42ff0c52d6p-1, by 32^-1

    /// glibc's `expf` algorithm (a 32-entry table of 2^(i/32) and a cubic in double
    /// precision) on eight lanes. Only for inputs that pass [`in_range`]: glibc's special
    /// cases (|x| ≥ 88, NaN) are left to the scalar call. Callers must be compiled with the
    /// implementation's features (the methods are inlined into them).
    pub(crate) trait Exp8 {
        unsafe fn new() -> Self;
        unsafe fn exp(&self, x: __m256) -> __m256;
    }

    /// Every lane finite and below 88 in magnitude.
    #[inline(always)]
    pub(crate) fn in_range(x: __m256) -> bool {
        unsafe {
            let abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0), x);
            _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_NLT_UQ>(abs, _mm256_set1_ps(88.0))) == 0
        }
    }

    /// The table in registers, looked up with two-table permutes. AVX-512F.
    pub(crate) struct Exp8Avx512 {
        t: [__m512i; 4],
        inv_ln2: __m512d,
        shift: __m512d,
        c: [__m512d; 3],
    }

    impl Exp8 for Exp8Avx512 {
        #[inline(always)]
        unsafe fn new() -> Self {
            let table = exp_table();
            unsafe {
                Self {
                    t: core::array::from_fn(|i| _mm512_loadu_si512(table.as_ptr().add(8 * i) as *const _)),
                    inv_ln2: _mm512_set1_pd(INV_LN2_32),
                    shift: _mm512_set1_pd(f64::from_bits(SHIFT)),
                    c: [
                        _mm512_set1_pd(f64::from_bits(C0) / 32768.0),
                        _mm512_set1_pd(f64::from_bits(C1) / 1024.0),
                        _mm512_set1_pd(f64::from_bits(C2) / 32.0),
                    ],
                }
            }
        }

        #[inline(always)]
        unsafe fn exp(&self, x: __m256) -> __m256 {
            unsafe {
                let z = _mm512_mul_pd(self.inv_ln2, _mm512_cvtps_pd(x));
                let kd_shifted = _mm512_add_pd(z, self.shift);
                let ki = _mm512_castpd_si512(kd_shifted);
                let r = _mm512_sub_pd(z, _mm512_sub_pd(kd_shifted, self.shift));
                let lo = _mm512_permutex2var_epi64(self.t[0], ki, self.t[1]);
                let hi = _mm512_permutex2var_epi64(self.t[2], ki, self.t[3]);
                let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
                let t = _mm512_add_epi64(_mm512_mask_blend_epi64(upper, lo, hi), _mm512_slli_epi64::<47>(ki));
                let s = _mm512_castsi512_pd(t);
                let zp = _mm512_fmadd_pd(self.c[0], r, self.c[1]);
                let r2 = _mm512_mul_pd(r, r);
                let y = _mm512_fmadd_pd(zp, r2, _mm512_fmadd_pd(self.c[2], r, _mm512_set1_pd(1.0)));
                _mm512_cvtpd_ps(_mm512_mul_pd(y, s))
            }
        }
    }

    /// The same arithmetic on two halves of four doubles, the table looked up with a gather.
    /// AVX2 and FMA.
    pub(crate) struct Exp8Avx2 {
        table: *const i64,
        inv_ln2: __m256d,
        shift: __m256d,
        c: [__m256d; 3],
    }

    impl Exp8Avx2 {
        #[inline(always)]
        unsafe fn exp4(&self, x: __m128) -> __m128 {
            unsafe {
                let z = _mm256_mul_pd(self.inv_ln2, _mm256_cvtps_pd(x));
                let kd_shifted = _mm256_add_pd(z, self.shift);
                let ki = _mm256_castpd_si256(kd_shifted);
                let r = _mm256_sub_pd(z, _mm256_sub_pd(kd_shifted, self.shift));
                let at = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
                let entry = _mm256_i64gather_epi64::<8>(self.table, at);
                let t = _mm256_add_epi64(entry, _mm256_slli_epi64::<47>(ki));
                let s = _mm256_castsi256_pd(t);
                let zp = _mm256_fmadd_pd(self.c[0], r, self.c[1]);
                let r2 = _mm256_mul_pd(r, r);
                let y = _mm256_fmadd_pd(zp, r2, _mm256_fmadd_pd(self.c[2], r, _mm256_set1_pd(1.0)));
                _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
            }
        }
    }

    impl Exp8 for Exp8Avx2 {
        #[inline(always)]
        unsafe fn new() -> Self {
            unsafe {
                Self {
                    table: exp_table().as_ptr() as *const i64,
                    inv_ln2: _mm256_set1_pd(INV_LN2_32),
                    shift: _mm256_set1_pd(f64::from_bits(SHIFT)),
                    c: [
                        _mm256_set1_pd(f64::from_bits(C0) / 32768.0),
                        _mm256_set1_pd(f64::from_bits(C1) / 1024.0),
                        _mm256_set1_pd(f64::from_bits(C2) / 32.0),
                    ],
                }
            }
        }

        #[inline(always)]
        unsafe fn exp(&self, x: __m256) -> __m256 {
            unsafe {
                let lo = self.exp4(_mm256_castps256_ps128(x));
                let hi = self.exp4(_mm256_extractf128_ps::<1>(x));
                _mm256_set_m128(hi, lo)
            }
        }
    }
    /// Whole groups of eight of [`super::exp_gaps`]; a group with a lane out of [`Exp8`]'s
    /// range (−∞, NaN, far below the maximum) takes the vector result for its other lanes
    /// and the scalar formula for those. Returns how many elements were done.
    #[inline(always)]
    unsafe fn exp_gaps<E: Exp8>(xs: &[f32], max: f32, scale: f32, out: &mut [f32]) -> usize {
        let n = xs.len().min(out.len()) / 8 * 8;
        unsafe {
            let exp = E::new();
            let (vmax, vscale) = (_mm256_set1_ps(max), _mm256_set1_ps(scale));
            let (limit, sign) = (_mm256_set1_ps(88.0), _mm256_set1_ps(-0.0));
            let mut i = 0;
            while i < n {
                let x = _mm256_loadu_ps(xs.as_ptr().add(i));
                // The scalar formula's operations: x − max, then the product (no fused multiply).
                let gap = _mm256_mul_ps(_mm256_sub_ps(x, vmax), vscale);
                let outside = _mm256_cmp_ps::<_CMP_NLT_UQ>(_mm256_andnot_ps(sign, gap), limit);
                let mask = _mm256_movemask_ps(outside);
                // Lanes outside the range get an in-range stand-in, then their scalar value.
                let e = exp.exp(_mm256_andnot_ps(outside, gap));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), e);
                if mask != 0 {
                    for j in 0..8 {
                        if mask & (1 << j) != 0 {
                            out[i + j] = super::exp_gap_out_of_range(xs[i + j], max, scale);
                        }
                    }
                }
                i += 8;
            }
            n
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_gaps_avx512(xs: &[f32], max: f32, scale: f32, out: &mut [f32]) -> usize {
        unsafe { exp_gaps::<Exp8Avx512>(xs, max, scale, out) }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_gaps_avx2(xs: &[f32], max: f32, scale: f32, out: &mut [f32]) -> usize {
        unsafe { exp_gaps::<Exp8Avx2>(xs, max, scale, out) }
    }
}

/// `exp((x − max)·scale)`: a softmax weight, 1 at the maximum and 0 for −∞ and NaN. The
/// scalar formula that [`exp_gaps`] computes eight lanes at a time, bit for bit.
#[inline]
pub(crate) fn exp_gap(x: f32, max: f32, scale: f32) -> f32 {
    if !(x > f32::NEG_INFINITY) {
        0.0
    } else if x == max {
        1.0
    } else {
        ((x - max) * scale).exp()
    }
}

/// Below this, `f32::exp` underflows to 0 (its threshold is about −103.97).
#[cfg(target_arch = "x86_64")]
const EXP_ZERO_BELOW: f32 = -104.0;

/// [`exp_gap`] of every `xs[i]` into `out[i]`. Sampling at temperature > 0 takes one per
/// vocabulary entry for every sampled or verified row: on a 49k vocabulary the scalar calls
/// cost about a seventh of a SmolLM2 decode step.
pub(crate) fn exp_gaps(xs: &[f32], max: f32, scale: f32, out: &mut [f32]) {
    let n = xs.len().min(out.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    match exp8_isa() {
        // SAFETY: the CPU has the features each function is compiled for.
        Some(ExpIsa::Avx512) => done = unsafe { x86::exp_gaps_avx512(&xs[..n], max, scale, &mut out[..n]) },
        Some(ExpIsa::Avx2) => done = unsafe { x86::exp_gaps_avx2(&xs[..n], max, scale, &mut out[..n]) },
        None => {}
    }
    for (o, &x) in out[done..n].iter_mut().zip(&xs[done..n]) {
        *o = exp_gap(x, max, scale);
    }
}

/// [`exp_gap`] for a lane the vector path left out: far below the maximum it is 0 without
/// calling `exp` (low temperatures put most of a vocabulary there).
#[cfg(target_arch = "x86_64")]
#[inline]
fn exp_gap_out_of_range(x: f32, max: f32, scale: f32) -> f32 {
    // Still `exp_gap` bit for bit: a −∞ logit's gap is −∞ (0 either way); a NaN's gap and the
    // maximum's (NaN or 0) never pass the test.
    if (x - max) * scale < EXP_ZERO_BELOW {
        0.0
    } else {
        exp_gap(x, max, scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp_underflows_to_zero_below_the_shortcut() {
        // `exp_gap_out_of_range` returns 0 there without calling `exp`.
        let mut x = EXP_ZERO_BELOW;
        while x > -200.0 {
            assert_eq!(x.exp(), 0.0, "exp({x})");
            x = f32::from_bits(x.to_bits() + 997); // towards −∞
        }
        assert!((-103.9f32).exp() > 0.0, "the shortcut is not above the threshold");
    }

    #[test]
    fn exp_gaps_equal_the_scalar_formula_bitwise() {
        let mut seed = 12345u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32
        };
        let specials = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, -0.0, 0.0, -87.9, -88.0, -103.97, -104.1];
        for &scale in &[1.0f32, 1.0 / 0.7, 10.0, 1.0 / 1.7, 1e4, 1e30] {
            for len in [0usize, 1, 7, 8, 9, 64, 1001] {
                let mut xs: Vec<f32> = (0..len).map(|_| next() * 60.0 - 45.0).collect();
                for (i, &v) in specials.iter().enumerate() {
                    if i * 13 < len {
                        xs[i * 13] = v;
                    }
                }
                let finite_max = xs.iter().copied().filter(|v| v.is_finite()).fold(f32::NEG_INFINITY, f32::max);
                for max in [xs.iter().copied().fold(f32::NEG_INFINITY, f32::max), finite_max] {
                    let mut out = vec![f32::NAN; len];
                    exp_gaps(&xs, max, scale, &mut out);
                    for (i, (&x, &o)) in xs.iter().zip(&out).enumerate() {
                        let want = exp_gap(x, max, scale);
                        assert_eq!(o.to_bits(), want.to_bits(), "x {x}, max {max}, scale {scale}, lane {i}");
                    }
                }
            }
        }
    }
}
