//! Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights × 8-bit activations (with their outliers in f32,
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
//! halves apart. Q4_0 is Q4_1's nibbles taken − 8 with no minimum; Q5_1 and Q5_K are Q5_0's
//! five-bit values with Q4_1's and Q4_K's scales and minima. Each product of an f16 and a
//! small integer is exact in f32, so the kernels
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

use crate::parallel::SyncPtr;
use portable::{largest_untaken_portable, quantize_range_portable};

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;
#[cfg(test)]
mod tests;

const BLOCK: usize = 32;
/// Output rows per weight tile: one 512-bit vector of i32 sums.
const TILE_N: usize = 16;
/// Activation rows that share one pass over a weight tile.
const MAX_ROWS: usize = 8;
/// AMX tiles take matmuls of more than [`MAX_ROWS`] rows whose input is at least this wide
/// (`examples/matmul_rows.rs`, on a Xeon with AMX): up to 8 rows the VNNI kernels, already
/// near the weight stream's pace, are as fast or faster, and on narrower inputs a pass has too
/// few blocks to fill the tiles' pipeline. The results are the same either way.
const AMX_MIN_K: usize = 1024;
/// Activation blocks per work item when quantising.
const QUANT_CHUNK: usize = 32;

/// How our kernels quantise each block of 32 activations: one 8-bit level (llama.cpp's
/// arithmetic); one level with each row's outliers (the largest value of the blocks whose
/// scale is large) taken out and multiplied in f32 (the default: worst-step log-prob errors
/// 1.1–5× smaller than llama.cpp's, about a tenth more prefill time than one level); or a second
/// 8-bit level for what the first leaves over (within f32 rounding of the dense product, twice
/// the integer dot products). See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationLevels {
    One,
    Outliers,
    Two,
}

impl ActivationLevels {
    pub(super) fn parse(name: &str, value: &str) -> Option<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "one" | "1" => Some(Self::One),
            "outliers" => Some(Self::Outliers),
            "two" | "2" => Some(Self::Two),
            "" => None,
            other => {
                eprintln!("warning: {name}={other:?} is not one, outliers or two; ignored");
                None
            }
        }
    }
}

/// Which vector code runs the kernels on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    /// AVX-512 with VNNI: `vpdpbusd` on 16 rows at once.
    Avx512Vnni,
    /// AVX2 with FMA and F16C: the same arithmetic on two halves of 8 rows.
    Avx2,
    /// AVX-512 VNNI with AMX tiles for the integer sums of passes of 2 or more rows (`amx`);
    /// one row takes the VNNI kernels.
    Amx,
    /// [`Isa::Amx`] on the scalar model of the tiles, for tests on CPUs without AMX.
    #[cfg(test)]
    AmxModel,
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
        GgmlDType::Q8_0 | GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 => BLOCK,
        GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K => SUPER_BLOCK,
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
    /// Whether passes of several rows may run on AMX tiles where the CPU has them
    /// (`KernelSettings::amx`).
    amx: bool,
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
    /// Weight = d·(q − 8) with q in 0..16: `qs`, `d` as Q4_1's.
    Q4_0 { qs: Vec<u8>, d: Vec<f16> },
    /// Weight = d·q + m with q in 0..32: `qs`, `qh` as Q5_0's, `d`, `m` as Q4_1's.
    Q5_1 { qs: Vec<u8>, qh: Vec<u32>, d: Vec<f16>, m: Vec<f16> },
    /// Weight = (d·sc)·q − (dmin·m) with q in 0..32: Q4_K's fields, and the fifth bits as
    /// Q5_0's `qh`.
    Q5K { qs: Vec<u8>, qh: Vec<u32>, sc: Vec<u8>, m: Vec<u8>, d: Vec<f16>, dmin_neg: Vec<f16> },
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
/// GGML's Q4_0 block: f16 scale, 16 bytes of nibbles as Q4_1's.
const Q4_0_BYTES: usize = 2 + BLOCK / 2;
/// GGML's Q5_1 block: f16 scale, f16 minimum, 4 bytes of fifth bits, 16 bytes of nibbles.
const Q5_1_BYTES: usize = 8 + BLOCK / 2;
/// GGML's Q5_K super-block: f16 d, f16 dmin, 12 bytes of 6-bit scales and minima (as Q4_K's),
/// 32 bytes of fifth bits, 128 bytes of nibbles.
const Q5K_BYTES: usize = 4 + 12 + SUPER_BLOCK / 8 + SUPER_BLOCK / 2;
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

