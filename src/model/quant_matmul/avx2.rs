//! The AVX-512 kernels' arithmetic on AVX2 CPUs (AMD Zen 2/3, Intel client cores without
//! AVX-512): each 512-bit vector of a tile's 16 rows is two 256-bit halves, rows 0..8 and
//! 8..16, and `vpdpbusd` is `vpmaddubsw` (unsigned × signed bytes, pairs summed into i16)
//! then `vpmaddwd` by ones (pairs into i32). The i16 pair sums are exact while a weight byte
//! stays below 128: the 4- to 6-bit types do (at most 2·63·127), but Q8_0's bytes carry +128,
//! so its weights go signed, as their absolute value times the activation with the weight's
//! sign (llama.cpp's trick), at most 2·128·127. The small types' i16 sums of several groups
//! of 4 inputs are added before one `vpmaddwd` widens them (`avx2::dot_groups`), which
//! halves the multiply instructions for 4-bit weights: on AVX2 those multiplies are what a
//! batch of rows waits for. Integer sums are exact either way, and the float operations are the
//! AVX-512 kernels' in the same order, so both give the portable loops' results bit for bit.
//! Activations are quantised here too ([`quantize_range`]), with the AVX-512 path's arithmetic.

use super::{
    ActBlock, ActivationLevels, Packed, PackedMatrix, QuantizedRows, BLOCK, BLOCKS_PER_SUPER, MAX_ROWS, SUPER_BLOCK,
    TILE_N,
};
use core::arch::x86_64::*;

/// As the AVX-512 kernels'.
const PREFETCH_BLOCKS: usize = 16;

