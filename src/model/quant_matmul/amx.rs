//! AMX int8 tiles for blocks of several activation rows (verification, batched decode,
//! prefill), where the CPU has them and the kernel grants the tile permission.
//!
//! The integer dot products of a weight block move from `vpdpbusd` to `tdpbssd` (signed
//! activation bytes × signed weight bytes): one instruction takes all of a pass's rows (up
//! to 16) against a tile's 16 output columns × 32 inputs, which on the VNNI path costs 8
//! `vpdpbusd` per row. Each weight block is decoded to bytes once per pass by the same code as
//! the VNNI kernels (`avx512`'s per-type `block` closures), already in the layout `tdpbssd`
//! reads its B tile in (4 inputs × 16 columns per 64-byte row), less the offset the VNNI
//! kernels carry on unsigned bytes (so the sums need no `−offset·Σa` term, the same integer),
//! and stored to a small buffer the tile is loaded from; activations are loaded straight from the quantised rows (stride
//! `k`). The sums come back through memory, and the float epilogue is the VNNI kernels':
//! the same operations in the same order on the same exact integer sums, so results are bit
//! for bit the VNNI kernels' (and so the one-row path's) on every machine.
//!
//! The tile logic is written against [`TileUnit`], with two implementations: [`Tiles`], the
//! instructions, and [`TileModel`] (tests), a scalar model of what `ldtilecfg`, `tilezero`,
//! `tileloadd`, `tdpbssd` and `tilestored` do. So every AVX-512 machine runs the whole kernel
//! in tests, and the real tiles are checked against it where the CPU has them.

use super::avx512::{add_outliers, store_rows, TileBlock, TileDriver};
use super::{ActivationLevels, Packed, PackedMatrix, QuantizedRows, BLOCK, TILE_N};
use core::arch::x86_64::*;

/// Activation rows per pass: a tile's 16 rows.
pub(super) const MAX_TILE_ROWS: usize = 16;

/// Bytes of one tile row.
const TILE_ROW_BYTES: usize = 64;

/// `ldtilecfg`'s 64-byte operand (palette 1): rows and bytes per row of each of the 8 tiles.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    const fn unconfigured() -> Self {
        Self { palette: 0, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] }
    }

    /// Palette 1 with tile `t` of `tiles[t].0` rows of `tiles[t].1` bytes.
    fn palette1(tiles: &[(u8, u16)]) -> Self {
        let mut cfg = Self::unconfigured();
        cfg.palette = 1;
        for (t, &(rows, colsb)) in tiles.iter().enumerate() {
            cfg.rows[t] = rows;
            cfg.colsb[t] = colsb;
        }
        cfg
    }

    #[cfg(test)]
    pub(super) fn for_test(tiles: &[(u8, u16)]) -> Self {
        Self::palette1(tiles)
    }

    /// The tiles of a pass of `rows` activation rows. Whole blocks of 32 (`halves` false), two
    /// sets for alternate blocks: tmm0/1 the first level's sums (rows × 16 i32), tmm2/3 the
    /// activations (rows × 32 bytes), tmm4/5 the weights (8 rows of 4 inputs × 16 columns),
    /// tmm6/7 the remainder's sums. Blocks summed per half of 16 inputs (Q6_K): tmm0/1 and
    /// tmm6/7 the low and high half's sums (alternate blocks, or the two levels), tmm2/3 their
    /// activations (rows × 16 bytes), tmm4/5 their weights (4 rows each).
    fn for_pass(rows: usize, halves: bool) -> Self {
        let r = rows as u8;
        if halves {
            Self::palette1(&[(r, 64), (r, 64), (r, 16), (r, 16), (4, 64), (4, 64), (r, 64), (r, 64)])
        } else {
            Self::palette1(&[(r, 64), (r, 64), (r, 32), (r, 32), (8, 64), (8, 64), (r, 64), (r, 64)])
        }
    }
}

