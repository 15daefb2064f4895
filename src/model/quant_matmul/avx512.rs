//! The kernels on AVX-512 with VNNI: `vpdpbusd` on a tile of 16 output columns.

use super::{
    ActBlock, ActivationLevels, Packed, PackedMatrix, QuantizedRows, BLOCK, BLOCKS_PER_SUPER, MAX_ROWS, SUPER_BLOCK,
    TILE_N,
};
use core::arch::x86_64::*;

/// How far ahead, in weight blocks of one tile (8 KiB of Q8_0 here), to ask for the
/// weights. 8–16 measured alike on this machine; 0 and 32 were slower.
const PREFETCH_BLOCKS: usize = 16;

/// The hardware prefetcher alone does not keep up once several rows share a tile:
/// without this, loading and computing took turns (8 rows: 1.5× slower). Past the end
/// of this thread's tiles it only prefetches lines it will not use.
#[inline(always)]
unsafe fn prefetch(p: *const u8, bytes: usize) {
    for line in 0..bytes.div_ceil(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line * 64) as *const i8);
    }
}

/// Requests the tile's weight block `PREFETCH_BLOCKS` after the one at `w` (each `bytes`
/// long).
#[inline(always)]
unsafe fn prefetch_weights_ahead(w: *const u8, bytes: usize) {
    unsafe { prefetch(w.wrapping_add(PREFETCH_BLOCKS * bytes), bytes) }
}

/// Requests the 16 per-row values (f16 scales or minima, u32 fifth bits) of the block
/// `PREFETCH_BLOCKS` after the current one, whose values start at `current`.
#[inline(always)]
unsafe fn prefetch_row_values_ahead<T>(current: *const T) {
    unsafe { prefetch(current.wrapping_add(PREFETCH_BLOCKS * TILE_N) as *const u8, std::mem::size_of::<T>() * TILE_N) }
}

/// A packed Q4_1 block's 256 bytes of nibbles widened to 8 groups of 4 inputs × 16 rows:
/// groups 0..4 are the low nibbles (inputs 0..16), 4..8 the high ones (16..32).
#[inline(always)]
unsafe fn q4_1_nibbles(w: *const u8) -> [__m512i; 8] {
    unsafe {
        let nibble = _mm512_set1_epi8(0x0F);
        let packed: [__m512i; 4] = core::array::from_fn(|g| _mm512_loadu_si512(w.add(g * 64) as *const _));
        core::array::from_fn(|g| {
            if g < 4 {
                _mm512_and_si512(packed[g], nibble)
            } else {
                _mm512_and_si512(_mm512_srli_epi16::<4>(packed[g - 4]), nibble)
            }
        })
    }
}

/// Σ over 8 groups of 4 inputs of weight bytes × the row's activation bytes, from `init`.
/// Two independent chains of `vpdpbusd`, added at the end: one chain of eight waits on
/// each instruction's latency (4–12% slower at 8 and 64 rows). Integer sums are exact,
/// so the split changes nothing in the result.
#[inline(always)]
unsafe fn dot_block(init: __m512i, wv: &[__m512i; 8], a: *const i32) -> __m512i {
    let mut even = init;
    let mut odd = _mm512_setzero_si512();
    for g in (0..8).step_by(2) {
        even = _mm512_dpbusd_epi32(even, wv[g], _mm512_set1_epi32(a.add(g).read_unaligned()));
        odd = _mm512_dpbusd_epi32(odd, wv[g + 1], _mm512_set1_epi32(a.add(g + 1).read_unaligned()));
    }
    _mm512_add_epi32(even, odd)
}