/// The 256 quantised values (0..16) and 8 (scale, minimum) pairs of a Q4_K super-block: the
/// layout spelled out, which the packing ([`repack_q4k_block`]) is tested against.
#[cfg(test)]
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

/// The 256 quantised values (0..32) and 8 (scale, minimum) pairs of a Q5_K super-block.
fn q5k_values(block: &[u8]) -> ([u8; SUPER_BLOCK], [(u8, u8); BLOCKS_PER_SUPER]) {
    let (qh, qs) = (&block[16..48], &block[48..]);
    let mut values = [0u8; SUPER_BLOCK];
    for (i, v) in values.iter_mut().enumerate() {
        // Q4_K's nibbles; the fifth bit of input i is bit i/32 of qh[i%32].
        let byte = qs[i / 64 * 32 + i % 32];
        let low = if i % 64 < 32 { byte & 0x0F } else { byte >> 4 };
        *v = low | (((qh[i % 32] >> (i / 32)) & 1) << 4);
    }
    (values, std::array::from_fn(|j| q4k_scale_min(j, &block[4..16])))
}

/// The fifth bits of a block's 32 values (each < 32) as a `qh` word: bit j for input j.
fn fifth_bits(values: &[u8]) -> u32 {
    values.iter().enumerate().fold(0, |w, (j, &v)| w | (((v >> 4) as u32 & 1) << j))
}

/// The 256 quantised values (0..64, to be taken − 32) and 16 scales of a Q6_K super-block: the
/// layout spelled out, which the packing ([`repack_q6k_block`]) is tested against.
#[cfg(test)]
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

/// Puts the low four bits of a block's 32 values into the tile layout Q4_1 stores: byte
/// (g, row, i) holds input 4g+i in its low nibble and 16+4g+i in its high one.
fn pack_nibbles(values: &[u8], qs: &mut [u8], tile: usize, lane: usize) {
    for j in 0..BLOCK / 2 {
        qs[tile + (j / 4 * TILE_N + lane) * 4 + j % 4] = (values[j] & 0x0F) | ((values[j + 16] & 0x0F) << 4);
    }
}

/// The tiles of a matrix of `n` rows in a few contiguous ranges, for packing in parallel: a
/// tile's packed bytes lie together in every array, so each range's work writes slices of
/// its own.
fn tile_ranges(n: usize) -> Vec<std::ops::Range<usize>> {
    let tiles = n / TILE_N;
    let parts = (4 * candle_core::utils::get_num_threads()).clamp(1, tiles.max(1));
    (0..parts).map(|t| tiles * t / parts..tiles * (t + 1) / parts).collect()
}

/// `work(part)` for every part, on candle's worker pool (the threads the matmuls use: its
/// workers spin between jobs, so threads of another pool would share cores with them).
fn pack_in_parallel<T: Send>(parts: impl Iterator<Item = T>, work: impl Fn(T) + Sync) {
    let slots: Vec<std::sync::Mutex<Option<T>>> = parts.map(|p| std::sync::Mutex::new(Some(p))).collect();
    candle_core::utils::barrier_pool().execute_chunked(slots.len(), |range| {
        for slot in &slots[range] {
            // Each slot is taken once; a poisoned lock only means another part panicked.
            if let Some(part) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
                work(part);
            }
        }
    });
}

/// `v` cut at `ranges` of tiles, `per_tile` elements to a tile.
fn tile_parts<'a, T>(v: &'a mut [T], per_tile: usize, ranges: &[std::ops::Range<usize>]) -> Vec<&'a mut [T]> {
    let mut rest = v;
    ranges
        .iter()
        .map(|r| {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(r.len() * per_tile);
            rest = tail;
            part
        })
        .collect()
}