/// 16 lanes of 32 bits (or 64 bytes), one per tile row: rows 0..8, then 8..16.
#[derive(Clone, Copy)]
struct TileI32([__m256i; 2]);
/// 16 f32 lanes, one per tile row.
#[derive(Clone, Copy)]
struct TileF32([__m256; 2]);

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load64(p: *const u8) -> TileI32 {
    unsafe { TileI32([_mm256_loadu_si256(p as *const __m256i), _mm256_loadu_si256(p.add(32) as *const __m256i)]) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn map(a: TileI32, f: impl Fn(__m256i) -> __m256i) -> TileI32 {
    TileI32([f(a.0[0]), f(a.0[1])])
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn set1_i32(v: i32) -> TileI32 {
    TileI32([_mm256_set1_epi32(v); 2])
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn set1_f32(v: f32) -> TileF32 {
    TileF32([_mm256_set1_ps(v); 2])
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_i32(a: TileI32, b: TileI32) -> TileI32 {
    TileI32([_mm256_add_epi32(a.0[0], b.0[0]), _mm256_add_epi32(a.0[1], b.0[1])])
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn cvt(a: TileI32) -> TileF32 {
    TileF32([_mm256_cvtepi32_ps(a.0[0]), _mm256_cvtepi32_ps(a.0[1])])
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul(a: TileF32, b: TileF32) -> TileF32 {
    TileF32([_mm256_mul_ps(a.0[0], b.0[0]), _mm256_mul_ps(a.0[1], b.0[1])])
}

/// `a·b + c`, fused.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fmadd(a: TileF32, b: TileF32, c: TileF32) -> TileF32 {
    TileF32([_mm256_fmadd_ps(a.0[0], b.0[0], c.0[0]), _mm256_fmadd_ps(a.0[1], b.0[1], c.0[1])])
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch(p: *const u8, bytes: usize) {
    for line in 0..bytes.div_ceil(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line * 64) as *const i8);
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch_weights_ahead(w: *const u8, bytes: usize) {
    unsafe { prefetch(w.wrapping_add(PREFETCH_BLOCKS * bytes), bytes) }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch_row_values_ahead<T>(current: *const T) {
    unsafe { prefetch(current.wrapping_add(PREFETCH_BLOCKS * TILE_N) as *const u8, std::mem::size_of::<T>() * TILE_N) }
}

/// As the AVX-512 `q4_1_nibbles`: groups 0..4 the low nibbles, 4..8 the high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_nibbles(w: *const u8) -> [TileI32; 8] {
    unsafe {
        let nibble = _mm256_set1_epi8(0x0F);
        let packed: [TileI32; 4] = core::array::from_fn(|g| load64(w.add(g * 64)));
        core::array::from_fn(|g| {
            if g < 4 {
                map(packed[g], |v| _mm256_and_si256(v, nibble))
            } else {
                map(packed[g - 4], |v| _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble))
            }
        })
    }
}

/// `init + Σ_{groups from..to} Σ_{4 bytes} w·a` per 32-bit lane: `vpdpbusd` as
/// `vpmaddubsw` (pairs of products, in i16) and `vpmaddwd` (pairs of those, in i32). The i16
/// sums of `PER` groups are added before one `vpmaddwd` widens them, which halves the
/// multiply instructions for 4-bit weights: a lane of one group holds two products of at
/// most `w_max·127` (activations stay within ±127), so `PER` groups fit while
/// `2·PER·w_max·127 ≤ 32767`: 8 for 4-bit weights, 4 for 5-bit, 2 for 6-bit, 1 for Q8_0.
/// The sums are exact either way, so the result is too. With `signs` (Q8_0), the weights
/// are `|w|` and each activation byte takes `w`'s sign.
///
/// Always inlined, and so without `target_feature` (Rust refuses the two together): it only
/// runs inside the AVX2 kernels, whose features its intrinsics take on once inlined. Left to
/// the inliner, Q8_0's `dot_block` (`PER` 1, the longest body) stayed a call for passes of 1–6
/// rows, and those Q8_0 matmuls ran 1.5–2.3× slower (`examples/matmul_rows.rs`).
#[inline(always)]
unsafe fn dot_groups<const PER: usize>(init: TileI32, w: &TileBlock, a: *const i32, from: usize, to: usize) -> TileI32 {
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = init;
        let mut g = from;
        while g < to {
            let mut sums = [_mm256_setzero_si256(); 2];
            for j in 0..PER {
                let av = _mm256_set1_epi32(a.add(g + j).read_unaligned());
                for (h, sum) in sums.iter_mut().enumerate() {
                    let av = match &w.signs {
                        Some(s) => _mm256_sign_epi8(av, s[g + j].0[h]),
                        None => av,
                    };
                    let pairs = _mm256_maddubs_epi16(w.wv[g + j].0[h], av);
                    *sum = if j == 0 { pairs } else { _mm256_add_epi16(*sum, pairs) };
                }
            }
            acc = add_i32(acc, TileI32(sums.map(|sum| _mm256_madd_epi16(sum, ones))));
            g += PER;
        }
        acc
    }
}

/// Σ over the 8 groups of 4 inputs, from `init` (always inlined, as [`dot_groups`]).
#[inline(always)]
unsafe fn dot_block<const PER: usize>(init: TileI32, w: &TileBlock, a: *const i32) -> TileI32 {
    unsafe { dot_groups::<PER>(init, w, a, 0, 8) }
}

/// Σ over groups 0..4 and over groups 4..8 apart, from `init_lo` and `init_hi`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_halves<const PER: usize>(
    init_lo: TileI32,
    init_hi: TileI32,
    w: &TileBlock,
    a: *const i32,
) -> (TileI32, TileI32) {
    unsafe { (dot_groups::<PER>(init_lo, w, a, 0, 4), dot_groups::<PER>(init_hi, w, a, 4, 8)) }
}

/// As the AVX-512 kernels' `TileBlock`, plus Q8_0's weight signs.
struct TileBlock {
    /// 8 groups of 4 inputs × 16 rows, as unsigned bytes (Q8_0: |w|).
    wv: [TileI32; 8],
    /// Q8_0: the signed weights, whose signs the activations take.
    signs: Option<[TileI32; 8]>,
    scale: TileF32,
    scale_hi: Option<TileF32>,
    offset: i32,
    min: Option<TileF32>,
}

/// The AVX-512 `tile_rows` on two halves; `PER` groups share each i16 sum ([`dot_groups`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_rows<const ROWS: usize, const PER: usize>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    mut block: impl FnMut(usize, bool) -> TileBlock,
    mut column: impl FnMut(usize, usize) -> TileF32,
) {
    unsafe {
        let acc = match acts.levels {
            ActivationLevels::Two => levels_loop::<ROWS, PER, true>(p, acts, r0, &mut block),
            ActivationLevels::One => levels_loop::<ROWS, PER, false>(p, acts, r0, &mut block),
            ActivationLevels::Outliers => {
                let mut acc = levels_loop::<ROWS, PER, false>(p, acts, r0, &mut block);
                let g = r0 / MAX_ROWS;
                let inputs = acts.group_at[g] as usize..acts.group_at[g + 1] as usize;
                for (&(b, i), xs) in acts.group_inputs[inputs.clone()].iter().zip(&acts.group_x[inputs]) {
                    let w = column(b as usize, i as usize);
                    for (acc, &x) in acc.iter_mut().zip(xs) {
                        *acc = fmadd(w, set1_f32(x), *acc);
                    }
                }
                acc
            }
        };
        for (r, acc) in acc.iter().enumerate() {
            let o = out.add((r0 + r) * p.n + nt * TILE_N);
            _mm256_storeu_ps(o, acc.0[0]);
            _mm256_storeu_ps(o.add(8), acc.0[1]);
        }
    }
}

/// The AVX-512 `levels_loop` on two halves.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn levels_loop<const ROWS: usize, const PER: usize, const SECOND: bool>(
    p: &PackedMatrix,
    acts: &QuantizedRows,
    r0: usize,
    block: &mut impl FnMut(usize, bool) -> TileBlock,
) -> [TileF32; ROWS] {
    unsafe {
        let kb_n = p.k / BLOCK;
        let mut acc = [set1_f32(0.0); ROWS];
        for b in 0..kb_n {
            let w = block(b, true);
            for (r, acc) in acc.iter_mut().enumerate() {
                let row = r0 + r;
                let at = row * acts.k + b * BLOCK;
                let (q, rest) = (acts.q.as_ptr().add(at) as *const i32, acts.r.as_ptr().wrapping_add(at) as *const i32);
                let a = acts.blocks.get_unchecked(row * kb_n + b);
                if let Some(scale_hi) = w.scale_hi {
                    let init = |sum: i32| set1_i32(-w.offset * sum);
                    let (lo, hi) = dot_halves::<PER>(init(a.sum_lo), init(a.sum - a.sum_lo), &w, q);
                    *acc = fmadd(cvt(lo), mul(w.scale, set1_f32(a.d)), *acc);
                    *acc = fmadd(cvt(hi), mul(scale_hi, set1_f32(a.d)), *acc);
                    if SECOND {
                        *acc = add_remainder::<PER>(*acc, &w, a, rest);
                    }
                    continue;
                }
                let isum = dot_block::<PER>(set1_i32(-w.offset * a.sum), &w, q);
                *acc = fmadd(cvt(isum), mul(w.scale, set1_f32(a.d)), *acc);
                if SECOND {
                    *acc = add_remainder::<PER>(*acc, &w, a, rest);
                }
                if let Some(min) = w.min {
                    *acc = fmadd(min, set1_f32(a.s), *acc);
                }
            }
        }
        acc
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_remainder<const PER: usize>(acc: TileF32, w: &TileBlock, a: &ActBlock, rest: *const i32) -> TileF32 {
    unsafe {
        let init = |sum: i32| set1_i32(-w.offset * sum);
        if let Some(scale_hi) = w.scale_hi {
            let (lo, hi) = dot_halves::<PER>(init(a.sum_r_lo), init(a.sum_r - a.sum_r_lo), w, rest);
            let (dl, dh) = (mul(w.scale, set1_f32(a.d_r)), mul(scale_hi, set1_f32(a.d_r)));
            let acc = fmadd(cvt(lo), dl, acc);
            return fmadd(cvt(hi), dh, acc);
        }
        let isum_r = dot_block::<PER>(init(a.sum_r), w, rest);
        fmadd(cvt(isum_r), mul(w.scale, set1_f32(a.d_r)), acc)
    }
}

/// The 16 f16 values of one block's rows, widened.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_values(p: *const half::f16) -> TileF32 {
    unsafe {
        TileF32([
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(8) as *const __m128i)),
        ])
    }
}

/// Byte `i % 4` of each of the 16 dwords at `group`, as i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_bytes(group: *const u8, i: usize) -> TileI32 {
    unsafe {
        let shift = _mm256_set1_epi32(8 * (i % 4) as i32);
        map(load64(group), |v| _mm256_and_si256(_mm256_srlv_epi32(v, shift), _mm256_set1_epi32(0xFF)))
    }
}