/// Σ over groups 0..4 (inputs 0..16) and over groups 4..8 (16..32) apart, from `init_lo`
/// and `init_hi`: four independent chains.
#[inline(always)]
unsafe fn dot_halves(init_lo: __m512i, init_hi: __m512i, wv: &[__m512i; 8], a: *const i32) -> (__m512i, __m512i) {
    let zero = _mm512_setzero_si512();
    let at = |g: usize| _mm512_set1_epi32(a.add(g).read_unaligned());
    let lo0 = _mm512_dpbusd_epi32(init_lo, wv[0], at(0));
    let lo1 = _mm512_dpbusd_epi32(zero, wv[1], at(1));
    let hi0 = _mm512_dpbusd_epi32(init_hi, wv[4], at(4));
    let hi1 = _mm512_dpbusd_epi32(zero, wv[5], at(5));
    let lo0 = _mm512_dpbusd_epi32(lo0, wv[2], at(2));
    let lo1 = _mm512_dpbusd_epi32(lo1, wv[3], at(3));
    let hi0 = _mm512_dpbusd_epi32(hi0, wv[6], at(6));
    let hi1 = _mm512_dpbusd_epi32(hi1, wv[7], at(7));
    (_mm512_add_epi32(lo0, lo1), _mm512_add_epi32(hi0, hi1))
}

/// One weight block of an output tile, ready for the dot products.
pub(super) struct TileBlock {
    /// 8 groups of 4 inputs × 16 rows, as unsigned bytes.
    pub(super) wv: [__m512i; 8],
    /// The 16 rows' scales (of inputs 0..16 only, when `scale_hi` is set).
    pub(super) scale: __m512,
    /// Q6_K: the scales of inputs 16..32; the two halves are summed and scaled apart.
    pub(super) scale_hi: Option<__m512>,
    /// What the bytes carry on top of the signed weight (Q8_0: +128, Q5_0: +16): the
    /// integer sum starts at −offset·Σa, exact, so it cancels.
    pub(super) offset: i32,
    /// Q4_1's minima, added as `m·s_a`.
    pub(super) min: Option<__m512>,
}

/// What runs one output tile's blocks once a weight type has said how to decode them
/// (`block`) and how to dequantise one input's column for the outliers (`column`): the VNNI
/// loop here ([`Vnni`]), or AMX tiles (`super::amx`). Both apply the same float operations in
/// the same order to the same exact integer sums.
pub(super) trait TileDriver {
    #[allow(clippy::too_many_arguments)]
    unsafe fn run<const ROWS: usize>(
        &mut self,
        p: &PackedMatrix,
        nt: usize,
        acts: &QuantizedRows,
        r0: usize,
        out: *mut f32,
        block: impl FnMut(usize, bool) -> TileBlock,
        column: impl FnMut(usize, usize) -> __m512,
    );
}

/// `vpdpbusd` on up to [`MAX_ROWS`] rows per pass over a tile's weights.
pub(super) struct Vnni;

impl TileDriver for Vnni {
    #[inline(always)]
    unsafe fn run<const ROWS: usize>(
        &mut self,
        p: &PackedMatrix,
        nt: usize,
        acts: &QuantizedRows,
        r0: usize,
        out: *mut f32,
        block: impl FnMut(usize, bool) -> TileBlock,
        column: impl FnMut(usize, usize) -> __m512,
    ) {
        unsafe { tile_rows::<ROWS>(p, nt, acts, r0, out, block, column) }
    }
}

/// The loop every kernel shares: `ROWS` activation rows from `r0` against output tile
/// `nt`, over all of `k`, with `block(b, ahead)` decoding the tile's weight block `b` (and
/// asking for the blocks after it when `ahead`) and `column(b, i)` dequantising input `i`
/// of block `b` for the tile's 16 rows. Per block and row: `acc += cvt(Σ w·q −
/// offset·Σq) · (d_w·d)`, with two levels the same for the remainder `r` with `d_r`, then
/// `+= m·s` for Q4_1. With [`ActivationLevels::Outliers`], each of a row's outliers then
/// adds `w_i·x` in a pass of its own (the tile's weights are still in cache), so the
/// blocks' loop runs without a per-block test. The same float operations in the same
/// order whatever the rows (row invariance).
#[inline(always)]
unsafe fn tile_rows<const ROWS: usize>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    mut block: impl FnMut(usize, bool) -> TileBlock,
    mut column: impl FnMut(usize, usize) -> __m512,
) {
    unsafe {
        let acc = match acts.levels {
            ActivationLevels::Two => levels_loop::<ROWS, true>(p, acts, r0, &mut block),
            ActivationLevels::One => levels_loop::<ROWS, false>(p, acts, r0, &mut block),
            ActivationLevels::Outliers => {
                let mut acc = levels_loop::<ROWS, false>(p, acts, r0, &mut block);
                add_outliers(&mut acc, acts, r0, &mut column);
                acc
            }
        };
        store_rows(&acc, p, nt, r0, out);
    }
}