/// [`pack_nibbles`] of block `j` of a Q4_K super-block, straight from its bytes: block `j`'s 32
/// inputs are the low (`j` even) or high (`j` odd) nibbles of bytes `32·(j/2)..` of the
/// quants, and packed byte `i` pairs inputs `i` and `i + 16`, four bytes to a row of a group.
/// The same bytes as unpacking to values first, without the 256-value detour (most of a
/// load's time).
fn repack_q4k_block(block: &[u8], j: usize, qs: &mut [u8], tile: usize, lane: usize) {
    let bytes = &block[16 + j / 2 * BLOCK..][..BLOCK];
    let shift = 4 * (j % 2);
    for g in 0..BLOCK / 8 {
        let word: [u8; 4] = std::array::from_fn(|t| {
            let i = g * 4 + t;
            ((bytes[i] >> shift) & 0x0F) | (((bytes[i + 16] >> shift) & 0x0F) << 4)
        });
        qs[tile + (g * TILE_N + lane) * 4..][..4].copy_from_slice(&word);
    }
}

/// Block `j` of a Q6_K super-block packed straight from its bytes, as [`pack_nibbles`] and
/// the two-bit `qh` groups take [`q6k_values`]' values: input `l` of the block has its low
/// nibble in `ql[64·(j/4) + 32·(j%2) + l]` (the high nibble there when `j%4 ≥ 2`) and its top
/// two bits at bit pair `j%4` of `qh[32·(j/4) + l]`. `qs` and `qh` come with the offsets of
/// the block's tile.
fn repack_q6k_block(block: &[u8], j: usize, qs: (&mut [u8], usize), qh: (&mut [u8], usize), lane: usize) {
    let (half, quarter) = (j / 4, j % 4);
    let ql = &block[half * 64 + (quarter % 2) * BLOCK..][..BLOCK];
    let high = &block[128 + half * BLOCK..][..BLOCK];
    let shift = if quarter < 2 { 0 } else { 4 };
    let low = |l: usize| (ql[l] >> shift) & 0x0F;
    let top = |l: usize| (high[l] >> (2 * quarter)) & 3;
    let ((qs, qs_at), (qh, qh_at)) = (qs, qh);
    for g in 0..BLOCK / 8 {
        let word: [u8; 4] = std::array::from_fn(|t| low(g * 4 + t) | (low(g * 4 + t + 16) << 4));
        qs[qs_at + (g * TILE_N + lane) * 4..][..4].copy_from_slice(&word);
    }
    // Groups 4h..4h+4 of four inputs: byte i holds input (4h + g)·4 + i's top bits at pair g.
    for h in 0..2 {
        let word: [u8; 4] = std::array::from_fn(|i| (0..4).fold(0, |w, g| w | (top((4 * h + g) * 4 + i) << (2 * g))));
        qh[qh_at + (h * TILE_N + lane) * 4..][..4].copy_from_slice(&word);
    }
}