/// The tile operations the kernel uses. Tile numbers are constants, as in the instructions.
pub(super) trait TileUnit {
    /// `ldtilecfg`: sets every tile's shape and zeroes them all.
    unsafe fn configure(&mut self, cfg: &TileConfig);
    /// `tilezero`.
    unsafe fn zero<const T: u8>(&mut self);
    /// `tileloadd`: the tile's rows from `base`, `stride` bytes apart.
    unsafe fn load<const T: u8>(&mut self, base: *const u8, stride: usize);
    /// `tilestored`.
    unsafe fn store<const T: u8>(&mut self, base: *mut u8, stride: usize);
    /// `tdpbssd`: `C[m][n] += Σ_k Σ_i sext(A[m][4k+i]) · sext(B[k][4n+i])`, in i32.
    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self);
}

/// The CPU's tiles. Entering saves the thread's tile configuration (candle's AMX kernel keeps
/// one configured on the pool's threads) and leaving restores it, or releases the tiles.
pub(super) struct Tiles {
    saved: TileConfig,
}

impl Tiles {
    /// # Safety
    /// The CPU has AMX and the process holds the tile permission ([`available`]).
    pub(super) unsafe fn enter() -> Self {
        let mut saved = TileConfig::unconfigured();
        unsafe { core::arch::asm!("sttilecfg [{}]", in(reg) &mut saved, options(nostack)) };
        Self { saved }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: `enter` checked the CPU; a saved palette was valid when it was stored.
        unsafe {
            if self.saved.palette != 0 {
                core::arch::asm!("ldtilecfg [{}]", in(reg) &self.saved, options(nostack, readonly));
            } else {
                core::arch::asm!("tilerelease", options(nostack, nomem));
            }
        }
    }
}

impl TileUnit for Tiles {
    #[inline(always)]
    unsafe fn configure(&mut self, cfg: &TileConfig) {
        unsafe { core::arch::asm!("ldtilecfg [{}]", in(reg) cfg, options(nostack, readonly)) }
    }

    #[inline(always)]
    unsafe fn zero<const T: u8>(&mut self) {
        unsafe { core::arch::asm!("tilezero tmm{t}", t = const T, options(nostack, nomem)) }
    }

    #[inline(always)]
    unsafe fn load<const T: u8>(&mut self, base: *const u8, stride: usize) {
        unsafe {
            core::arch::asm!(
                "tileloadd tmm{t}, [{base} + {stride} * 1]",
                t = const T, base = in(reg) base, stride = in(reg) stride,
                options(nostack, readonly)
            )
        }
    }

    #[inline(always)]
    unsafe fn store<const T: u8>(&mut self, base: *mut u8, stride: usize) {
        unsafe {
            core::arch::asm!(
                "tilestored [{base} + {stride} * 1], tmm{t}",
                t = const T, base = in(reg) base, stride = in(reg) stride,
                options(nostack)
            )
        }
    }

    #[inline(always)]
    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        unsafe {
            core::arch::asm!("tdpbssd tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B, options(nostack, nomem))
        }
    }
}

/// A scalar model of the tiles, with AMX's semantics: loads fill a tile's configured rows and
/// bytes and zero the rest, `tdpbssd` reads the shapes from the configuration and zeroes the
/// destination's unused bytes, and any shape the CPU would fault on panics.
#[cfg(test)]
pub(super) struct TileModel {
    cfg: TileConfig,
    tiles: [[[u8; TILE_ROW_BYTES]; 16]; 8],
}

#[cfg(test)]
impl TileModel {
    pub(super) fn new() -> Self {
        Self { cfg: TileConfig::unconfigured(), tiles: [[[0; TILE_ROW_BYTES]; 16]; 8] }
    }

    fn shape(&self, t: u8) -> (usize, usize) {
        assert_eq!(self.cfg.palette, 1, "tile instruction without a configuration");
        assert!(t < 8, "no tile {t}");
        let (rows, colsb) = (self.cfg.rows[t as usize] as usize, self.cfg.colsb[t as usize] as usize);
        assert!(rows > 0 && colsb > 0, "tile {t} is not configured");
        (rows, colsb)
    }
}