/// Input `i`'s four low bits in the nibble layout of [`q4_1_nibbles`] (block at `w`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_nibbles(w: *const u8, i: usize) -> TileI32 {
    unsafe {
        let shift = _mm256_set1_epi32(4 * (i / 16) as i32);
        map(lane_bytes(w.add((i % 16) / 4 * 64), i), |v| {
            _mm256_and_si256(_mm256_srlv_epi32(v, shift), _mm256_set1_epi32(0x0F))
        })
    }
}

/// `(q − offset)·scale`, as the portable loops compute it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled(q: TileI32, offset: i32, scale: TileF32) -> TileF32 {
    unsafe { mul(cvt(map(q, |v| _mm256_sub_epi32(v, _mm256_set1_epi32(offset)))), scale) }
}

/// Q8_0: the stored bytes are w + 128; flipping the top bit gives w as a signed byte.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_0_rows<const ROWS: usize>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
) {
    let Packed::Q8_0 { qs, d } = &p.weights else { unreachable!("Q8_0 kernel on other weights") };
    let kb_n = p.k / BLOCK;
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK);
    let d = d.as_ptr().add(nt * kb_n * TILE_N);
    tile_rows::<ROWS, 1>(
        p,
        nt,
        acts,
        r0,
        out,
        |b, ahead| {
            let w = qs.add(b * TILE_N * BLOCK);
            if ahead {
                prefetch_weights_ahead(w, TILE_N * BLOCK);
                prefetch_row_values_ahead(d.wrapping_add(b * TILE_N));
            }
            let top = _mm256_set1_epi8(i8::MIN);
            let signed: [TileI32; 8] =
                core::array::from_fn(|g| map(load64(w.add(g * 64)), |v| _mm256_xor_si256(v, top)));
            TileBlock {
                wv: signed.map(|s| map(s, |v| _mm256_abs_epi8(v))),
                signs: Some(signed),
                scale: row_values(d.add(b * TILE_N)),
                scale_hi: None,
                offset: 0,
                min: None,
            }
        },
        |b, i| scaled(lane_bytes(qs.add(b * TILE_N * BLOCK + i / 4 * 64), i), 128, row_values(d.add(b * TILE_N))),
    );
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_1_rows<const ROWS: usize>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
) {
    let Packed::Q4_1 { qs, d, m } = &p.weights else { unreachable!("Q4_1 kernel on other weights") };
    let kb_n = p.k / BLOCK;
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let (d, m) = (d.as_ptr().add(nt * kb_n * TILE_N), m.as_ptr().add(nt * kb_n * TILE_N));
    tile_rows::<ROWS, 8>(
        p,
        nt,
        acts,
        r0,
        out,
        |b, ahead| {
            let w = qs.add(b * TILE_N * BLOCK / 2);
            if ahead {
                prefetch_weights_ahead(w, TILE_N * BLOCK / 2);
                prefetch_row_values_ahead(d.wrapping_add(b * TILE_N));
                prefetch_row_values_ahead(m.wrapping_add(b * TILE_N));
            }
            TileBlock {
                wv: q4_1_nibbles(w),
                signs: None,
                scale: row_values(d.add(b * TILE_N)),
                scale_hi: None,
                offset: 0,
                min: Some(row_values(m.add(b * TILE_N))),
            }
        },
        |b, i| {
            let q = cvt(lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i));
            fmadd(q, row_values(d.add(b * TILE_N)), row_values(m.add(b * TILE_N)))
        },
    );
}