/// [`ActivationLevels::Outliers`]: each row's outliers, `w_i·x` in f32 with the input's
/// dequantised weights (`column`), for rows `r0..r0 + acc.len()`, group of [`MAX_ROWS`] rows by
/// group: a group's inputs are dequantised once for all its rows, and a row without an input
/// among them adds `0·w`, so each row gets its own terms in its own order whatever the pass.
#[inline(always)]
pub(super) unsafe fn add_outliers(
    acc: &mut [__m512],
    acts: &QuantizedRows,
    r0: usize,
    column: &mut impl FnMut(usize, usize) -> __m512,
) {
    unsafe {
        for g in r0 / MAX_ROWS..(r0 + acc.len()).div_ceil(MAX_ROWS) {
            let first = g * MAX_ROWS - r0;
            let inputs = acts.group_at[g] as usize..acts.group_at[g + 1] as usize;
            for (&(b, i), xs) in acts.group_inputs[inputs.clone()].iter().zip(&acts.group_x[inputs]) {
                let w = column(b as usize, i as usize);
                for (acc, &x) in acc[first..].iter_mut().zip(xs) {
                    *acc = _mm512_fmadd_ps(w, _mm512_set1_ps(x), *acc);
                }
            }
        }
    }
}

/// Rows `r0..` of output tile `nt`.
#[inline(always)]
pub(super) unsafe fn store_rows(acc: &[__m512], p: &PackedMatrix, nt: usize, r0: usize, out: *mut f32) {
    unsafe {
        for (r, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add((r0 + r) * p.n + nt * TILE_N), *acc);
        }
    }
}

/// Every block's first level (and with `SECOND` its remainder) for `ROWS` rows.
#[inline(always)]
unsafe fn levels_loop<const ROWS: usize, const SECOND: bool>(
    p: &PackedMatrix,
    acts: &QuantizedRows,
    r0: usize,
    block: &mut impl FnMut(usize, bool) -> TileBlock,
) -> [__m512; ROWS] {
    unsafe {
        let kb_n = p.k / BLOCK;
        let mut acc = [_mm512_setzero_ps(); ROWS];
        for b in 0..kb_n {
            let w = block(b, true);
            for (r, acc) in acc.iter_mut().enumerate() {
                let row = r0 + r;
                let at = row * acts.k + b * BLOCK;
                // `r` is empty unless there are two levels.
                let (q, rest) = (acts.q.as_ptr().add(at) as *const i32, acts.r.as_ptr().wrapping_add(at) as *const i32);
                let a = acts.blocks.get_unchecked(row * kb_n + b);
                if let Some(scale_hi) = w.scale_hi {
                    // Per half: acc += cvt(Σ w·q − offset·Σq) · (d_w·d), low half first.
                    let init = |sum: i32| _mm512_set1_epi32(-w.offset * sum);
                    let (lo, hi) = dot_halves(init(a.sum_lo), init(a.sum - a.sum_lo), &w.wv, q);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(w.scale, _mm512_set1_ps(a.d)), *acc);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(scale_hi, _mm512_set1_ps(a.d)), *acc);
                    if SECOND {
                        *acc = add_remainder(*acc, &w, a, rest);
                    }
                    continue;
                }
                let isum = dot_block(_mm512_set1_epi32(-w.offset * a.sum), &w.wv, q);
                let scale = _mm512_mul_ps(w.scale, _mm512_set1_ps(a.d));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *acc);
                if SECOND {
                    *acc = add_remainder(*acc, &w, a, rest);
                }
                if let Some(min) = w.min {
                    *acc = _mm512_fmadd_ps(min, _mm512_set1_ps(a.s), *acc);
                }
            }
        }
        acc
    }
}