impl PackedMatrix {
    /// Packs a `[n, k]` tensor of a type [`supports`] takes; `None` when [`supports`] says no or the CPU
    /// cannot run the kernels (so a `PackedMatrix` exists only where `matmul` is safe).
    pub fn from_qtensor(q: &QTensor, levels: ActivationLevels, amx: bool) -> Result<Option<Self>> {
        let (n, k) = q.shape().dims2()?;
        if !available() || !supports(q.dtype(), n, k) {
            return Ok(None);
        }
        let data = q.data()?;
        let data: &[u8] = &data;
        let kb = k / BLOCK;
        let (blocks, block_bytes) = match q.dtype() {
            GgmlDType::Q8_0 => (kb, Q8_0_BYTES),
            GgmlDType::Q5_0 => (kb, Q5_0_BYTES),
            GgmlDType::Q4K => (k / SUPER_BLOCK, Q4K_BYTES),
            GgmlDType::Q6K => (k / SUPER_BLOCK, Q6K_BYTES),
            GgmlDType::Q4_0 => (kb, Q4_0_BYTES),
            GgmlDType::Q5_1 => (kb, Q5_1_BYTES),
            GgmlDType::Q5K => (k / SUPER_BLOCK, Q5K_BYTES),
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
        let weights = if matches!(q.dtype(), GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1) {
            // Blocks of 32: f16 d, then f16 m (Q4_1, Q5_1) and four bytes of fifth bits (Q5_0,
            // Q5_1), then 16 bytes of nibbles (input j low, j+16 high).
            let (bytes, m_at, qh_at) = match q.dtype() {
                GgmlDType::Q4_0 => (Q4_0_BYTES, None, None),
                GgmlDType::Q4_1 => (Q4_1_BYTES, Some(2), None),
                GgmlDType::Q5_0 => (Q5_0_BYTES, None, Some(2)),
                _ => (Q5_1_BYTES, Some(2), Some(4)),
            };
            let qs_at = bytes - BLOCK / 2;
            let mut qs = vec![0u8; n * k / 2];
            // Minima and fifth bits only for the types that have them (empty otherwise).
            let (m_per_tile, qh_per_tile) =
                (if m_at.is_some() { TILE_N * kb } else { 0 }, if qh_at.is_some() { TILE_N * kb } else { 0 });
            let mut d = vec![f16::ZERO; n * kb];
            let (mut m, mut qh) = (vec![f16::ZERO; n / TILE_N * m_per_tile], vec![0u32; n / TILE_N * qh_per_tile]);
            let ranges = tile_ranges(n);
            let parts = ranges
                .iter()
                .zip(tile_parts(&mut qs, TILE_N * k / 2, &ranges))
                .zip(tile_parts(&mut d, TILE_N * kb, &ranges))
                .zip(tile_parts(&mut m, m_per_tile, &ranges))
                .zip(tile_parts(&mut qh, qh_per_tile, &ranges));
            pack_in_parallel(parts, |((((tiles, qs), d), m), qh)| {
                for row in tiles.start * TILE_N..tiles.end * TILE_N {
                    // `nt` counts from this part's first tile.
                    let (nt, lane) = (row / TILE_N - tiles.start, row % TILE_N);
                    for b in 0..kb {
                        let block = &data[(row * kb + b) * bytes..][..bytes];
                        let at = (nt * kb + b) * TILE_N + lane;
                        d[at] = f16_at(block, 0);
                        if let Some(i) = m_at {
                            m[at] = f16_at(block, i);
                        }
                        if let Some(i) = qh_at {
                            qh[at] = u32::from_le_bytes([block[i], block[i + 1], block[i + 2], block[i + 3]]);
                        }
                        let tile = (nt * kb + b) * TILE_N * BLOCK / 2;
                        for (j, &byte) in block[qs_at..].iter().enumerate() {
                            qs[tile + (j / 4 * TILE_N + lane) * 4 + j % 4] = byte;
                        }
                    }
                }
            });
            match q.dtype() {
                GgmlDType::Q4_0 => Packed::Q4_0 { qs, d },
                GgmlDType::Q4_1 => Packed::Q4_1 { qs, d, m },
                GgmlDType::Q5_0 => Packed::Q5_0 { qs, qh, d },
                _ => Packed::Q5_1 { qs, qh, d, m },
            }
        } else if matches!(q.dtype(), GgmlDType::Q4K | GgmlDType::Q5K) {
            // Q5_K is Q4_K's super-block with the values' fifth bits beside.
            let five = q.dtype() == GgmlDType::Q5K;
            let bytes = if five { Q5K_BYTES } else { Q4K_BYTES };
            let mut qs = vec![0u8; n * k / 2];
            // Fifth bits only for Q5_K (empty for Q4_K).
            let qh_per_tile = if five { TILE_N * kb } else { 0 };
            let (mut sc, mut m, mut qh) = (vec![0u8; n * kb], vec![0u8; n * kb], vec![0u32; n / TILE_N * qh_per_tile]);
            let (mut d, mut dmin_neg) = (vec![f16::ZERO; n * sb_n], vec![f16::ZERO; n * sb_n]);
            let ranges = tile_ranges(n);
            let parts = ranges
                .iter()
                .zip(tile_parts(&mut qs, TILE_N * k / 2, &ranges))
                .zip(tile_parts(&mut sc, TILE_N * kb, &ranges))
                .zip(tile_parts(&mut m, TILE_N * kb, &ranges))
                .zip(tile_parts(&mut qh, qh_per_tile, &ranges))
                .zip(tile_parts(&mut d, TILE_N * sb_n, &ranges))
                .zip(tile_parts(&mut dmin_neg, TILE_N * sb_n, &ranges));
            pack_in_parallel(parts, |((((((tiles, qs), sc), m), qh), d), dmin_neg)| {
                for row in tiles.start * TILE_N..tiles.end * TILE_N {
                    let (nt, lane) = (row / TILE_N - tiles.start, row % TILE_N);
                    for s in 0..sb_n {
                        let block = &data[(row * sb_n + s) * bytes..][..bytes];
                        d[(nt * sb_n + s) * TILE_N + lane] = f16_at(block, 0);
                        dmin_neg[(nt * sb_n + s) * TILE_N + lane] = -f16_at(block, 2);
                        if !five {
                            for j in 0..BLOCKS_PER_SUPER {
                                let b = s * BLOCKS_PER_SUPER + j;
                                let at = (nt * kb + b) * TILE_N + lane;
                                (sc[at], m[at]) = q4k_scale_min(j, &block[4..16]);
                                repack_q4k_block(block, j, qs, (nt * kb + b) * TILE_N * BLOCK / 2, lane);
                            }
                            continue;
                        }
                        let (values, scales) = q5k_values(block);
                        for (j, &(scale, min)) in scales.iter().enumerate() {
                            let b = s * BLOCKS_PER_SUPER + j;
                            let at = (nt * kb + b) * TILE_N + lane;
                            let vals = &values[j * BLOCK..(j + 1) * BLOCK];
                            (sc[at], m[at], qh[at]) = (scale, min, fifth_bits(vals));
                            pack_nibbles(vals, qs, (nt * kb + b) * TILE_N * BLOCK / 2, lane);
                        }
                    }
                }
            });
            if five {
                Packed::Q5K { qs, qh, sc, m, d, dmin_neg }
            } else {
                Packed::Q4K { qs, sc, m, d, dmin_neg }
            }
        } else if q.dtype() == GgmlDType::Q8_0 {
            let mut qs = vec![0u8; n * k];
            let mut d = vec![f16::ZERO; n * kb];
            let ranges = tile_ranges(n);
            let parts = ranges.iter().zip(tile_parts(&mut qs, TILE_N * k, &ranges)).zip(tile_parts(
                &mut d,
                TILE_N * kb,
                &ranges,
            ));
            pack_in_parallel(parts, |((tiles, qs), d)| {
                for row in tiles.start * TILE_N..tiles.end * TILE_N {
                    let (nt, lane) = (row / TILE_N - tiles.start, row % TILE_N);
                    for b in 0..kb {
                        let block = &data[(row * kb + b) * Q8_0_BYTES..][..Q8_0_BYTES];
                        let tile = (nt * kb + b) * TILE_N * BLOCK;
                        d[(nt * kb + b) * TILE_N + lane] = f16_at(block, 0);
                        for (i, &w) in block[2..].iter().enumerate() {
                            qs[tile + (i / 4 * TILE_N + lane) * 4 + i % 4] = (w as i8 as i16 + 128) as u8;
                        }
                    }
                }
            });
            Packed::Q8_0 { qs, d }
        } else {
            let mut qs = vec![0u8; n * k / 2];
            let mut qh = vec![0u8; n * k / 4];
            let mut sc = vec![0i8; n * kb * 2];
            let mut d = vec![f16::ZERO; n * sb_n];
            let ranges = tile_ranges(n);
            let parts = ranges
                .iter()
                .zip(tile_parts(&mut qs, TILE_N * k / 2, &ranges))
                .zip(tile_parts(&mut qh, TILE_N * k / 4, &ranges))
                .zip(tile_parts(&mut sc, TILE_N * kb * 2, &ranges))
                .zip(tile_parts(&mut d, TILE_N * sb_n, &ranges));
            pack_in_parallel(parts, |((((tiles, qs), qh), sc), d)| {
                for row in tiles.start * TILE_N..tiles.end * TILE_N {
                    let (nt, lane) = (row / TILE_N - tiles.start, row % TILE_N);
                    for s in 0..sb_n {
                        let block = &data[(row * sb_n + s) * Q6K_BYTES..][..Q6K_BYTES];
                        d[(nt * sb_n + s) * TILE_N + lane] = f16_at(block, 208);
                        for j in 0..BLOCKS_PER_SUPER {
                            let b = s * BLOCKS_PER_SUPER + j;
                            let (qs_at, qh_at) =
                                ((nt * kb + b) * TILE_N * BLOCK / 2, (nt * kb + b) * TILE_N * BLOCK / 4);
                            repack_q6k_block(block, j, (qs, qs_at), (qh, qh_at), lane);
                            sc[((nt * kb + b) * 2) * TILE_N + lane] = block[192 + 2 * j] as i8;
                            sc[((nt * kb + b) * 2 + 1) * TILE_N + lane] = block[192 + 2 * j + 1] as i8;
                        }
                    }
                }
            });
            Packed::Q6K { qs, qh, sc, d }
        };
        Ok(Some(Self { n, k, weights, levels, amx }))
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    /// `x`: `m` rows of `k` floats → `m` rows of `n` floats; an error when `x` is not whole rows.
    pub fn matmul(&self, x: &[f32]) -> Result<Vec<f32>> {
        let mut isa = isa().context("no vector kernels on this CPU")?;
        #[cfg(target_arch = "x86_64")]
        if self.amx && isa == Isa::Avx512Vnni && x.len() > MAX_ROWS * self.k && self.k >= AMX_MIN_K && amx::available()
        {
            isa = Isa::Amx;
        }
        self.matmul_on(x, isa)
    }

    /// [`Self::matmul`] on the kernels of `isa`, which this CPU must run.
    fn matmul_on(&self, x: &[f32], isa: Isa) -> Result<Vec<f32>> {
        let m = x.len() / self.k;
        if x.len() != m * self.k {
            bail!("matmul input of {} values is not whole rows of {}", x.len(), self.k);
        }
        // One row gains nothing from tiles, and takes the VNNI kernels' (identical) results.
        let isa = match isa {
            Isa::Amx if m < 2 => Isa::Avx512Vnni,
            #[cfg(test)]
            Isa::AmxModel if m < 2 => Isa::Avx512Vnni,
            other => other,
        };
        let acts = QuantizedRows::new(x, self.k, self.levels);
        // Not zeroed first: every element is written by exactly one tile below (a zeroed
        // 8 × 49152 logits buffer was a page-faulting memset on every step).
        let mut out: Vec<f32> = Vec::with_capacity(m * self.n);
        let out_ptr = SyncPtr(out.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(self.n / TILE_N, |tiles| {
            // Captures the whole `SyncPtr` (a closure would otherwise capture its raw field).
            #[allow(clippy::redundant_locals)]
            let out_ptr = out_ptr;
            // SAFETY: `isa` runs on this CPU (`isa()` and `amx::available()`, or a test's
            // `runnable_isas()`), and each tile writes only its own 16 columns of rows that
            // exist.
            unsafe { self.tiles_on(isa, tiles, &acts, m, out_ptr.get()) };
        });
        // SAFETY: the tiles cover all n/16 column groups of all m rows.
        unsafe { out.set_len(m * self.n) };
        Ok(out)
    }

    /// Output tiles `tiles` of all `m` rows on `isa`'s kernels, in passes of as many rows as
    /// they take.
    unsafe fn tiles_on(&self, isa: Isa, tiles: std::ops::Range<usize>, acts: &QuantizedRows, m: usize, out: *mut f32) {
        #[cfg(target_arch = "x86_64")]
        unsafe {
            macro_rules! by_rows {
                ($rows:expr, $driver:expr, $m:ident, $f:ident, $nt:expr, $r0:expr, [$($n:literal)*]) => {
                    match $rows {
                        $($n => $m::$f::<$n, _>(self, $nt, acts, $r0, out, $driver),)*
                        _ => unreachable!("a pass has 1..=16 rows"),
                    }
                };
            }
            macro_rules! by_type {
                ($rows:expr, $driver:expr, $nt:expr, $r0:expr, $n:tt) => {
                    match self.weights {
                        Packed::Q8_0 { .. } => by_rows!($rows, $driver, avx512, q8_0_rows, $nt, $r0, $n),
                        Packed::Q4_1 { .. } => by_rows!($rows, $driver, avx512, q4_1_rows, $nt, $r0, $n),
                        Packed::Q5_0 { .. } => by_rows!($rows, $driver, avx512, q5_0_rows, $nt, $r0, $n),
                        Packed::Q4K { .. } => by_rows!($rows, $driver, avx512, q4k_rows, $nt, $r0, $n),
                        Packed::Q6K { .. } => by_rows!($rows, $driver, avx512, q6k_rows, $nt, $r0, $n),
                        Packed::Q4_0 { .. } => by_rows!($rows, $driver, avx512, q4_0_rows, $nt, $r0, $n),
                        Packed::Q5_1 { .. } => by_rows!($rows, $driver, avx512, q5_1_rows, $nt, $r0, $n),
                        Packed::Q5K { .. } => by_rows!($rows, $driver, avx512, q5k_rows, $nt, $r0, $n),
                    }
                };
            }
            macro_rules! passes {
                ($driver:expr, $per_pass:expr, $n:tt) => {
                    for nt in tiles.clone() {
                        for r0 in (0..m).step_by($per_pass) {
                            by_type!((m - r0).min($per_pass), $driver, nt, r0, $n);
                        }
                    }
                };
            }
            match isa {
                Isa::Avx512Vnni => passes!(&mut avx512::Vnni, MAX_ROWS, [1 2 3 4 5 6 7 8]),
                Isa::Amx => {
                    let mut unit = amx::Tiles::enter();
                    let mut driver = amx::Amx::new(&mut unit);
                    passes!(&mut driver, amx::MAX_TILE_ROWS, [1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16]);
                }
                #[cfg(test)]
                Isa::AmxModel => {
                    let mut unit = amx::TileModel::new();
                    let mut driver = amx::Amx::new(&mut unit);
                    passes!(&mut driver, amx::MAX_TILE_ROWS, [1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16]);
                }
                Isa::Avx2 => {
                    for nt in tiles {
                        for r0 in (0..m).step_by(MAX_ROWS) {
                            let rows = (m - r0).min(MAX_ROWS);
                            macro_rules! avx2_rows {
                                ($f:ident) => {
                                    match rows {
                                        1 => avx2::$f::<1>(self, nt, acts, r0, out),
                                        2 => avx2::$f::<2>(self, nt, acts, r0, out),
                                        3 => avx2::$f::<3>(self, nt, acts, r0, out),
                                        4 => avx2::$f::<4>(self, nt, acts, r0, out),
                                        5 => avx2::$f::<5>(self, nt, acts, r0, out),
                                        6 => avx2::$f::<6>(self, nt, acts, r0, out),
                                        7 => avx2::$f::<7>(self, nt, acts, r0, out),
                                        _ => avx2::$f::<8>(self, nt, acts, r0, out),
                                    }
                                };
                            }
                            match self.weights {
                                Packed::Q8_0 { .. } => avx2_rows!(q8_0_rows),
                                Packed::Q4_1 { .. } => avx2_rows!(q4_1_rows),
                                Packed::Q5_0 { .. } => avx2_rows!(q5_0_rows),
                                Packed::Q4K { .. } => avx2_rows!(q4k_rows),
                                Packed::Q6K { .. } => avx2_rows!(q6k_rows),
                                Packed::Q4_0 { .. } => avx2_rows!(q4_0_rows),
                                Packed::Q5_1 { .. } => avx2_rows!(q5_1_rows),
                                Packed::Q5K { .. } => avx2_rows!(q5k_rows),
                            }
                        }
                    }
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (isa, tiles, acts, m, out);
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
        return unsafe { avx2::quantize_range(x, q, r, blocks, two_level) };
    }
    quantize_range_portable(x, q, r, blocks, two_level)
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