/// As the AVX-512 `q5_0_weights`: each byte's fifth bit from its row's `qh` word.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_weights(w: *const u8, qh: *const u32) -> [TileI32; 8] {
    unsafe {
        let low = q4_1_nibbles(w);
        let qh = load64(qh as *const u8);
        let copy_low_byte =
            _mm256_set_epi32(0x0C0C_0C0C, 0x0808_0808, 0x0404_0404, 0, 0x0C0C_0C0C, 0x0808_0808, 0x0404_0404, 0);
        let bit_of_byte = _mm256_set1_epi32(0x0804_0201);
        let sixteen = _mm256_set1_epi8(0x10);
        core::array::from_fn(|g| {
            let shift = _mm256_set1_epi32(4 * g as i32);
            TileI32(core::array::from_fn(|h| {
                let copied = _mm256_shuffle_epi8(_mm256_srlv_epi32(qh.0[h], shift), copy_low_byte);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(copied, bit_of_byte), bit_of_byte);
                _mm256_or_si256(low[g].0[h], _mm256_and_si256(set, sixteen))
            }))
        })
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q5_0_rows<const ROWS: usize>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
) {
    let Packed::Q5_0 { qs, qh, d } = &p.weights else { unreachable!("Q5_0 kernel on other weights") };
    let kb_n = p.k / BLOCK;
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let (qh, d) = (qh.as_ptr().add(nt * kb_n * TILE_N), d.as_ptr().add(nt * kb_n * TILE_N));
    tile_rows::<ROWS, 4>(
        p,
        nt,
        acts,
        r0,
        out,
        |b, ahead| {
            let w = qs.add(b * TILE_N * BLOCK / 2);
            if ahead {
                prefetch_weights_ahead(w, TILE_N * BLOCK / 2);
                prefetch_row_values_ahead(d.wrapping_add(b * TILE_N));
                prefetch_row_values_ahead(qh.wrapping_add(b * TILE_N));
            }
            TileBlock {
                wv: q5_0_weights(w, qh.add(b * TILE_N)),
                signs: None,
                scale: row_values(d.add(b * TILE_N)),
                scale_hi: None,
                offset: 16,
                min: None,
            }
        },
        |b, i| {
            let shift = _mm256_set1_epi32(i as i32);
            let fifth = map(load64(qh.add(b * TILE_N) as *const u8), |v| {
                _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srlv_epi32(v, shift), _mm256_set1_epi32(1)))
            });
            let low = lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i);
            let q = TileI32([_mm256_or_si256(low.0[0], fifth.0[0]), _mm256_or_si256(low.0[1], fifth.0[1])]);
            scaled(q, 16, row_values(d.add(b * TILE_N)))
        },
    );
}

