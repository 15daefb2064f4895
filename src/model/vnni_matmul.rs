//! Q8_0, Q5_0, Q4_1, Q4_K and Q6_K weights × 8-bit activations (with their outliers in f32,
//! or in two levels) on AVX-512 VNNI CPUs, and with the same arithmetic on AVX2 CPUs (see
//! `mod avx2`), for any batch size.
//!
//! Why not candle's kernels: its repacked Q8_0 kernel needs input widths that are multiples
//! of 256 (SmolLM2's 576 had to be zero-padded to 768, a third more work), quantises
//! activations with a scalar loop and takes activation rows four at a time; its Q4_1 is
//! scalar on x86. Here any width that is a multiple of 32 works, activations are quantised
//! per 32 values with vector code, up to eight rows share each weight load, and the weights
//! are prefetched ahead of use. Q4_1 streams 0.63 bytes per weight and Q5_0 0.69, against
//! Q8_0's 1.06 (candle runs both 4/5-bit types with scalar code):
//! small decode batches are bound by reading the weights, so that is what they wait for.
//!
//! The k-quants run as blocks of 32 with their scales kept as stored: Q4_K is Q4_1 with the
//! block's scale `d·sc` and minimum `−dmin·m` (6-bit `sc`, `m` per 32, f16 `d`, `dmin` per
//! 256); Q6_K is 6-bit `q − 32` with an 8-bit scale per 16 inputs, so its blocks sum their two
//! halves apart. Each product of an f16 and a small integer is exact in f32, so the kernels
//! multiply exactly the file's weights, streaming about as many bytes (4.6 and 6.6 bits per
//! weight) as the file holds. candle's k-quant kernels quantise activations to one 8-bit level.
//!
//! Activations are quantised per 32 values, in up to two levels: `x ≈ d·q + d_r·r`, where `q`
//! is llama.cpp's Q8_0/Q8_1 activation block (`d = max|x|/127`, `q = round(x/d)`) and `r` the
//! same quantisation of what `q` leaves over (`x − d·q`), so each value carries about 15 bits
//! instead of 8. Per block and row: `d_w·(d·Σw·q + d_r·Σw·r)`, plus `m_w·s` for Q4_1 with
//! `s = d·Σq + d_r·Σr`; scales stay f32. One level (llama.cpp's arithmetic) is 8-bit noise on
//! every matmul input, which a 30-layer model turns into log-prob errors of several tenths
//! of a nat at some steps (docs/kernels.md); two levels bring the kernels within f32
//! rounding of exact arithmetic on the file's weights, for twice the integer dot products.
//! The default, [`ActivationLevels::Outliers`], keeps one level and takes the error's main
//! source out of it: a block's rounding error scales with its `d`, so a row's error sits in
//! its blocks of large `d`, and in real activations such a block is almost always one
//! outlier channel among small values (the largest value over twice the second in nearly
//! every such block of SmolLM2's prefill). In the blocks with `d² ≥ 2 × the row's mean d²`
//! (about a tenth) the largest value is taken out and the rest quantised on their own, much
//! finer; the kernels add `x·w` for each outlier in f32 with its input's dequantised weights,
//! once per tile for every row of the tile. Worst-step log-prob errors are 1.1–5× smaller than
//! llama.cpp's, for about a tenth more prefill time than one level.
//! Row invariance: each output is exact integer dot products per 32-value block,
//! then the same float operations in the same order, whatever the number of rows, their
//! grouping or the thread split (threads split output columns). So a verified block of
//! tokens gets bit for bit the logits single steps would.

use anyhow::{bail, Context, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

use super::kernels::ActivationLevels;
use crate::parallel::SyncPtr;

const BLOCK: usize = 32;
/// Output rows per weight tile: one 512-bit vector of i32 sums.
const TILE_N: usize = 16;
/// Activation rows that share one pass over a weight tile.
const MAX_ROWS: usize = 8;
/// Activation blocks per work item when quantising.
const QUANT_CHUNK: usize = 32;

/// Which vector code runs the kernels on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    /// AVX-512 with VNNI: `vpdpbusd` on 16 rows at once.
    Avx512Vnni,
    /// AVX2 with FMA and F16C: the same arithmetic on two halves of 8 rows.
    Avx2,
}

/// The best kernels this CPU runs, if any.
fn isa() -> Option<Isa> {
    static ISA: std::sync::OnceLock<Option<Isa>> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("f16c")
            {
                return Some(Isa::Avx512Vnni);
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                return Some(Isa::Avx2);
            }
            None
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            None
        }
    })
}

/// Whether this CPU runs the kernels (AVX-512 VNNI, or AVX2 with FMA and F16C); whether they
/// are used is `KernelSettings::vnni_kernels`.
pub fn available() -> bool {
    isa().is_some()
}

/// Whether activations are quantised with the AVX-512 code (else the portable loops).
fn avx512_quantization() -> bool {
    isa() == Some(Isa::Avx512Vnni)
}

/// Whether a `[n, k]` matrix of this type has a kernel here (CPU aside).
pub fn supports(dtype: GgmlDType, n: usize, k: usize) -> bool {
    let k_multiple = match dtype {
        GgmlDType::Q8_0 | GgmlDType::Q5_0 | GgmlDType::Q4_1 => BLOCK,
        GgmlDType::Q4K | GgmlDType::Q6K => SUPER_BLOCK,
        _ => return false,
    };
    n > 0 && k > 0 && n.is_multiple_of(TILE_N) && k.is_multiple_of(k_multiple)
}

/// Inputs per k-quant super-block (one f16 scale per row).
const SUPER_BLOCK: usize = 256;
/// Blocks of 32 per super-block.
const BLOCKS_PER_SUPER: usize = SUPER_BLOCK / BLOCK;

/// A Q8_0, Q5_0, Q4_1, Q4_K or Q6_K matrix rearranged into tiles of 16 output rows × 32 inputs.
pub struct PackedMatrix {
    n: usize,
    k: usize,
    weights: Packed,
    /// How activations are quantised (`KernelSettings::activation_levels`).
    levels: ActivationLevels,
}