#[cfg(test)]
impl TileUnit for TileModel {
    unsafe fn configure(&mut self, cfg: &TileConfig) {
        assert!(cfg.palette <= 1 && cfg.start_row == 0 && cfg.reserved == [0; 14], "invalid tile configuration");
        for t in 0..16 {
            let (rows, colsb) = (cfg.rows[t] as usize, cfg.colsb[t] as usize);
            assert!(t < 8 || (rows == 0 && colsb == 0), "palette 1 has 8 tiles");
            assert!(rows <= 16 && colsb <= TILE_ROW_BYTES, "tile {t}: {rows} rows of {colsb} bytes");
        }
        self.cfg = *cfg;
        self.tiles = [[[0; TILE_ROW_BYTES]; 16]; 8];
    }

    unsafe fn zero<const T: u8>(&mut self) {
        self.shape(T);
        self.tiles[T as usize] = [[0; TILE_ROW_BYTES]; 16];
    }

    unsafe fn load<const T: u8>(&mut self, base: *const u8, stride: usize) {
        let (rows, colsb) = self.shape(T);
        let tile = &mut self.tiles[T as usize];
        *tile = [[0; TILE_ROW_BYTES]; 16];
        for (r, row) in tile.iter_mut().enumerate().take(rows) {
            // SAFETY: the caller's rows are readable, as for the instruction.
            unsafe { std::ptr::copy_nonoverlapping(base.add(r * stride), row.as_mut_ptr(), colsb) };
        }
    }

    unsafe fn store<const T: u8>(&mut self, base: *mut u8, stride: usize) {
        let (rows, colsb) = self.shape(T);
        for (r, row) in self.tiles[T as usize].iter().enumerate().take(rows) {
            // SAFETY: the caller's rows are writable, as for the instruction.
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), base.add(r * stride), colsb) };
        }
    }

    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        let ((m, c_bytes), (a_rows, a_bytes), (k, b_bytes)) = (self.shape(C), self.shape(A), self.shape(B));
        assert!(C != A && C != B && A != B, "tdpbssd needs three different tiles");
        assert!(a_rows == m && a_bytes == 4 * k && b_bytes == c_bytes && c_bytes % 4 == 0, "tdpbssd shapes");
        let (a, b) = (self.tiles[A as usize], self.tiles[B as usize]);
        let c = &mut self.tiles[C as usize];
        for (row, a_row) in c.iter_mut().zip(&a).take(m) {
            for n in 0..c_bytes / 4 {
                let mut sum = i32::from_le_bytes(row[4 * n..4 * n + 4].try_into().expect("4 bytes"));
                for (kk, b_row) in b.iter().enumerate().take(k) {
                    let products: i32 =
                        (0..4).map(|i| a_row[4 * kk + i] as i8 as i32 * b_row[4 * n + i] as i8 as i32).sum();
                    sum = sum.wrapping_add(products);
                }
                row[4 * n..4 * n + 4].copy_from_slice(&sum.to_le_bytes());
            }
            row[c_bytes..].fill(0);
        }
    }
}

/// Whether this CPU has AMX with int8 tiles and the kernel let this process use them (Linux
/// asks each process to request the tile state first; without it the first tile instruction
/// faults). Asked once.
pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8 (`is_x86_feature_detected!`
        // does not name them on stable Rust).
        let leaf7 = __cpuid_count(7, 0);
        if leaf7.edx & (1 << 24) == 0 || leaf7.edx & (1 << 25) == 0 || super::isa() != Some(super::Isa::Avx512Vnni) {
            return false;
        }
        request_tile_permission()
    })
}

#[cfg(target_os = "linux")]
fn request_tile_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_permission() -> bool {
    false
}

/// Blocks in flight: a block's weights are decoded two blocks ahead of its tile products, its
/// sums stored one block after them and its float epilogue run two blocks after them, so the
/// tile loads do not wait on the stores that feed them and the epilogue does not wait on the
/// tile stores (weights and sums cross between the vector code and the tiles through memory).
/// Measured on Q4_K 8960 × 1536 at 2 rows: 0.63 ms per matmul with each block done in turn,
/// 0.33 ms pipelined.
const RING: usize = 4;