/// 16 small integers (bytes) widened to floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn u8_values(p: *const u8) -> TileF32 {
    unsafe {
        let half = |o: usize| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(o) as *const __m128i)));
        TileF32([half(0), half(8)])
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn i8_values(p: *const i8) -> TileF32 {
    unsafe {
        let half = |o: usize| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(o) as *const __m128i)));
        TileF32([half(0), half(8)])
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4k_rows<const ROWS: usize>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
) {
    let Packed::Q4K { qs, sc, m, d, dmin_neg } = &p.weights else { unreachable!("Q4_K kernel on other weights") };
    let (kb_n, sb_n) = (p.k / BLOCK, p.k / SUPER_BLOCK);
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let (sc, m) = (sc.as_ptr().add(nt * kb_n * TILE_N), m.as_ptr().add(nt * kb_n * TILE_N));
    let (d, dmin_neg) = (d.as_ptr().add(nt * sb_n * TILE_N), dmin_neg.as_ptr().add(nt * sb_n * TILE_N));
    tile_rows::<ROWS, 8>(
        p,
        nt,
        acts,
        r0,
        out,
        |b, ahead| {
            let w = qs.add(b * TILE_N * BLOCK / 2);
            if ahead {
                prefetch_weights_ahead(w, TILE_N * BLOCK / 2);
                prefetch_row_values_ahead(sc.wrapping_add(b * TILE_N));
                prefetch_row_values_ahead(m.wrapping_add(b * TILE_N));
            }
            let sb = b / BLOCKS_PER_SUPER;
            TileBlock {
                wv: q4_1_nibbles(w),
                signs: None,
                scale: mul(u8_values(sc.add(b * TILE_N)), row_values(d.add(sb * TILE_N))),
                scale_hi: None,
                offset: 0,
                min: Some(mul(u8_values(m.add(b * TILE_N)), row_values(dmin_neg.add(sb * TILE_N)))),
            }
        },
        |b, i| {
            let sb = b / BLOCKS_PER_SUPER;
            let q = cvt(lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i));
            let scale = mul(u8_values(sc.add(b * TILE_N)), row_values(d.add(sb * TILE_N)));
            let min = mul(u8_values(m.add(b * TILE_N)), row_values(dmin_neg.add(sb * TILE_N)));
            fmadd(q, scale, min)
        },
    );
}