/// Scales are kept in f16 as stored: fewer bytes streamed per step, and widening is exact.
enum Packed {
    /// `qs`: `[n/16][k/32][8 groups of 4 inputs][16 rows][4]`, each weight + 128 as u8,
    /// because `vpdpbusd` multiplies unsigned by signed bytes. `d`: `[n/16][k/32][16]`.
    Q8_0 { qs: Vec<u8>, d: Vec<f16> },
    /// Weight = d·q + m with q in 0..16. `qs`: `[n/16][k/32][4 groups][16 rows][4]`, the
    /// file's bytes as they are: low nibbles hold inputs 4g..4g+4, high nibbles 16+4g..
    /// `d`, `m`: `[n/16][k/32][16]`.
    Q4_1 { qs: Vec<u8>, d: Vec<f16>, m: Vec<f16> },
    /// Weight = d·(q − 16) with q in 0..32: the low four bits as Q4_1's `qs`, the fifth bit
    /// of input j at bit j of the row's `qh` word. `qh`, `d`: `[n/16][k/32][16]`.
    Q5_0 { qs: Vec<u8>, qh: Vec<u32>, d: Vec<f16> },
    /// Weight = (d·sc)·q − (dmin·m) with q in 0..16: `qs` as Q4_1's; `sc`, `m` (6-bit):
    /// `[n/16][k/32][16]`; `d` and `dmin_neg` (−dmin): `[n/16][k/256][16]`.
    Q4K { qs: Vec<u8>, sc: Vec<u8>, m: Vec<u8>, d: Vec<f16>, dmin_neg: Vec<f16> },
    /// Weight = (d·sc)·(q − 32) with q in 0..64 and one `sc` per 16 inputs: the low four bits
    /// as Q4_1's `qs`; `qh`: `[n/16][k/32][2][16 rows][4]`, whose byte (h, row, i) holds at bits
    /// 2j..2j+2 the top two bits of input 4(4h+j)+i; `sc`: `[n/16][k/32][2][16]` (inputs 0..16,
    /// then 16..32); `d`: `[n/16][k/256][16]`.
    Q6K { qs: Vec<u8>, qh: Vec<u8>, sc: Vec<i8>, d: Vec<f16> },
}

/// GGML's Q8_0 block: an f16 scale and 32 signed bytes.
const Q8_0_BYTES: usize = 2 + BLOCK;
/// GGML's Q4_1 block: f16 scale, f16 minimum, 16 bytes of nibbles (input j low, j+16 high).
const Q4_1_BYTES: usize = 4 + BLOCK / 2;
/// GGML's Q5_0 block: f16 scale, 4 bytes of fifth bits, 16 bytes of nibbles as Q4_1's.
const Q5_0_BYTES: usize = 6 + BLOCK / 2;
/// GGML's Q4_K super-block: f16 d, f16 dmin, 12 bytes of 6-bit scales and minima, 128 bytes of
/// nibbles.
const Q4K_BYTES: usize = 4 + 12 + SUPER_BLOCK / 2;
/// GGML's Q6_K super-block: 128 bytes of low nibbles, 64 of top bit pairs, 16 i8 scales, f16 d.
const Q6K_BYTES: usize = SUPER_BLOCK / 2 + SUPER_BLOCK / 4 + 16 + 2;

/// Scale and minimum of block `j` (0..8) of a Q4_K super-block, from its 12 packed bytes.
fn q4k_scale_min(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        ((packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4), (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4))
    }
}

/// The 256 quantised values (0..16) and 8 (scale, minimum) pairs of a Q4_K super-block.
fn q4k_values(block: &[u8]) -> ([u8; SUPER_BLOCK], [(u8, u8); BLOCKS_PER_SUPER]) {
    let qs = &block[16..];
    let mut values = [0u8; SUPER_BLOCK];
    for (i, v) in values.iter_mut().enumerate() {
        // 64 inputs per 32 bytes: the first 32 in the low nibbles, the next 32 in the high.
        let byte = qs[i / 64 * 32 + i % 32];
        *v = if i % 64 < 32 { byte & 0x0F } else { byte >> 4 };
    }
    (values, std::array::from_fn(|j| q4k_scale_min(j, &block[4..16])))
}

/// The 256 quantised values (0..64, to be taken − 32) and 16 scales of a Q6_K super-block.
fn q6k_values(block: &[u8]) -> ([u8; SUPER_BLOCK], [i8; 16]) {
    let (ql, qh) = (&block[..128], &block[128..192]);
    let mut values = [0u8; SUPER_BLOCK];
    for (i, v) in values.iter_mut().enumerate() {
        // Halves of 128; in each, quarter q of 32 inputs takes low nibbles (q even) or high
        // nibbles (q odd) of ql[32·(q%2)..], and bit pair q of qh[l].
        let (half, quarter, l) = (i / 128, i % 128 / 32, i % 32);
        let low = ql[half * 64 + (quarter % 2) * 32 + l];
        let low = if quarter < 2 { low & 0x0F } else { low >> 4 };
        let high = (qh[half * 32 + l] >> (2 * quarter)) & 3;
        *v = low | (high << 4);
    }
    (values, std::array::from_fn(|j| block[192 + j] as i8))
}

/// Puts a block's 32 values (each < 16) into the tile layout Q4_1 stores: byte (g, row, i)
/// holds input 4g+i in its low nibble and 16+4g+i in its high one.
fn pack_nibbles(values: &[u8], qs: &mut [u8], tile: usize, lane: usize) {
    for j in 0..BLOCK / 2 {
        qs[tile + (j / 4 * TILE_N + lane) * 4 + j % 4] = (values[j] & 0x0F) | (values[j + 16] << 4);
    }
}