/// 64-byte aligned scratch for [`RING`] blocks.
#[repr(C, align(64))]
struct Scratch {
    /// `[block % RING][8 rows × 64 bytes]`: decoded weights, as the B tile reads them.
    weights: [[u8; 8 * TILE_ROW_BYTES]; RING],
    /// `[block % RING][sum tile 0..4][16 rows × 16 i32]`: the first level's sums (per half:
    /// low, high), then the remainder's.
    sums: [[[i32; 16 * TILE_N]; 4]; RING],
}

/// What the float epilogue needs of a decoded block (its [`TileBlock`] less the weights).
#[derive(Clone, Copy)]
struct BlockScales {
    scale: __m512,
    scale_hi: Option<__m512>,
    min: Option<__m512>,
}

/// Runs passes of up to [`MAX_TILE_ROWS`] rows on a [`TileUnit`], configuring it only when a
/// pass's shape differs from the last one's.
pub(super) struct Amx<'u, U: TileUnit> {
    unit: &'u mut U,
    shape: Option<(usize, bool)>,
    scratch: Box<Scratch>,
}

impl<'u, U: TileUnit> Amx<'u, U> {
    pub(super) fn new(unit: &'u mut U) -> Self {
        let scratch =
            Box::new(Scratch { weights: [[0; 8 * TILE_ROW_BYTES]; RING], sums: [[[0; 16 * TILE_N]; 4]; RING] });
        Self { unit, shape: None, scratch }
    }
}

/// Bytes of one stored sum tile in [`Scratch::sums`].
const SUM_TILE_BYTES: usize = 16 * TILE_N * 4;

/// The tiles of one block of 32 inputs: `C += A·B` for the first level, and with `second`
/// `CR += A·B` for the remainder. Blocks alternate between two sets of tiles (0/2/4/6 and
/// 1/3/5/7) so that a block's sums are stored only after the next block's products are
/// issued: a store right behind its product held up the tile work after it.
#[inline(always)]
unsafe fn whole_block_products<U: TileUnit, const C: u8, const A: u8, const B: u8, const CR: u8>(
    unit: &mut U,
    weights: *const u8,
    q: *const u8,
    r: *const u8,
    k: usize,
    second: bool,
) {
    unsafe {
        unit.load::<B>(weights, 64);
        unit.zero::<C>();
        unit.load::<A>(q, k);
        unit.dot::<C, A, B>();
        if second {
            unit.zero::<CR>();
            unit.load::<A>(r, k);
            unit.dot::<CR, A, B>();
        }
    }
}

/// Stores what [`whole_block_products`] summed in tiles `C` (and `CR`).
#[inline(always)]
unsafe fn store_sums<U: TileUnit, const C: u8, const CR: u8>(unit: &mut U, sums: *mut u8, second: bool) {
    unsafe {
        unit.store::<C>(sums, 64);
        if second {
            unit.store::<CR>(sums.add(SUM_TILE_BYTES), 64);
        }
    }
}

/// One block summed per half of 16 inputs (Q6_K): the low half's activations (tile 2) times
/// its weights (tile 4) into `LO`, the high half's (3, 5) into `HI`, for each level of
/// `levels`; stored at once when there are two levels (their sums share the tiles), else by
/// [`store_sums`] one block later.
#[inline(always)]
unsafe fn halved_block_products<U: TileUnit, const LO: u8, const HI: u8>(
    unit: &mut U,
    weights: *const u8,
    levels: &[*const u8],
    k: usize,
    sums: *mut u8,
) {
    unsafe {
        unit.load::<4>(weights, 64);
        unit.load::<5>(weights.add(4 * 64), 64);
        for (level, &a) in levels.iter().enumerate() {
            unit.zero::<LO>();
            unit.zero::<HI>();
            unit.load::<2>(a, k);
            unit.load::<3>(a.add(BLOCK / 2), k);
            unit.dot::<LO, 2, 4>();
            unit.dot::<HI, 3, 5>();
            if levels.len() > 1 {
                unit.store::<LO>(sums.add(2 * level * SUM_TILE_BYTES), 64);
                unit.store::<HI>(sums.add((2 * level + 1) * SUM_TILE_BYTES), 64);
            }
        }
    }
}