/// As the AVX-512 `q6k_weights`: top two bits of group g from bit pair g%4 of `qh` vector g/4.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_weights(w: *const u8, qh: *const u8) -> [TileI32; 8] {
    unsafe {
        let low = q4_1_nibbles(w);
        let high = [load64(qh), load64(qh.add(64))];
        let pair = _mm256_set1_epi8(0x03);
        core::array::from_fn(|g| {
            let count = _mm_cvtsi32_si128(2 * (g % 4) as i32);
            TileI32(core::array::from_fn(|h| {
                let bits = _mm256_and_si256(_mm256_srl_epi16(high[g / 4].0[h], count), pair);
                _mm256_or_si256(low[g].0[h], _mm256_slli_epi16::<4>(bits))
            }))
        })
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k_rows<const ROWS: usize>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
) {
    let Packed::Q6K { qs, qh, sc, d } = &p.weights else { unreachable!("Q6_K kernel on other weights") };
    let (kb_n, sb_n) = (p.k / BLOCK, p.k / SUPER_BLOCK);
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let qh = qh.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 4);
    let sc = sc.as_ptr().add(nt * kb_n * 2 * TILE_N);
    let d = d.as_ptr().add(nt * sb_n * TILE_N);
    tile_rows::<ROWS, 2>(
        p,
        nt,
        acts,
        r0,
        out,
        |b, ahead| {
            let w = qs.add(b * TILE_N * BLOCK / 2);
            let high = qh.add(b * TILE_N * BLOCK / 4);
            if ahead {
                prefetch_weights_ahead(w, TILE_N * BLOCK / 2);
                prefetch_weights_ahead(high, TILE_N * BLOCK / 4);
                prefetch(sc.wrapping_add((b + PREFETCH_BLOCKS) * 2 * TILE_N) as *const u8, 2 * TILE_N);
            }
            let row_d = row_values(d.add(b / BLOCKS_PER_SUPER * TILE_N));
            TileBlock {
                wv: q6k_weights(w, high),
                signs: None,
                scale: mul(i8_values(sc.add(b * 2 * TILE_N)), row_d),
                scale_hi: Some(mul(i8_values(sc.add(b * 2 * TILE_N + TILE_N)), row_d)),
                offset: 32,
                min: None,
            }
        },
        |b, i| {
            let g = i / 4;
            let shift = _mm256_set1_epi32(2 * (g % 4) as i32);
            let high = map(lane_bytes(qh.add(b * TILE_N * BLOCK / 4 + g / 4 * 64), i), |v| {
                _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srlv_epi32(v, shift), _mm256_set1_epi32(3)))
            });
            let low = lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i);
            let q = TileI32([_mm256_or_si256(low.0[0], high.0[0]), _mm256_or_si256(low.0[1], high.0[1])]);
            let half_scale = i8_values(sc.add(b * 2 * TILE_N + i / 16 * TILE_N));
            scaled(q, 32, mul(half_scale, row_values(d.add(b / BLOCKS_PER_SUPER * TILE_N))))
        },
    );
}

/// Input `i`'s fifth bit from the rows' `qh` words (bit i), at bit 4, as i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_fifth(qh: *const u32, i: usize) -> TileI32 {
    unsafe {
        let shift = _mm256_set1_epi32(i as i32);
        map(load64(qh as *const u8), |v| {
            _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srlv_epi32(v, shift), _mm256_set1_epi32(1)))
        })
    }
}