/// `acc + cvt(Σ w·r − offset·Σr) · (d_w·d_r)`, per half when the block has two scales.
#[inline(always)]
unsafe fn add_remainder(acc: __m512, w: &TileBlock, a: &ActBlock, rest: *const i32) -> __m512 {
    unsafe {
        let init = |sum: i32| _mm512_set1_epi32(-w.offset * sum);
        if let Some(scale_hi) = w.scale_hi {
            let (lo, hi) = dot_halves(init(a.sum_r_lo), init(a.sum_r - a.sum_r_lo), &w.wv, rest);
            let (dl, dh) =
                (_mm512_mul_ps(w.scale, _mm512_set1_ps(a.d_r)), _mm512_mul_ps(scale_hi, _mm512_set1_ps(a.d_r)));
            let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), dl, acc);
            return _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), dh, acc);
        }
        let isum_r = dot_block(init(a.sum_r), &w.wv, rest);
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum_r), _mm512_mul_ps(w.scale, _mm512_set1_ps(a.d_r)), acc)
    }
}

/// The 16 f16 values of one block's rows, widened.
#[inline(always)]
unsafe fn row_values(p: *const half::f16) -> __m512 {
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
}

/// Byte `i % 4` of each of the 16 dwords at `group` (one row's 4 inputs of one group):
/// input `i` of the tile's 16 rows, as i32 lanes.
#[inline(always)]
unsafe fn lane_bytes(group: *const u8, i: usize) -> __m512i {
    unsafe {
        let bytes = _mm512_srlv_epi32(_mm512_loadu_si512(group as *const _), _mm512_set1_epi32(8 * (i % 4) as i32));
        _mm512_and_si512(bytes, _mm512_set1_epi32(0xFF))
    }
}

/// Input `i`'s four low bits in the nibble layout of [`q4_1_nibbles`] (block at `w`).
#[inline(always)]
unsafe fn lane_nibbles(w: *const u8, i: usize) -> __m512i {
    unsafe {
        let bytes = lane_bytes(w.add((i % 16) / 4 * 64), i);
        _mm512_and_si512(_mm512_srlv_epi32(bytes, _mm512_set1_epi32(4 * (i / 16) as i32)), _mm512_set1_epi32(0x0F))
    }
}

/// `(q − offset)·scale`, as the portable loops compute it.
#[inline(always)]
unsafe fn scaled(q: __m512i, offset: i32, scale: __m512) -> __m512 {
    unsafe { _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(offset))), scale) }
}

/// Q8_0: weights stored +128 as bytes, so they are already unsigned.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn q8_0_rows<const ROWS: usize, D: TileDriver>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    driver: &mut D,
) {
    let Packed::Q8_0 { qs, d } = &p.weights else { unreachable!("Q8_0 kernel on other weights") };
    let kb_n = p.k / BLOCK;
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK);
    let d = d.as_ptr().add(nt * kb_n * TILE_N);
    driver.run::<ROWS>(
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
            TileBlock {
                wv: core::array::from_fn(|g| _mm512_loadu_si512(w.add(g * 64) as *const _)),
                scale: row_values(d.add(b * TILE_N)),
                scale_hi: None,
                offset: 128,
                min: None,
            }
        },
        |b, i| scaled(lane_bytes(qs.add(b * TILE_N * BLOCK + i / 4 * 64), i), 128, row_values(d.add(b * TILE_N))),
    );
}