impl<U: TileUnit> TileDriver for Amx<'_, U> {
    /// Per block: decode the weights (the type's `block`), then on the tiles `C = A·B` for
    /// each level (and half), stored; the float epilogue runs [`RING`]` − 2` blocks later, in
    /// the VNNI kernels' order. Then the outliers of each group of [`super::MAX_ROWS`] rows, as the
    /// VNNI kernels add them.
    #[inline(always)]
    unsafe fn run<const ROWS: usize>(
        &mut self,
        p: &PackedMatrix,
        nt: usize,
        acts: &QuantizedRows,
        r0: usize,
        out: *mut f32,
        mut block: impl FnMut(usize, bool) -> TileBlock,
        mut column: impl FnMut(usize, usize) -> __m512,
    ) {
        const { assert!(ROWS >= 1 && ROWS <= MAX_TILE_ROWS) };
        let halves = matches!(p.weights, Packed::Q6K { .. });
        if self.shape != Some((ROWS, halves)) {
            unsafe { self.unit.configure(&TileConfig::for_pass(ROWS, halves)) };
            self.shape = Some((ROWS, halves));
        }
        let second = acts.levels == ActivationLevels::Two;
        let (k, kb_n) = (acts.k, p.k / BLOCK);
        let unit = &mut *self.unit;
        let scratch = &mut *self.scratch;
        unsafe {
            let mut acc = [_mm512_setzero_ps(); ROWS];
            let zero = _mm512_setzero_ps();
            let mut scales = [BlockScales { scale: zero, scale_hi: None, min: None }; RING];
            decode(&mut block, 0, scratch, &mut scales);
            if kb_n > 1 {
                decode(&mut block, 1, scratch, &mut scales);
            }
            // Iteration b: block b's products, block b − 1's sums stored, block b − 2's
            // epilogue, then block b + 2 decoded into the ring slot b − 2 leaves.
            for b in 0..kb_n + 2 {
                if b < kb_n {
                    let wb = scratch.weights[b % RING].as_ptr();
                    let at = r0 * k + b * BLOCK;
                    let q = acts.q.as_ptr().add(at) as *const u8;
                    // `r` is empty unless there are two levels.
                    let r = acts.r.as_ptr().wrapping_add(at) as *const u8;
                    let sums = scratch.sums[b % RING].as_mut_ptr() as *mut u8;
                    match (halves, b % 2, second) {
                        (false, 0, _) => whole_block_products::<U, 0, 2, 4, 6>(unit, wb, q, r, k, second),
                        (false, _, _) => whole_block_products::<U, 1, 3, 5, 7>(unit, wb, q, r, k, second),
                        (true, _, true) => halved_block_products::<U, 0, 1>(unit, wb, &[q, r], k, sums),
                        (true, 0, false) => halved_block_products::<U, 0, 1>(unit, wb, &[q], k, sums),
                        (true, _, false) => halved_block_products::<U, 6, 7>(unit, wb, &[q], k, sums),
                    }
                }
                if b >= 1 && b <= kb_n {
                    let pb = b - 1;
                    let sums = scratch.sums[pb % RING].as_mut_ptr() as *mut u8;
                    match (halves, pb % 2, second) {
                        (_, _, true) if halves => {} // stored with its products
                        (false, 0, _) => store_sums::<U, 0, 6>(unit, sums, second),
                        (false, _, _) => store_sums::<U, 1, 7>(unit, sums, second),
                        (true, 0, _) => store_sums::<U, 0, 1>(unit, sums, true),
                        (true, _, _) => store_sums::<U, 6, 7>(unit, sums, true),
                    }
                }
                if b >= 2 {
                    let pb = b - 2;
                    epilogue::<ROWS>(
                        &mut acc,
                        &scales[pb % RING],
                        acts,
                        r0,
                        pb,
                        kb_n,
                        &scratch.sums[pb % RING],
                        second,
                    );
                }
                if b + 2 < kb_n {
                    decode(&mut block, b + 2, scratch, &mut scales);
                }
            }
            if acts.levels == ActivationLevels::Outliers {
                add_outliers(&mut acc, acts, r0, &mut column);
            }
            store_rows(&acc, p, nt, r0, out);
        }
    }
}