/// Five-bit values of input `i`: its nibble and its fifth bit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_five_bits(qs: *const u8, qh: *const u32, i: usize) -> TileI32 {
    unsafe {
        let (low, fifth) = (lane_nibbles(qs, i), lane_fifth(qh, i));
        TileI32([_mm256_or_si256(low.0[0], fifth.0[0]), _mm256_or_si256(low.0[1], fifth.0[1])])
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q4_0_rows<const ROWS: usize>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
) {
    let Packed::Q4_0 { qs, d } = &p.weights else { unreachable!("Q4_0 kernel on other weights") };
    let kb_n = p.k / BLOCK;
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let d = d.as_ptr().add(nt * kb_n * TILE_N);
    tile_rows::<ROWS, 8>(
        p,
        nt,
        acts,
        r0,
        out,
        |b, ahead| {
            let w = qs.add(b * TILE_N * BLOCK / 2);
            if ahead {
                prefetch_weights_ahead(w, TILE_N * BLOCK / 2);
                prefetch_row_values_ahead(d.wrapping_add(b * TILE_N));
            }
            TileBlock {
                wv: q4_1_nibbles(w),
                signs: None,
                scale: row_values(d.add(b * TILE_N)),
                scale_hi: None,
                offset: 8,
                min: None,
            }
        },
        |b, i| scaled(lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i), 8, row_values(d.add(b * TILE_N))),
    );
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q5_1_rows<const ROWS: usize>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
) {
    let Packed::Q5_1 { qs, qh, d, m } = &p.weights else { unreachable!("Q5_1 kernel on other weights") };
    let kb_n = p.k / BLOCK;
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let (qh, d, m) =
        (qh.as_ptr().add(nt * kb_n * TILE_N), d.as_ptr().add(nt * kb_n * TILE_N), m.as_ptr().add(nt * kb_n * TILE_N));
    tile_rows::<ROWS, 4>(
        p,
        nt,
        acts,
        r0,
        out,
        |b, ahead| {
            let w = qs.add(b * TILE_N * BLOCK / 2);
            if ahead {
                prefetch_weights_ahead(w, TILE_N * BLOCK / 2);
                prefetch_row_values_ahead(d.wrapping_add(b * TILE_N));
                prefetch_row_values_ahead(m.wrapping_add(b * TILE_N));
                prefetch_row_values_ahead(qh.wrapping_add(b * TILE_N));
            }
            TileBlock {
                wv: q5_0_weights(w, qh.add(b * TILE_N)),
                signs: None,
                scale: row_values(d.add(b * TILE_N)),
                scale_hi: None,
                offset: 0,
                min: Some(row_values(m.add(b * TILE_N))),
            }
        },
        |b, i| {
            let q = cvt(lane_five_bits(qs.add(b * TILE_N * BLOCK / 2), qh.add(b * TILE_N), i));
            fmadd(q, row_values(d.add(b * TILE_N)), row_values(m.add(b * TILE_N)))
        },
    );
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q5k_rows<const ROWS: usize>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
) {
    let Packed::Q5K { qs, qh, sc, m, d, dmin_neg } = &p.weights else { unreachable!("Q5_K kernel on other weights") };
    let (kb_n, sb_n) = (p.k / BLOCK, p.k / SUPER_BLOCK);
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let qh = qh.as_ptr().add(nt * kb_n * TILE_N);
    let (sc, m) = (sc.as_ptr().add(nt * kb_n * TILE_N), m.as_ptr().add(nt * kb_n * TILE_N));
    let (d, dmin_neg) = (d.as_ptr().add(nt * sb_n * TILE_N), dmin_neg.as_ptr().add(nt * sb_n * TILE_N));
    tile_rows::<ROWS, 4>(
        p,
        nt,
        acts,
        r0,
        out,
        |b, ahead| {
            let w = qs.add(b * TILE_N * BLOCK / 2);
            if ahead {
                prefetch_weights_ahead(w, TILE_N * BLOCK / 2);
                prefetch_row_values_ahead(sc.wrapping_add(b * TILE_N));
                prefetch_row_values_ahead(m.wrapping_add(b * TILE_N));
                prefetch_row_values_ahead(qh.wrapping_add(b * TILE_N));
            }
            let sb = b / BLOCKS_PER_SUPER;
            TileBlock {
                wv: q5_0_weights(w, qh.add(b * TILE_N)),
                signs: None,
                scale: mul(u8_values(sc.add(b * TILE_N)), row_values(d.add(sb * TILE_N))),
                scale_hi: None,
                offset: 0,
                min: Some(mul(u8_values(m.add(b * TILE_N)), row_values(dmin_neg.add(sb * TILE_N)))),
            }
        },
        |b, i| {
            let sb = b / BLOCKS_PER_SUPER;
            let q = cvt(lane_five_bits(qs.add(b * TILE_N * BLOCK / 2), qh.add(b * TILE_N), i));
            let scale = mul(u8_values(sc.add(b * TILE_N)), row_values(d.add(sb * TILE_N)));
            let min = mul(u8_values(m.add(b * TILE_N)), row_values(dmin_neg.add(sb * TILE_N)));
            fmadd(q, scale, min)
        },
    );
}