/// Q4_1: Σ(d·q + m)·(d_a·a) = d·d_a·Σq·a + m·s_a, the split llama.cpp uses.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn q4_1_rows<const ROWS: usize, D: TileDriver>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    driver: &mut D,
) {
    let Packed::Q4_1 { qs, d, m } = &p.weights else { unreachable!("Q4_1 kernel on other weights") };
    let kb_n = p.k / BLOCK;
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let (d, m) = (d.as_ptr().add(nt * kb_n * TILE_N), m.as_ptr().add(nt * kb_n * TILE_N));
    driver.run::<ROWS>(
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
                scale: row_values(d.add(b * TILE_N)),
                scale_hi: None,
                offset: 0,
                min: Some(row_values(m.add(b * TILE_N))),
            }
        },
        |b, i| {
            let q = _mm512_cvtepi32_ps(lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i));
            _mm512_fmadd_ps(q, row_values(d.add(b * TILE_N)), row_values(m.add(b * TILE_N)))
        },
    );
}

/// A packed Q5_0 block's 16 rows × 32 weights as 8 groups of 4 inputs × 16 rows, unsigned
/// 0..32: the nibbles as Q4_1's, each byte's fifth bit from its row's `qh` word (bit j for
/// input j, and group g holds inputs 4g..4g+4).
#[inline(always)]
unsafe fn q5_0_weights(w: *const u8, qh: *const u32) -> [__m512i; 8] {
    unsafe {
        let low = q4_1_nibbles(w);
        let qh = _mm512_loadu_si512(qh as *const _);
        // Each dword's low byte copied to its four bytes, then byte i of the dword tests
        // bit i: the four fifth bits of one group land in their four bytes.
        let copy_low_byte = _mm512_set4_epi32(0x0C0C_0C0C, 0x0808_0808, 0x0404_0404, 0);
        let bit_of_byte = _mm512_set1_epi32(0x0804_0201);
        let sixteen = _mm512_set1_epi8(0x10);
        core::array::from_fn(|g| {
            let bits = _mm512_srlv_epi32(qh, _mm512_set1_epi32(4 * g as i32));
            let copied = _mm512_shuffle_epi8(bits, copy_low_byte);
            let set = _mm512_test_epi8_mask(copied, bit_of_byte);
            _mm512_or_si512(low[g], _mm512_maskz_mov_epi8(set, sixteen))
        })
    }
}

/// Q5_0: Σ d·(q − 16)·(d_a·a) = d·d_a·(Σq·a − 16·Σa), the split llama.cpp uses.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn q5_0_rows<const ROWS: usize, D: TileDriver>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    driver: &mut D,
) {
    let Packed::Q5_0 { qs, qh, d } = &p.weights else { unreachable!("Q5_0 kernel on other weights") };
    let kb_n = p.k / BLOCK;
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let (qh, d) = (qh.as_ptr().add(nt * kb_n * TILE_N), d.as_ptr().add(nt * kb_n * TILE_N));
    driver.run::<ROWS>(
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
                scale: row_values(d.add(b * TILE_N)),
                scale_hi: None,
                offset: 16,
                min: None,
            }
        },
        |b, i| {
            let fifth =
                _mm512_srlv_epi32(_mm512_loadu_si512(qh.add(b * TILE_N) as *const _), _mm512_set1_epi32(i as i32));
            let fifth = _mm512_slli_epi32::<4>(_mm512_and_si512(fifth, _mm512_set1_epi32(1)));
            let q = _mm512_or_si512(lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i), fifth);
            scaled(q, 16, row_values(d.add(b * TILE_N)))
        },
    );
}

/// 16 small integers (bytes, unsigned or signed) widened to floats.
#[inline(always)]
unsafe fn u8_values(p: *const u8) -> __m512 {
    unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))) }
}

#[inline(always)]
unsafe fn i8_values(p: *const i8) -> __m512 {
    unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))) }
}