/// Decodes block `b` into its ring slot: the weights as signed bytes (less the offset the
/// VNNI kernels carry on unsigned ones, 0..=128, so a wrapped 128 is −128), and its scales.
/// A function, not a closure, so that it inlines into the caller's target features.
#[inline(always)]
unsafe fn decode(
    block: &mut impl FnMut(usize, bool) -> TileBlock,
    b: usize,
    scratch: &mut Scratch,
    scales: &mut [BlockScales; RING],
) {
    unsafe {
        let w = block(b, true);
        let wb = scratch.weights[b % RING].as_mut_ptr();
        let offset = _mm512_set1_epi8(w.offset as u8 as i8);
        for (g, v) in w.wv.iter().enumerate() {
            _mm512_store_si512(wb.add(g * 64) as *mut _, _mm512_sub_epi8(*v, offset));
        }
        scales[b % RING] = BlockScales { scale: w.scale, scale_hi: w.scale_hi, min: w.min };
    }
}

/// One block's float epilogue for every row of the pass: the VNNI kernels' operations, in
/// their order, on the integer sums the tiles stored (the VNNI kernels' sums, whose
/// `−offset·Σa` the signed weights already hold).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn epilogue<const ROWS: usize>(
    acc: &mut [__m512; ROWS],
    w: &BlockScales,
    acts: &QuantizedRows,
    r0: usize,
    b: usize,
    kb_n: usize,
    sums: &[[i32; 16 * TILE_N]; 4],
    second: bool,
) {
    unsafe {
        let sum_at = |tile: usize, r: usize| {
            _mm512_cvtepi32_ps(_mm512_loadu_si512(sums[tile].as_ptr().add(r * TILE_N) as *const _))
        };
        let block_at = |r: usize| acts.blocks.get_unchecked((r0 + r) * kb_n + b);
        // One loop per kind of block, so no row tests what the block is.
        if let Some(scale_hi) = w.scale_hi {
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = block_at(r);
                *acc = _mm512_fmadd_ps(sum_at(0, r), _mm512_mul_ps(w.scale, _mm512_set1_ps(a.d)), *acc);
                *acc = _mm512_fmadd_ps(sum_at(1, r), _mm512_mul_ps(scale_hi, _mm512_set1_ps(a.d)), *acc);
                if second {
                    let (dl, dh) =
                        (_mm512_mul_ps(w.scale, _mm512_set1_ps(a.d_r)), _mm512_mul_ps(scale_hi, _mm512_set1_ps(a.d_r)));
                    *acc = _mm512_fmadd_ps(sum_at(2, r), dl, *acc);
                    *acc = _mm512_fmadd_ps(sum_at(3, r), dh, *acc);
                }
            }
        } else if second {
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = block_at(r);
                *acc = _mm512_fmadd_ps(sum_at(0, r), _mm512_mul_ps(w.scale, _mm512_set1_ps(a.d)), *acc);
                *acc = _mm512_fmadd_ps(sum_at(1, r), _mm512_mul_ps(w.scale, _mm512_set1_ps(a.d_r)), *acc);
                if let Some(min) = w.min {
                    *acc = _mm512_fmadd_ps(min, _mm512_set1_ps(a.s), *acc);
                }
            }
        } else if let Some(min) = w.min {
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = block_at(r);
                *acc = _mm512_fmadd_ps(sum_at(0, r), _mm512_mul_ps(w.scale, _mm512_set1_ps(a.d)), *acc);
                *acc = _mm512_fmadd_ps(min, _mm512_set1_ps(a.s), *acc);
            }
        } else {
            for (r, acc) in acc.iter_mut().enumerate() {
                let a = block_at(r);
                *acc = _mm512_fmadd_ps(sum_at(0, r), _mm512_mul_ps(w.scale, _mm512_set1_ps(a.d)), *acc);
            }
        }
    }
}