/// One level of one block of 32 activations, as the AVX-512 `quantize_level` does it in four
/// 256-bit quarters: `d = max|x|/127`, `q = round(x/d)` (ties to even) no lower than −127,
/// written as bytes; returns `d`, Σq, Σq over the first 16, and `q` as floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_level(x: [__m256; 4], out: *mut i8) -> (f32, i32, i32, [__m256; 4]) {
    unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let abs = x.map(|v| _mm256_andnot_ps(sign, v));
        let m = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
        let (d, id) = super::block_scale(amax);
        let vid = _mm256_set1_ps(id);
        let floor = _mm256_set1_epi32(-127);
        let q = x.map(|v| _mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, vid)), floor));
        // i32 → i16 → i8 with signed saturation; the packs interleave 128-bit lanes, which
        // the final permute puts back in order.
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(out as *mut __m256i, bytes);
        let lanes = |v: __m256i| {
            let mut l = [0i32; 8];
            _mm256_storeu_si256(l.as_mut_ptr() as *mut __m256i, v);
            l.iter().sum::<i32>()
        };
        let sum_lo = lanes(_mm256_add_epi32(q[0], q[1]));
        let total = sum_lo + lanes(_mm256_add_epi32(q[2], q[3]));
        (d, total, sum_lo, q.map(|v| _mm256_cvtepi32_ps(v)))
    }
}

/// The portable `quantize_range` on AVX2, with the same results.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_range(x: &[f32], q: &mut [i8], r: &mut [i8], blocks: &mut [ActBlock], two_level: bool) {
    let n = x.len() / BLOCK;
    assert!(q.len() >= n * BLOCK && (!two_level || r.len() >= n * BLOCK) && blocks.len() >= n);
    unsafe {
        for b in 0..n {
            let xs = x.as_ptr().add(b * BLOCK);
            let v: [__m256; 4] = core::array::from_fn(|i| _mm256_loadu_ps(xs.add(8 * i)));
            let (d, sum, sum_lo, qf) = quantize_level(v, q.as_mut_ptr().add(b * BLOCK));
            if !two_level {
                *blocks.get_unchecked_mut(b) = ActBlock { d, sum, sum_lo, s: d * sum as f32, ..ActBlock::default() };
                continue;
            }
            // x − q·d with one rounding.
            let vd = _mm256_set1_ps(d);
            let rest: [__m256; 4] = core::array::from_fn(|i| _mm256_fnmadd_ps(qf[i], vd, v[i]));
            let (d_r, sum_r, sum_r_lo, _) = quantize_level(rest, r.as_mut_ptr().add(b * BLOCK));
            *blocks.get_unchecked_mut(b) = ActBlock {
                d,
                d_r,
                sum,
                sum_r,
                sum_lo,
                sum_r_lo,
                s: d_r.mul_add(sum_r as f32, d * sum as f32),
                taken: 0,
            };
        }
    }
}