/// Q4_K: Q4_1's arithmetic with scale d·sc and minimum −dmin·m (both exact in f32).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn q4k_rows<const ROWS: usize, D: TileDriver>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    driver: &mut D,
) {
    let Packed::Q4K { qs, sc, m, d, dmin_neg } = &p.weights else { unreachable!("Q4_K kernel on other weights") };
    let (kb_n, sb_n) = (p.k / BLOCK, p.k / SUPER_BLOCK);
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let (sc, m) = (sc.as_ptr().add(nt * kb_n * TILE_N), m.as_ptr().add(nt * kb_n * TILE_N));
    let (d, dmin_neg) = (d.as_ptr().add(nt * sb_n * TILE_N), dmin_neg.as_ptr().add(nt * sb_n * TILE_N));
    driver.run::<ROWS>(
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
                scale: _mm512_mul_ps(u8_values(sc.add(b * TILE_N)), row_values(d.add(sb * TILE_N))),
                scale_hi: None,
                offset: 0,
                min: Some(_mm512_mul_ps(u8_values(m.add(b * TILE_N)), row_values(dmin_neg.add(sb * TILE_N)))),
            }
        },
        |b, i| {
            let sb = b / BLOCKS_PER_SUPER;
            let q = _mm512_cvtepi32_ps(lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i));
            let scale = _mm512_mul_ps(u8_values(sc.add(b * TILE_N)), row_values(d.add(sb * TILE_N)));
            let min = _mm512_mul_ps(u8_values(m.add(b * TILE_N)), row_values(dmin_neg.add(sb * TILE_N)));
            _mm512_fmadd_ps(q, scale, min)
        },
    );
}

/// A packed Q6_K block as 8 groups of 4 inputs × 16 rows, unsigned 0..64: the nibbles as
/// Q4_1's, with the top two bits of group g from bit pair g%4 of `qh` vector g/4.
#[inline(always)]
unsafe fn q6k_weights(w: *const u8, qh: *const u8) -> [__m512i; 8] {
    unsafe {
        let low = q4_1_nibbles(w);
        let high = [_mm512_loadu_si512(qh as *const _), _mm512_loadu_si512(qh.add(64) as *const _)];
        let pair = _mm512_set1_epi8(0x03);
        core::array::from_fn(|g| {
            // Bit pair g%4 of each byte, moved to bits 4..6; 16-bit shifts are safe, as the
            // mask keeps only bits that came from the same byte.
            let bits = _mm512_and_si512(_mm512_srlv_epi16(high[g / 4], _mm512_set1_epi16(2 * (g % 4) as i16)), pair);
            _mm512_or_si512(low[g], _mm512_slli_epi16::<4>(bits))
        })
    }
}

/// Q6_K: Σ d·sc·(q − 32)·(d_a·a) per half block of 16 inputs, each half with its scale.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn q6k_rows<const ROWS: usize, D: TileDriver>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    driver: &mut D,
) {
    let Packed::Q6K { qs, qh, sc, d } = &p.weights else { unreachable!("Q6_K kernel on other weights") };
    let (kb_n, sb_n) = (p.k / BLOCK, p.k / SUPER_BLOCK);
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let qh = qh.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 4);
    let sc = sc.as_ptr().add(nt * kb_n * 2 * TILE_N);
    let d = d.as_ptr().add(nt * sb_n * TILE_N);
    driver.run::<ROWS>(
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
                scale: _mm512_mul_ps(i8_values(sc.add(b * 2 * TILE_N)), row_d),
                scale_hi: Some(_mm512_mul_ps(i8_values(sc.add(b * 2 * TILE_N + TILE_N)), row_d)),
                offset: 32,
                min: None,
            }
        },
        |b, i| {
            let g = i / 4;
            let high = lane_bytes(qh.add(b * TILE_N * BLOCK / 4 + g / 4 * 64), i);
            let high =
                _mm512_and_si512(_mm512_srlv_epi32(high, _mm512_set1_epi32(2 * (g % 4) as i32)), _mm512_set1_epi32(3));
            let q = _mm512_or_si512(lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i), _mm512_slli_epi32::<4>(high));
            let half_scale = i8_values(sc.add(b * 2 * TILE_N + i / 16 * TILE_N));
            scaled(q, 32, _mm512_mul_ps(half_scale, row_values(d.add(b / BLOCKS_PER_SUPER * TILE_N))))
        },
    );
}