impl PackedMatrix {
    /// Packs a `[n, k]` Q8_0, Q5_0 or Q4_1 tensor; `None` when [`supports`] says no or the CPU
    /// cannot run the kernels (so a `PackedMatrix` exists only where `matmul` is safe).
    pub fn from_qtensor(q: &QTensor, levels: ActivationLevels) -> Result<Option<Self>> {
        let (n, k) = q.shape().dims2()?;
        if !available() || !supports(q.dtype(), n, k) {
            return Ok(None);
        }
        let data = q.data()?;
        let kb = k / BLOCK;
        let (blocks, block_bytes) = match q.dtype() {
            GgmlDType::Q8_0 => (kb, Q8_0_BYTES),
            GgmlDType::Q5_0 => (kb, Q5_0_BYTES),
            GgmlDType::Q4K => (k / SUPER_BLOCK, Q4K_BYTES),
            GgmlDType::Q6K => (k / SUPER_BLOCK, Q6K_BYTES),
            _ => (kb, Q4_1_BYTES),
        };
        // Checked: a file's dimensions are untrusted, and a wrapped product could match a
        // wrapped byte count.
        let expected = n.checked_mul(blocks).and_then(|x| x.checked_mul(block_bytes));
        if expected != Some(data.len()) || n.checked_mul(k).is_none() {
            bail!("{:?} tensor of {n}×{k} has {} bytes", q.dtype(), data.len());
        }
        let sb_n = k / SUPER_BLOCK;
        let f16_at = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]);
        let weights = if q.dtype() == GgmlDType::Q8_0 {
            let mut qs = vec![0u8; n * k];
            let mut d = vec![f16::ZERO; n * kb];
            for row in 0..n {
                let (nt, lane) = (row / TILE_N, row % TILE_N);
                for b in 0..kb {
                    let block = &data[(row * kb + b) * Q8_0_BYTES..][..Q8_0_BYTES];
                    let tile = (nt * kb + b) * TILE_N * BLOCK;
                    d[(nt * kb + b) * TILE_N + lane] = f16_at(block, 0);
                    for (i, &w) in block[2..].iter().enumerate() {
                        qs[tile + (i / 4 * TILE_N + lane) * 4 + i % 4] = (w as i8 as i16 + 128) as u8;
                    }
                }
            }
            Packed::Q8_0 { qs, d }
        } else if q.dtype() == GgmlDType::Q5_0 {
            let mut qs = vec![0u8; n * k / 2];
            let (mut qh, mut d) = (vec![0u32; n * kb], vec![f16::ZERO; n * kb]);
            for row in 0..n {
                let (nt, lane) = (row / TILE_N, row % TILE_N);
                for b in 0..kb {
                    let block = &data[(row * kb + b) * Q5_0_BYTES..][..Q5_0_BYTES];
                    let tile = (nt * kb + b) * TILE_N * BLOCK / 2;
                    d[(nt * kb + b) * TILE_N + lane] = f16_at(block, 0);
                    qh[(nt * kb + b) * TILE_N + lane] = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
                    for (j, &byte) in block[6..].iter().enumerate() {
                        qs[tile + (j / 4 * TILE_N + lane) * 4 + j % 4] = byte;
                    }
                }
            }
            Packed::Q5_0 { qs, qh, d }
        } else if q.dtype() == GgmlDType::Q4K {
            let mut qs = vec![0u8; n * k / 2];
            let (mut sc, mut m) = (vec![0u8; n * kb], vec![0u8; n * kb]);
            let (mut d, mut dmin_neg) = (vec![f16::ZERO; n * sb_n], vec![f16::ZERO; n * sb_n]);
            for row in 0..n {
                let (nt, lane) = (row / TILE_N, row % TILE_N);
                for s in 0..sb_n {
                    let block = &data[(row * sb_n + s) * Q4K_BYTES..][..Q4K_BYTES];
                    d[(nt * sb_n + s) * TILE_N + lane] = f16_at(block, 0);
                    dmin_neg[(nt * sb_n + s) * TILE_N + lane] = -f16_at(block, 2);
                    let (values, scales) = q4k_values(block);
                    for (j, &(scale, min)) in scales.iter().enumerate() {
                        let b = s * BLOCKS_PER_SUPER + j;
                        sc[(nt * kb + b) * TILE_N + lane] = scale;
                        m[(nt * kb + b) * TILE_N + lane] = min;
                        let tile = (nt * kb + b) * TILE_N * BLOCK / 2;
                        pack_nibbles(&values[j * BLOCK..(j + 1) * BLOCK], &mut qs, tile, lane);
                    }
                }
            }
            Packed::Q4K { qs, sc, m, d, dmin_neg }
        } else if q.dtype() == GgmlDType::Q6K {
            let mut qs = vec![0u8; n * k / 2];
            let mut qh = vec![0u8; n * k / 4];
            let mut sc = vec![0i8; n * kb * 2];
            let mut d = vec![f16::ZERO; n * sb_n];
            for row in 0..n {
                let (nt, lane) = (row / TILE_N, row % TILE_N);
                for s in 0..sb_n {
                    let block = &data[(row * sb_n + s) * Q6K_BYTES..][..Q6K_BYTES];
                    d[(nt * sb_n + s) * TILE_N + lane] = f16_at(block, 208);
                    let (values, scales) = q6k_values(block);
                    for j in 0..BLOCKS_PER_SUPER {
                        let b = s * BLOCKS_PER_SUPER + j;
                        let vals = &values[j * BLOCK..(j + 1) * BLOCK];
                        let low: Vec<u8> = vals.iter().map(|v| v & 0x0F).collect();
                        pack_nibbles(&low, &mut qs, (nt * kb + b) * TILE_N * BLOCK / 2, lane);
                        for (input, v) in vals.iter().enumerate() {
                            let (g, i) = (input / 4, input % 4);
                            let at = (nt * kb + b) * TILE_N * BLOCK / 4 + ((g / 4) * TILE_N + lane) * 4 + i;
                            qh[at] |= (v >> 4) << (2 * (g % 4));
                        }
                        sc[((nt * kb + b) * 2) * TILE_N + lane] = scales[2 * j];
                        sc[((nt * kb + b) * 2 + 1) * TILE_N + lane] = scales[2 * j + 1];
                    }
                }
            }
            Packed::Q6K { qs, qh, sc, d }
        } else {
            let mut qs = vec![0u8; n * k / 2];
            let (mut d, mut m) = (vec![f16::ZERO; n * kb], vec![f16::ZERO; n * kb]);
            for row in 0..n {
                let (nt, lane) = (row / TILE_N, row % TILE_N);
                for b in 0..kb {
                    let block = &data[(row * kb + b) * Q4_1_BYTES..][..Q4_1_BYTES];
                    let tile = (nt * kb + b) * TILE_N * BLOCK / 2;
                    d[(nt * kb + b) * TILE_N + lane] = f16_at(block, 0);
                    m[(nt * kb + b) * TILE_N + lane] = f16_at(block, 2);
                    for (j, &byte) in block[4..].iter().enumerate() {
                        qs[tile + (j / 4 * TILE_N + lane) * 4 + j % 4] = byte;
                    }
                }
            }
            Packed::Q4_1 { qs, d, m }
        };
        Ok(Some(Self { n, k, weights, levels }))
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    /// `x`: `m` rows of `k` floats → `m` rows of `n` floats; an error when `x` is not whole rows.
    pub fn matmul(&self, x: &[f32]) -> Result<Vec<f32>> {
        let isa = isa().context("no vector kernels on this CPU")?;
        self.matmul_on(x, isa)
    }

    /// [`Self::matmul`] on the kernels of `isa`, which this CPU must run.
    fn matmul_on(&self, x: &[f32], isa: Isa) -> Result<Vec<f32>> {
        let m = x.len() / self.k;
        if x.len() != m * self.k {
            bail!("matmul input of {} values is not whole rows of {}", x.len(), self.k);
        }
        let acts = QuantizedRows::new(x, self.k, self.levels);
        // Not zeroed first: every element is written by exactly one tile below (a zeroed
        // 8 × 49152 logits buffer was a page-faulting memset on every step).
        let mut out: Vec<f32> = Vec::with_capacity(m * self.n);
        let out_ptr = SyncPtr(out.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(self.n / TILE_N, |tiles| {
            // Captures the whole `SyncPtr` (a closure would otherwise capture its raw field).
            #[allow(clippy::redundant_locals)]
            let out_ptr = out_ptr;
            for nt in tiles {
                for r0 in (0..m).step_by(MAX_ROWS) {
                    // SAFETY: `isa` runs on this CPU (`isa()`, or a test's `runnable_isas()`),
                    // and each tile writes only its own 16 columns of rows that exist.
                    unsafe { self.tile(isa, nt, &acts, r0, (m - r0).min(MAX_ROWS), out_ptr.get()) };
                }
            }
        });
        // SAFETY: the tiles cover all n/16 column groups of all m rows.
        unsafe { out.set_len(m * self.n) };
        Ok(out)
    }

    unsafe fn tile(&self, isa: Isa, nt: usize, acts: &QuantizedRows, r0: usize, rows: usize, out: *mut f32) {
        #[cfg(target_arch = "x86_64")]
        {
            macro_rules! by_rows {
                ($m:ident, $f:ident) => {
                    match rows {
                        1 => $m::$f::<1>(self, nt, acts, r0, out),
                        2 => $m::$f::<2>(self, nt, acts, r0, out),
                        3 => $m::$f::<3>(self, nt, acts, r0, out),
                        4 => $m::$f::<4>(self, nt, acts, r0, out),
                        5 => $m::$f::<5>(self, nt, acts, r0, out),
                        6 => $m::$f::<6>(self, nt, acts, r0, out),
                        7 => $m::$f::<7>(self, nt, acts, r0, out),
                        _ => $m::$f::<8>(self, nt, acts, r0, out),
                    }
                };
            }
            macro_rules! by_type {
                ($m:ident) => {
                    match self.weights {
                        Packed::Q8_0 { .. } => by_rows!($m, q8_0_rows),
                        Packed::Q4_1 { .. } => by_rows!($m, q4_1_rows),
                        Packed::Q5_0 { .. } => by_rows!($m, q5_0_rows),
                        Packed::Q4K { .. } => by_rows!($m, q4k_rows),
                        Packed::Q6K { .. } => by_rows!($m, q6k_rows),
                    }
                };
            }
            match isa {
                Isa::Avx512Vnni => by_type!(avx512),
                Isa::Avx2 => by_type!(avx2),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (isa, nt, acts, r0, rows, out);
            unreachable!("PackedMatrix is only built where `available()`");
        }
    }
}

/// One activation block's scales and sums: `x ≈ d·q + d_r·r` (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct ActBlock {
    d: f32,
    d_r: f32,
    /// Σq and Σr, exact.
    sum: i32,
    sum_r: i32,
    /// Σq and Σr over the block's first 16 values (Q6_K scales each half apart).
    sum_lo: i32,
    sum_r_lo: i32,
    /// `d·Σq + d_r·Σr`: the block's sum as quantised (Q4_1's minimum term).
    s: f32,
    /// [`ActivationLevels::Outliers`]: bit `i` set when input `i` was taken out as an outlier.
    taken: u32,
}