/// One level of one block held in two vectors: `q = round(x / d)` (ties to even),
/// `d = max|x| / 127`, stored as bytes at `out`; returns `d`, Σq, Σq over the first 16 and
/// the rounded values as floats.
#[inline(always)]
unsafe fn quantize_level(lo: __m512, hi: __m512, out: *mut i8) -> (f32, i32, i32, __m512, __m512) {
    unsafe {
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        let (d, id) = super::block_scale(amax);
        let vid = _mm512_set1_ps(id);
        // Round to nearest even, as `round_ties_even` in the portable version, and no
        // lower than −127, as its `max(−127)`.
        let floor = _mm512_set1_epi32(-127);
        let qlo = _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(lo, vid)), floor);
        let qhi = _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(hi, vid)), floor);
        _mm_storeu_si128(out as *mut __m128i, _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128(out.add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(qhi));
        let total = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        (d, total, _mm512_reduce_add_epi32(qlo), _mm512_cvtepi32_ps(qlo), _mm512_cvtepi32_ps(qhi))
    }
}

/// [`super::largest_untaken`] on one block of 32.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn largest_untaken(xs: &[f32], taken: u32) -> (usize, f32) {
    assert!(xs.len() >= BLOCK);
    let (keep_lo, keep_hi) = (!taken as u16, !(taken >> 16) as u16);
    let lo = _mm512_maskz_mov_ps(keep_lo, _mm512_abs_ps(_mm512_loadu_ps(xs.as_ptr())));
    let hi = _mm512_maskz_mov_ps(keep_hi, _mm512_abs_ps(_mm512_loadu_ps(xs.as_ptr().add(16))));
    let max = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(lo, hi)));
    let at_max = (_mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(keep_hi, hi, max) as u32) << 16
        | _mm512_mask_cmp_ps_mask::<_CMP_EQ_OQ>(keep_lo, lo, max) as u32;
    if at_max == 0 {
        return (BLOCK, 0.0);
    }
    let top = at_max.trailing_zeros() as usize;
    let others = !taken & !(1u32 << top);
    let lo = _mm512_maskz_mov_ps(others as u16, lo);
    let hi = _mm512_maskz_mov_ps((others >> 16) as u16, hi);
    (top, _mm512_reduce_max_ps(_mm512_max_ps(lo, hi)))
}

#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn quantize_range(x: &[f32], q: &mut [i8], r: &mut [i8], blocks: &mut [ActBlock], two_level: bool) {
    let n = x.len() / BLOCK;
    assert!(q.len() >= n * BLOCK && (!two_level || r.len() >= n * BLOCK) && blocks.len() >= n);
    for b in 0..n {
        let xs = x.as_ptr().add(b * BLOCK);
        let (lo, hi) = (_mm512_loadu_ps(xs), _mm512_loadu_ps(xs.add(16)));
        let (d, sum, sum_lo, qlo, qhi) = quantize_level(lo, hi, q.as_mut_ptr().add(b * BLOCK));
        if !two_level {
            *blocks.get_unchecked_mut(b) = ActBlock { d, sum, sum_lo, s: d * sum as f32, ..ActBlock::default() };
            continue;
        }
        // x − q·d with one rounding.
        let vd = _mm512_set1_ps(d);
        let (rlo, rhi) = (_mm512_fnmadd_ps(qlo, vd, lo), _mm512_fnmadd_ps(qhi, vd, hi));
        let (d_r, sum_r, sum_r_lo, _, _) = quantize_level(rlo, rhi, r.as_mut_ptr().add(b * BLOCK));
        *blocks.get_unchecked_mut(b) =
            ActBlock { d, d_r, sum, sum_r, sum_lo, sum_r_lo, s: d_r.mul_add(sum_r as f32, d * sum as f32), taken: 0 };
    }
}

/// Input `i`'s fifth bit from the rows' `qh` words (bit i), at bit 4, as i32 lanes.
#[inline(always)]
unsafe fn lane_fifth(qh: *const u32, i: usize) -> __m512i {
    unsafe {
        let bits = _mm512_srlv_epi32(_mm512_loadu_si512(qh as *const _), _mm512_set1_epi32(i as i32));
        _mm512_slli_epi32::<4>(_mm512_and_si512(bits, _mm512_set1_epi32(1)))
    }
}