/// Activations quantised per 32 values: one level, one level with outliers taken out, or two
/// levels (see the module docs).
struct QuantizedRows {
    /// `[m][k]` first level.
    q: Vec<i8>,
    /// `[m][k]` second level (the first's remainder).
    r: Vec<i8>,
    /// `[m][k/32]`.
    blocks: Vec<ActBlock>,
    k: usize,
    levels: ActivationLevels,
    /// [`ActivationLevels::Outliers`]: row `i`'s outliers, in increasing order of input, are
    /// `outliers[i·c..][..outlier_count[i]]`, `c = MAX_OUTLIERS_PER_BLOCK · k/32`.
    outliers: Vec<Outlier>,
    outlier_count: Vec<u32>,
    /// The same outliers per group of `MAX_ROWS` rows (the rows one kernel call takes):
    /// group `g`'s inputs with an outlier in any of its rows, as `(block, input)` in
    /// increasing order, are `group_inputs[group_at[g]..group_at[g + 1]]`, and `group_x`
    /// holds each one's value per row, 0 for rows without it. A kernel dequantises each input
    /// once per tile for all its rows; adding `0·w` leaves a row's sum as it was, so each row
    /// still gets exactly its own outliers' terms, in its own order.
    group_at: Vec<u32>,
    group_inputs: Vec<(u32, u32)>,
    group_x: Vec<[f32; MAX_ROWS]>,
}

/// An activation taken out of its block before quantisation and multiplied in f32 by the
/// dequantised weights of its input.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Outlier {
    block: u32,
    /// The input within the block, 0..32.
    at: u32,
    x: f32,
}

impl QuantizedRows {
    fn new(x: &[f32], k: usize, levels: ActivationLevels) -> Self {
        if levels != ActivationLevels::Outliers {
            return Self::quantize(x, k, levels == ActivationLevels::Two);
        }
        let (m, kb) = (x.len() / k, k / BLOCK);
        let (mut q, r) = (vec![0i8; x.len()], Vec::new());
        let mut blocks = vec![ActBlock::default(); m * kb];
        let cap = kb * MAX_OUTLIERS_PER_BLOCK;
        let (mut outliers, mut outlier_count) = (vec![Outlier::default(); m * cap], vec![0u32; m]);
        let ptrs = (
            SyncPtr(q.as_mut_ptr()),
            SyncPtr(blocks.as_mut_ptr()),
            SyncPtr(outliers.as_mut_ptr()),
            SyncPtr(outlier_count.as_mut_ptr()),
        );
        let quantize_row = |row: usize| {
            let (q_ptr, b_ptr, o_ptr, n_ptr) = ptrs;
            // SAFETY: each row's ranges of the four buffers are its own.
            unsafe {
                *n_ptr.get().add(row) = quantize_row_outliers(
                    &x[row * k..(row + 1) * k],
                    std::slice::from_raw_parts_mut(q_ptr.get().add(row * k), k),
                    std::slice::from_raw_parts_mut(b_ptr.get().add(row * kb), kb),
                    std::slice::from_raw_parts_mut(o_ptr.get().add(row * cap), cap),
                    quantize_range,
                    largest_untaken,
                ) as u32;
            }
        };
        if m * kb <= SERIAL_QUANT_BLOCKS {
            (0..m).for_each(quantize_row);
        } else {
            // Prefill-sized inputs on all cores.
            let rows_per_chunk = QUANT_CHUNK.div_ceil(kb);
            candle_core::utils::barrier_pool().execute_chunked(m.div_ceil(rows_per_chunk), |chunks| {
                for c in chunks {
                    (c * rows_per_chunk..m.min((c + 1) * rows_per_chunk)).for_each(quantize_row);
                }
            });
        }
        let mut rows = Self {
            q,
            r,
            blocks,
            k,
            levels,
            outliers,
            outlier_count,
            group_at: vec![0],
            group_inputs: Vec::new(),
            group_x: Vec::new(),
        };
        let mut group: Vec<((u32, u32), usize, f32)> = Vec::new();
        for g in 0..m.div_ceil(MAX_ROWS) {
            group.clear();
            for (r, row) in (g * MAX_ROWS..m.min((g + 1) * MAX_ROWS)).enumerate() {
                let listed = &rows.outliers[row * cap..row * cap + rows.outlier_count[row] as usize];
                group.extend(listed.iter().map(|o| ((o.block, o.at), r, o.x)));
            }
            group.sort_unstable_by_key(|&(input, r, _)| (input, r));
            let start = rows.group_inputs.len();
            for &(input, r, x) in &group {
                if rows.group_inputs.len() == start || rows.group_inputs.last() != Some(&input) {
                    rows.group_inputs.push(input);
                    rows.group_x.push([0.0; MAX_ROWS]);
                }
                rows.group_x.last_mut().expect("pushed above")[r] = x;
            }
            rows.group_at.push(rows.group_inputs.len() as u32);
        }
        rows
    }