/// Q4_0: Σ d·(q − 8)·(d_a·a) = d·d_a·(Σq·a − 8·Σa), the split llama.cpp uses.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn q4_0_rows<const ROWS: usize, D: TileDriver>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    driver: &mut D,
) {
    let Packed::Q4_0 { qs, d } = &p.weights else { unreachable!("Q4_0 kernel on other weights") };
    let kb_n = p.k / BLOCK;
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let d = d.as_ptr().add(nt * kb_n * TILE_N);
    driver.run::<ROWS>(
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
                scale: row_values(d.add(b * TILE_N)),
                scale_hi: None,
                offset: 8,
                min: None,
            }
        },
        |b, i| scaled(lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i), 8, row_values(d.add(b * TILE_N))),
    );
}

/// Q5_1: Q5_0's weights without the offset, with Q4_1's minimum.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn q5_1_rows<const ROWS: usize, D: TileDriver>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    driver: &mut D,
) {
    let Packed::Q5_1 { qs, qh, d, m } = &p.weights else { unreachable!("Q5_1 kernel on other weights") };
    let kb_n = p.k / BLOCK;
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let (qh, d, m) =
        (qh.as_ptr().add(nt * kb_n * TILE_N), d.as_ptr().add(nt * kb_n * TILE_N), m.as_ptr().add(nt * kb_n * TILE_N));
    driver.run::<ROWS>(
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
                scale: row_values(d.add(b * TILE_N)),
                scale_hi: None,
                offset: 0,
                min: Some(row_values(m.add(b * TILE_N))),
            }
        },
        |b, i| {
            let q = _mm512_or_si512(lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i), lane_fifth(qh.add(b * TILE_N), i));
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), row_values(d.add(b * TILE_N)), row_values(m.add(b * TILE_N)))
        },
    );
}

/// Q5_K: Q4_K's arithmetic on five-bit values (Q5_0's weights without the offset).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn q5k_rows<const ROWS: usize, D: TileDriver>(
    p: &PackedMatrix,
    nt: usize,
    acts: &QuantizedRows,
    r0: usize,
    out: *mut f32,
    driver: &mut D,
) {
    let Packed::Q5K { qs, qh, sc, m, d, dmin_neg } = &p.weights else { unreachable!("Q5_K kernel on other weights") };
    let (kb_n, sb_n) = (p.k / BLOCK, p.k / SUPER_BLOCK);
    let qs = qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK / 2);
    let qh = qh.as_ptr().add(nt * kb_n * TILE_N);
    let (sc, m) = (sc.as_ptr().add(nt * kb_n * TILE_N), m.as_ptr().add(nt * kb_n * TILE_N));
    let (d, dmin_neg) = (d.as_ptr().add(nt * sb_n * TILE_N), dmin_neg.as_ptr().add(nt * sb_n * TILE_N));
    driver.run::<ROWS>(
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
                scale: _mm512_mul_ps(u8_values(sc.add(b * TILE_N)), row_values(d.add(sb * TILE_N))),
                scale_hi: None,
                offset: 0,
                min: Some(_mm512_mul_ps(u8_values(m.add(b * TILE_N)), row_values(dmin_neg.add(sb * TILE_N)))),
            }
        },
        |b, i| {
            let sb = b / BLOCKS_PER_SUPER;
            let q = _mm512_or_si512(lane_nibbles(qs.add(b * TILE_N * BLOCK / 2), i), lane_fifth(qh.add(b * TILE_N), i));
            let scale = _mm512_mul_ps(u8_values(sc.add(b * TILE_N)), row_values(d.add(sb * TILE_N)));
            let min = _mm512_mul_ps(u8_values(m.add(b * TILE_N)), row_values(dmin_neg.add(sb * TILE_N)));
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, min)
        },
    );
}