    /// Row `row`'s outliers ([`ActivationLevels::Outliers`] only).
    #[cfg(test)]
    fn outliers(&self, row: usize) -> &[Outlier] {
        let cap = self.k / BLOCK * MAX_OUTLIERS_PER_BLOCK;
        &self.outliers[row * cap..row * cap + self.outlier_count[row] as usize]
    }

    fn quantize(x: &[f32], k: usize, two_level: bool) -> Self {
        let n_blocks = x.len() / BLOCK;
        let (mut q, mut r) = (vec![0i8; x.len()], vec![0i8; x.len()]);
        let mut blocks = vec![ActBlock::default(); n_blocks];
        let levels = if two_level { ActivationLevels::Two } else { ActivationLevels::One };
        let rows = |q, r, blocks| Self {
            q,
            r,
            blocks,
            k,
            levels,
            outliers: Vec::new(),
            outlier_count: Vec::new(),
            group_at: Vec::new(),
            group_inputs: Vec::new(),
            group_x: Vec::new(),
        };
        if n_blocks <= SERIAL_QUANT_BLOCKS {
            quantize_range(x, &mut q, &mut r, &mut blocks, two_level);
            return rows(q, r, blocks);
        }
        // Prefill-sized inputs on all cores.
        let ptrs = (SyncPtr(q.as_mut_ptr()), SyncPtr(r.as_mut_ptr()), SyncPtr(blocks.as_mut_ptr()));
        candle_core::utils::barrier_pool().execute_chunked(n_blocks.div_ceil(QUANT_CHUNK), |chunks| {
            let (q_ptr, r_ptr, b_ptr) = ptrs;
            for c in chunks {
                let range = c * QUANT_CHUNK..n_blocks.min((c + 1) * QUANT_CHUNK);
                let n = range.len();
                // SAFETY: chunks are disjoint block ranges inside the three buffers.
                unsafe {
                    quantize_range(
                        &x[range.start * BLOCK..range.end * BLOCK],
                        std::slice::from_raw_parts_mut(q_ptr.get().add(range.start * BLOCK), n * BLOCK),
                        std::slice::from_raw_parts_mut(r_ptr.get().add(range.start * BLOCK), n * BLOCK),
                        std::slice::from_raw_parts_mut(b_ptr.get().add(range.start), n),
                        two_level,
                    )
                };
            }
        });
        rows(q, r, blocks)
    }
}

/// [`ActivationLevels::Outliers`]: a block gives up its largest value when its scale `d`
/// satisfies `d² ≥ OUTLIER_RATIO × mean d²` over its row, then up to
/// `MAX_OUTLIERS_PER_BLOCK − 1` more, one per round, while `d² ≥ LATER_OUTLIER_RATIO × mean
/// d²` with the mean taken again over the row's new scales. One round left a Qwen2.5-0.5B
/// log-prob 2.0 nats off where llama.cpp is 1.2 off; three bring it to 0.4, for 12%
/// (Qwen2.5-0.5B) to 29% (SmolLM2) more outliers.
const OUTLIER_RATIO: f32 = 2.0;
const LATER_OUTLIER_RATIO: f32 = 4.0;
const MAX_OUTLIERS_PER_BLOCK: usize = 3;

/// Quantises whole blocks in one or two levels: [`quantize_range`] or its portable twin.
type QuantizeBlocks = fn(&[f32], &mut [i8], &mut [i8], &mut [ActBlock], bool);

/// [`largest_untaken`] or its portable twin.
type LargestUntaken = fn(&[f32], u32) -> (usize, f32);

/// Among one block's values whose bit in `taken` is clear: the first input of the largest
/// |x| (as `max|x|` picks the scale) and the largest |x| of the others. `BLOCK` when none is
/// clear (or all are NaN).
fn largest_untaken(xs: &[f32], taken: u32) -> (usize, f32) {
    #[cfg(target_arch = "x86_64")]
    if avx512_quantization() {
        // SAFETY: the features were detected, and `xs` holds a whole block.
        return unsafe { avx512::largest_untaken(&xs[..BLOCK], taken) };
    }
    largest_untaken_portable(xs, taken)
}

fn largest_untaken_portable(xs: &[f32], taken: u32) -> (usize, f32) {
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

/// Quantises one row in one level, except that the blocks whose rounding error is large next
/// to the row's (see [`OUTLIER_RATIO`]) first give up their largest values to `outliers`,
/// which end in increasing order of input. Returns the number of outliers. Depends on the row
/// alone, so rows stay invariant to the batch they run in.
fn quantize_row_outliers(
    x: &[f32],
    q: &mut [i8],
    blocks: &mut [ActBlock],
    outliers: &mut [Outlier],
    quantize: QuantizeBlocks,
    largest: LargestUntaken,
) -> usize {
    quantize(x, q, &mut [], blocks, false);
    let mut count = 0;
    // The rounds move only the scales (`d` of what a block keeps is its next largest value
    // / 127, what quantising it would give); each block that gave values up is quantised
    // again once, after the last round.
    for round in 0..MAX_OUTLIERS_PER_BLOCK {
        let ratio = if round == 0 { OUTLIER_RATIO } else { LATER_OUTLIER_RATIO };
        let mean_d2 = blocks.iter().map(|b| b.d * b.d).sum::<f32>() / blocks.len() as f32;
        for (b, block) in blocks.iter_mut().enumerate() {
            if block.d * block.d < ratio * mean_d2 || block.d == 0.0 {
                continue;
            }
            let (top, next) = largest(&x[b * BLOCK..(b + 1) * BLOCK], block.taken);
            if top >= BLOCK {
                continue;
            }
            outliers[count] = Outlier { block: b as u32, at: top as u32, x: x[b * BLOCK + top] };
            count += 1;
            block.taken |= 1 << top;
            block.d = next / 127.0;
        }
    }
    for (b, block) in blocks.iter_mut().enumerate().filter(|(_, block)| block.taken != 0) {
        let at = b * BLOCK..(b + 1) * BLOCK;
        let mut rest = [0f32; BLOCK];
        rest.copy_from_slice(&x[at.clone()]);
        let taken = block.taken;
        (0..BLOCK).filter(|i| taken & (1 << i) != 0).for_each(|i| rest[i] = 0.0);
        quantize(&rest, &mut q[at], &mut [], std::slice::from_mut(block), false);
        block.taken = taken;
    }
    outliers[..count].sort_unstable_by_key(|o| (o.block, o.at));
    count
}

/// Activation blocks quantised on the calling thread alone: a decode step's few rows take
/// about a microsecond, less than handing them to the pool.
const SERIAL_QUANT_BLOCKS: usize = 1024;

/// Quantises whole blocks of `x` into the two levels `q`, `r` and their `blocks` (see
/// [`QuantizedRows`]).
fn quantize_range(x: &[f32], q: &mut [i8], r: &mut [i8], blocks: &mut [ActBlock], two_level: bool) {
    #[cfg(target_arch = "x86_64")]
    if avx512_quantization() {
        // SAFETY: the features were detected.
        return unsafe { avx512::quantize_range(x, q, r, blocks, two_level) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa() == Some(Isa::Avx2) {
        // SAFETY: the features were detected.
        return unsafe { quantize_range_avx2(x, q, r, blocks, two_level) };
    }
    quantize_range_portable(x, q, r, blocks, two_level)
}

/// The portable loops compiled for AVX2: rounding and fused multiply-adds become
/// instructions instead of library calls; the results are the same.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_range_avx2(x: &[f32], q: &mut [i8], r: &mut [i8], blocks: &mut [ActBlock], two_level: bool) {
    quantize_range_portable(x, q, r, blocks, two_level)
}

#[inline(always)]
fn quantize_range_portable(x: &[f32], q: &mut [i8], r: &mut [i8], blocks: &mut [ActBlock], two_level: bool) {
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
fn quantize_block_portable(xs: &[f32], qs: &mut [i8]) -> (f32, i32) {
    let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
    let (d, id) = block_scale(amax);
    let mut sum = 0;
    for (q, x) in qs.iter_mut().zip(xs) {
        *q = (x * id).round_ties_even().max(-127.0) as i8;
        sum += *q as i32;
    }
    (d, sum)
}

/// `d = max|x| / 127` and `1/d` for a block whose largest magnitude is `amax`; both 0 when
/// `amax` is 0 or so small (subnormal) that `1/d` would overflow, so every code path
/// quantises such a block to zeros.
#[inline(always)]
fn block_scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    if id.is_finite() {
        (d, id)
    } else {
        (0.0, 0.0)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{
        ActBlock, ActivationLevels, Packed, PackedMatrix, QuantizedRows, BLOCK, BLOCKS_PER_SUPER, MAX_ROWS,
        SUPER_BLOCK, TILE_N,
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
        unsafe {
            prefetch(current.wrapping_add(PREFETCH_BLOCKS * TILE_N) as *const u8, std::mem::size_of::<T>() * TILE_N)
        }
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
    struct TileBlock {
        /// 8 groups of 4 inputs × 16 rows, as unsigned bytes.
        wv: [__m512i; 8],
        /// The 16 rows' scales (of inputs 0..16 only, when `scale_hi` is set).
        scale: __m512,
        /// Q6_K: the scales of inputs 16..32; the two halves are summed and scaled apart.
        scale_hi: Option<__m512>,
        /// What the bytes carry on top of the signed weight (Q8_0: +128, Q5_0: +16): the
        /// integer sum starts at −offset·Σa, exact, so it cancels.
        offset: i32,
        /// Q4_1's minima, added as `m·s_a`.
        min: Option<__m512>,
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
                    let g = r0 / MAX_ROWS;
                    let inputs = acts.group_at[g] as usize..acts.group_at[g + 1] as usize;
                    for (&(b, i), xs) in acts.group_inputs[inputs.clone()].iter().zip(&acts.group_x[inputs]) {
                        let w = column(b as usize, i as usize);
                        for (acc, &x) in acc.iter_mut().zip(xs) {
                            *acc = _mm512_fmadd_ps(w, _mm512_set1_ps(x), *acc);
                        }
                    }
                    acc
                }
            };
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
                    let (q, rest) =
                        (acts.q.as_ptr().add(at) as *const i32, acts.r.as_ptr().wrapping_add(at) as *const i32);
                    let a = acts.blocks.get_unchecked(row * kb_n + b);
                    if let Some(scale_hi) = w.scale_hi {
                        // Per half: acc += cvt(Σ w·q − offset·Σq) · (d_w·d), low half first.
                        let init = |sum: i32| _mm512_set1_epi32(-w.offset * sum);
                        let (lo, hi) = dot_halves(init(a.sum_lo), init(a.sum - a.sum_lo), &w.wv, q);
                        *acc =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(w.scale, _mm512_set1_ps(a.d)), *acc);
                        *acc =
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(scale_hi, _mm512_set1_ps(a.d)), *acc);
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
        tile_rows::<ROWS>(
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
        tile_rows::<ROWS>(
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
        tile_rows::<ROWS>(
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
        tile_rows::<ROWS>(
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
                let bits =
                    _mm512_and_si512(_mm512_srlv_epi16(high[g / 4], _mm512_set1_epi16(2 * (g % 4) as i16)), pair);
                _mm512_or_si512(low[g], _mm512_slli_epi16::<4>(bits))
            })
        }
    }

    /// Q6_K: Σ d·sc·(q − 32)·(d_a·a) per half block of 16 inputs, each half with its scale.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
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
        tile_rows::<ROWS>(
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
                let high = _mm512_and_si512(
                    _mm512_srlv_epi32(high, _mm512_set1_epi32(2 * (g % 4) as i32)),
                    _mm512_set1_epi32(3),
                );
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
    pub(super) unsafe fn quantize_range(
        x: &[f32],
        q: &mut [i8],
        r: &mut [i8],
        blocks: &mut [ActBlock],
        two_level: bool,
    ) {
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

/// The AVX-512 kernels' arithmetic on AVX2 CPUs (AMD Zen 2/3, Intel client cores without
/// AVX-512): each 512-bit vector of a tile's 16 rows is two 256-bit halves, rows 0..8 and
/// 8..16, and `vpdpbusd` is `vpmaddubsw` (unsigned × signed bytes, pairs summed into i16)
/// then `vpmaddwd` by ones (pairs into i32). The i16 pair sums are exact while a weight byte
/// stays below 128: the 4- to 6-bit types do (at most 2·63·127), but Q8_0's bytes carry +128,
/// so its weights go signed, as their absolute value times the activation with the weight's
/// sign (llama.cpp's trick), at most 2·128·127. The small types' i16 sums of several groups
/// of 4 inputs are added before one `vpmaddwd` widens them (`avx2::dot_groups`), which
/// halves the multiply instructions for 4-bit weights: on AVX2 those multiplies are what a
/// batch of rows waits for. Integer sums are exact either way, and the float operations are the
/// AVX-512 kernels' in the same order, so both give the portable loops' results bit for bit.
/// Activations are quantised by the portable code.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{
        ActBlock, ActivationLevels, Packed, PackedMatrix, QuantizedRows, BLOCK, BLOCKS_PER_SUPER, MAX_ROWS,
        SUPER_BLOCK, TILE_N,
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
        unsafe {
            prefetch(current.wrapping_add(PREFETCH_BLOCKS * TILE_N) as *const u8, std::mem::size_of::<T>() * TILE_N)
        }
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
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_groups<const PER: usize>(
        init: TileI32,
        w: &TileBlock,
        a: *const i32,
        from: usize,
        to: usize,
    ) -> TileI32 {
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

    /// Σ over the 8 groups of 4 inputs, from `init`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
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
                    let (q, rest) =
                        (acts.q.as_ptr().add(at) as *const i32, acts.r.as_ptr().wrapping_add(at) as *const i32);
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
}

/// The kernels' arithmetic written as plain loops, for tests: the same integer sums and the
/// same float operations in the same order.
#[cfg(test)]
fn matmul_portable(p: &PackedMatrix, x: &[f32]) -> Vec<f32> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    const ALL_TYPES: [GgmlDType; 5] =
        [GgmlDType::Q8_0, GgmlDType::Q5_0, GgmlDType::Q4_1, GgmlDType::Q4K, GgmlDType::Q6K];

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    const ALL_LEVELS: [ActivationLevels; 3] =
        [ActivationLevels::One, ActivationLevels::Outliers, ActivationLevels::Two];

    fn packed(dtype: GgmlDType, n: usize, k: usize) -> (PackedMatrix, Vec<f32>) {
        packed_levels(dtype, n, k, ActivationLevels::Two)
    }

    fn packed_levels(dtype: GgmlDType, n: usize, k: usize, levels: ActivationLevels) -> (PackedMatrix, Vec<f32>) {
        let w = Tensor::from_vec(random(n * k, 7), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, dtype).unwrap();
        let dense = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (PackedMatrix::from_qtensor(&q, levels).unwrap().unwrap(), dense)
    }

    #[test]
    fn kernels_equal_the_portable_loops_bitwise_and_every_row_count_agrees() {
        if !available() {
            eprintln!("skipped: no vector kernels on this CPU");
            return;
        }
        for (dtype, levels) in ALL_TYPES.into_iter().flat_map(|d| ALL_LEVELS.map(|l| (d, l))) {
            let (n, k) = (48, if matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K) { 768 } else { 576 });
            let (p, _) = packed_levels(dtype, n, k, levels);
            let x = with_outliers(random(19 * k, 11));
            let expected = matmul_portable(&p, &x);
            for isa in runnable_isas() {
                let all = p.matmul_on(&x, isa).unwrap();
                assert_eq!(all, expected, "{dtype:?} {isa:?}");
                for (r, row) in all.chunks_exact(n).enumerate() {
                    let alone = p.matmul_on(&x[r * k..(r + 1) * k], isa).unwrap();
                    assert_eq!(row, alone.as_slice(), "{dtype:?} {isa:?} row {r} alone");
                }
                let first = p.matmul_on(&x[..5 * k], isa).unwrap();
                assert_eq!(&all[..5 * n], first.as_slice(), "{dtype:?} {isa:?} first 5 rows");
            }
        }
    }

    /// The largest integer sums the kernels can meet: every block's weights at the top of their
    /// range (one value at the bottom sets the scale) against activations that all quantise to
    /// +127 or −127. The AVX2 kernels add several groups' products in 16 bits before widening;
    /// any overflow there would part them from the portable loops' 32-bit sums. Blocks of
    /// subnormal values, whose reciprocal scale overflows (they used to quantise to −128 and
    /// flip Q8_0's signed products on AVX2), count as zeros on every path.
    #[test]
    fn kernels_stay_exact_at_the_largest_integer_sums() {
        if !available() {
            eprintln!("skipped: no vector kernels on this CPU");
            return;
        }
        for dtype in ALL_TYPES {
            let (n, k) = (32, if matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K) { 512 } else { 256 });
            let w: Vec<f32> = (0..n * k).map(|i| if i % BLOCK == 0 { -1.0 } else { 0.999 }).collect();
            let q = QTensor::quantize(&Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap(), dtype).unwrap();
            for levels in ALL_LEVELS {
                let p = PackedMatrix::from_qtensor(&q, levels).unwrap().unwrap();
                let x: Vec<f32> = [1.0f32, -1.0, -1e-40, 1e-40].iter().flat_map(|&v| vec![v; k]).collect();
                let expected = matmul_portable(&p, &x);
                assert!(expected[..2 * n].iter().all(|v| v.abs() > 100.0), "{dtype:?} {levels:?}: {expected:?}");
                assert!(expected[2 * n..].iter().all(|&v| v == 0.0), "{dtype:?} {levels:?}: {expected:?}");
                for isa in runnable_isas() {
                    assert_eq!(p.matmul_on(&x, isa).unwrap(), expected, "{dtype:?} {levels:?} {isa:?}");
                }
            }
        }
    }

    /// Every kernel family this CPU runs: on an AVX-512 machine the AVX2 kernels are checked too.
    fn runnable_isas() -> Vec<Isa> {
        let mut isas = Vec::new();
        if isa() == Some(Isa::Avx512Vnni) {
            isas.push(Isa::Avx512Vnni);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            isas.push(Isa::Avx2);
        }
        isas
    }

    #[test]
    fn q8_0_extreme_weights_and_activations_stay_exact_on_every_kernel() {
        // Q8_0 weights and activations at +-127: AVX2 multiplies them through
        // 16-bit pair sums, which must not saturate.
        if !available() {
            eprintln!("skipped: no vector kernels on this CPU");
            return;
        }
        let (n, k) = (32, 256);
        let w: Vec<f32> = (0..n * k)
            .map(|i| {
                if i % 3 == 0 {
                    -1.0
                } else if i % 3 == 1 {
                    1.0
                } else {
                    -0.5
                }
            })
            .collect();
        let q = QTensor::quantize(&Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap(), GgmlDType::Q8_0).unwrap();
        for levels in ALL_LEVELS {
            let p = PackedMatrix::from_qtensor(&q, levels).unwrap().unwrap();
            let x: Vec<f32> = (0..3 * k).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect();
            let expected = matmul_portable(&p, &x);
            for isa in runnable_isas() {
                assert_eq!(p.matmul_on(&x, isa).unwrap(), expected, "{isa:?} {levels:?}");
            }
        }
    }

    #[test]
    fn prefill_sized_inputs_quantised_on_all_cores_agree_with_the_portable_loops() {
        if !available() {
            eprintln!("skipped: no vector kernels on this CPU");
            return;
        }
        let (n, k) = (32, 768);
        let rows = SERIAL_QUANT_BLOCKS * BLOCK / k + 3;
        for (dtype, levels) in ALL_TYPES.into_iter().flat_map(|d| ALL_LEVELS.map(|l| (d, l))) {
            let (p, _) = packed_levels(dtype, n, k, levels);
            let x = with_outliers(random(rows * k, 13));
            let expected = matmul_portable(&p, &x);
            for isa in runnable_isas() {
                assert_eq!(p.matmul_on(&x, isa).unwrap(), expected, "{dtype:?} {levels:?} {isa:?}");
            }
        }
    }

    #[test]
    fn vector_and_portable_quantisation_agree_bitwise_down_to_subnormals() {
        // Small activations put the remainders' scales far down f32's range; both paths must
        // round them alike. (Below ~1e-36 the first scale itself is subnormal and its inverse
        // overflows, in llama.cpp's arithmetic too; activations never come near that.)
        for magnitude in [1.0f32, 1e-3, 1e-5, 1e-7, 1e-9, 1e-30, 0.0] {
            let x: Vec<f32> = random(8 * BLOCK, 3).iter().map(|v| v * magnitude).collect();
            let n = x.len() / BLOCK;
            let mut fast = (vec![0i8; x.len()], vec![0i8; x.len()], vec![ActBlock::default(); n]);
            let mut slow = fast.clone();
            quantize_range(&x, &mut fast.0, &mut fast.1, &mut fast.2, true);
            quantize_range_portable(&x, &mut slow.0, &mut slow.1, &mut slow.2, true);
            assert_eq!((&fast.0, &fast.1), (&slow.0, &slow.1), "{magnitude}");
            let bits = |b: &[ActBlock]| {
                b.iter()
                    .map(|a| (a.d.to_bits(), a.d_r.to_bits(), a.sum, a.sum_r, a.sum_lo, a.sum_r_lo, a.s.to_bits()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&fast.2), bits(&slow.2), "{magnitude}");
        }
    }

    #[test]
    fn vector_and_portable_outlier_scans_agree() {
        for seed in 0..200u64 {
            let mut xs = random(BLOCK, seed);
            // Ties and zeros as well as distinct values.
            if seed % 3 == 0 {
                xs[(seed as usize * 7) % BLOCK] = xs[(seed as usize * 5) % BLOCK];
            }
            if seed % 5 == 0 {
                xs.iter_mut().step_by(2).for_each(|v| *v = 0.0);
            }
            let taken = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
                & if seed % 2 == 0 { 0x0101_0101 } else { u32::MAX };
            assert_eq!(largest_untaken(&xs, taken), largest_untaken_portable(&xs, taken), "seed {seed}");
        }
        assert_eq!(largest_untaken(&[1.0; BLOCK], u32::MAX), (BLOCK, 0.0));
    }

    #[test]
    fn results_are_close_to_the_dense_product() {
        if !available() {
            eprintln!("skipped: no vector kernels on this CPU");
            return;
        }
        for dtype in ALL_TYPES {
            let (n, k) = (32, if matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K) { 512 } else { 96 });
            let (p, dense) = packed(dtype, n, k);
            let x = random(3 * k, 5);
            let got = p.matmul(&x).unwrap();
            for r in 0..3 {
                for c in 0..n {
                    let exact: f32 = (0..k).map(|i| x[r * k + i] * dense[c * k + i]).sum();
                    let norm: f32 = (0..k).map(|i| (x[r * k + i] * dense[c * k + i]).abs()).sum();
                    // Two levels leave each activation within max|x|/(2·127·254) or so:
                    // ~1e-5 of the terms' sum, against ~2e-3 for one level.
                    let err = (got[r * n + c] - exact).abs();
                    assert!(err <= 1e-4 * norm, "{dtype:?} {r},{c}: {} vs {exact}", got[r * n + c]);
                }
            }
        }
    }

    /// One value in every 7th block of 32 set to ±40 (the others within ±2), as activations' outlier channels
    /// are: the outliers setting then takes it out of its block, and leaves the others alone.
    fn with_outliers(mut x: Vec<f32>) -> Vec<f32> {
        for (b, block) in x.chunks_exact_mut(BLOCK).enumerate() {
            if b % 7 == 3 {
                block[b % BLOCK] = if b % 2 == 0 { 40.0 } else { -40.0 };
            }
        }
        x
    }

    #[test]
    fn outliers_leave_their_blocks_and_land_between_one_and_two_levels() {
        if !available() {
            eprintln!("skipped: no vector kernels on this CPU");
            return;
        }
        let (n, k) = (32, 1024);
        let x = with_outliers(random(4 * k, 17));
        let rows = QuantizedRows::new(&x, k, ActivationLevels::Outliers);
        let taken: Vec<usize> =
            (0..4).flat_map(|r| rows.outliers(r).iter().map(move |o| r * 32 + o.block as usize)).collect();
        assert_eq!(taken, (0..4 * 32).filter(|b| b % 7 == 3).collect::<Vec<_>>());
        for o in (0..4).flat_map(|r| rows.outliers(r)) {
            assert_eq!(o.at as usize, (o.block as usize) % BLOCK);
        }
        for dtype in ALL_TYPES {
            let err = |levels| {
                let (p, dense) = packed_levels(dtype, n, k, levels);
                let got = p.matmul(&x).unwrap();
                let mut sq = 0f64;
                for r in 0..4 {
                    for c in 0..n {
                        let exact: f64 = (0..k).map(|i| x[r * k + i] as f64 * dense[c * k + i] as f64).sum();
                        sq += (got[r * n + c] as f64 - exact).powi(2);
                    }
                }
                sq.sqrt()
            };
            let (one, outliers, two) =
                (err(ActivationLevels::One), err(ActivationLevels::Outliers), err(ActivationLevels::Two));
            // The outliers' blocks carry 400× the others' squared error, so taking the
            // outliers out removes most of it.
            assert!(outliers < 0.3 * one && two < outliers, "{dtype:?}: one {one} outliers {outliers} two {two}");
        }
    }

    #[test]
    fn other_types_and_shapes_are_refused() {
        assert!(!supports(GgmlDType::Q8_0, 24, 64));
        assert!(!supports(GgmlDType::Q4_1, 32, 48));
        assert!(supports(GgmlDType::Q4K, 32, 256) && !supports(GgmlDType::Q4K, 32, 224));
        assert!(supports(GgmlDType::Q6K, 32, 512) && !supports(GgmlDType::Q5K, 32, 256));
        assert!(supports(GgmlDType::Q8_0, 32, 64) && supports(GgmlDType::Q4_1, 32, 64));
        assert!(supports(GgmlDType::Q5_0, 32, 64) && !supports(GgmlDType::Q5_1, 32, 64));
    }
}
