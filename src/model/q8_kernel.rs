//! Q8_0 weights × 8-bit activations on AVX-512 VNNI CPUs, for any batch size.
//!
//! Why not candle's repacked Q8_0 kernel: it needs input widths that are multiples of 256
//! (SmolLM2's 576 had to be zero-padded to 768, a third more work), quantises activations
//! with a scalar loop, and takes activation rows four at a time. Here any width that is a
//! multiple of 32 works, activations are quantised per 32 values (as llama.cpp does for
//! Q8_0) with vector code, and up to eight rows share each weight load.
//!
//! Row invariance: each output is an exact integer dot product per 32-value block, then the
//! same float operations in the same order, whatever the number of rows, their grouping or
//! the thread split (threads split output columns). So a verified block of tokens gets
//! bit for bit the logits single steps would.

use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

use crate::parallel::SyncPtr;

const BLOCK: usize = 32;
/// Output rows per weight tile: one 512-bit vector of i32 sums.
const TILE_N: usize = 16;
/// Activation rows that share one pass over a weight tile.
const MAX_ROWS: usize = 8;

/// Whether this CPU runs the kernel. `SPECULA_NO_Q8_KERNEL=1` turns it off (A/B runs).
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let off = super::env_flag("SPECULA_NO_Q8_KERNEL");
        #[cfg(target_arch = "x86_64")]
        {
            !off && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = off;
            false
        }
    })
}

/// Whether a `[n, k]` matrix fits the kernel's tiling.
pub fn fits(n: usize, k: usize) -> bool {
    n > 0 && k > 0 && n % TILE_N == 0 && k % BLOCK == 0
}

/// A Q8_0 matrix rearranged into tiles of 16 output rows × 32 inputs.
pub struct PackedQ8 {
    n: usize,
    k: usize,
    /// `[n/16][k/32][8 groups of 4 inputs][16 rows][4]`, each weight + 128 as u8, because
    /// `vpdpbusd` multiplies unsigned by signed bytes.
    qs: Vec<u8>,
    /// `[n/16][k/32][16]` block scales, as stored in the file: f16 keeps the bytes streamed
    /// per step down (decode is bound by reading the weights), and widening is exact.
    scales: Vec<f16>,
}

/// GGML's Q8_0 block: an f16 scale and 32 signed bytes.
const Q8_0_BYTES: usize = 2 + BLOCK;

impl PackedQ8 {
    /// Packs a `[n, k]` Q8_0 tensor; `None` when the shape does not fit the tiling or the CPU
    /// cannot run the kernel (so a `PackedQ8` exists only where `matmul` is safe to call).
    pub fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        if q.dtype() != GgmlDType::Q8_0 {
            bail!("PackedQ8 needs Q8_0 weights, got {:?}", q.dtype());
        }
        let (n, k) = q.shape().dims2()?;
        if !available() || !fits(n, k) {
            return Ok(None);
        }
        let data = q.data()?;
        let kb = k / BLOCK;
        if data.len() != n * kb * Q8_0_BYTES {
            bail!("Q8_0 tensor of {n}×{k} has {} bytes", data.len());
        }
        let mut qs = vec![0u8; n * k];
        let mut scales = vec![f16::ZERO; n * kb];
        for row in 0..n {
            let (nt, lane) = (row / TILE_N, row % TILE_N);
            for b in 0..kb {
                let block = &data[(row * kb + b) * Q8_0_BYTES..][..Q8_0_BYTES];
                let tile = (nt * kb + b) * TILE_N * BLOCK;
                scales[(nt * kb + b) * TILE_N + lane] = f16::from_le_bytes([block[0], block[1]]);
                for (i, &w) in block[2..].iter().enumerate() {
                    let (group, byte) = (i / 4, i % 4);
                    qs[tile + (group * TILE_N + lane) * 4 + byte] = (w as i8 as i16 + 128) as u8;
                }
            }
        }
        Ok(Some(Self { n, k, qs, scales }))
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    /// `x`: `m` rows of `k` floats → `m` rows of `n` floats.
    pub fn matmul(&self, x: &[f32]) -> Vec<f32> {
        let m = x.len() / self.k;
        assert_eq!(x.len(), m * self.k, "input is not whole rows");
        let acts = QuantizedRows::new(x, self.k);
        // Not zeroed first: every element is written by exactly one tile below (a zeroed
        // 8 × 49152 logits buffer was a page-faulting memset on every step).
        let mut out: Vec<f32> = Vec::with_capacity(m * self.n);
        let out_ptr = SyncPtr(out.as_mut_ptr());
        let n_tiles = self.n / TILE_N;
        candle_core::utils::barrier_pool().execute_chunked(n_tiles, |tiles| {
            let out_ptr = out_ptr;
            for nt in tiles {
                for r0 in (0..m).step_by(MAX_ROWS) {
                    // SAFETY: `from_qtensor` packs only where `available()`, and each tile
                    // writes only its own 16 columns of rows that exist.
                    unsafe { self.tile(nt, &acts, r0, (m - r0).min(MAX_ROWS), out_ptr.get()) };
                }
            }
        });
        // SAFETY: the tiles cover all n/16 column groups of all m rows.
        unsafe { out.set_len(m * self.n) };
        out
    }

    unsafe fn tile(&self, nt: usize, acts: &QuantizedRows, r0: usize, rows: usize, out: *mut f32) {
        #[cfg(target_arch = "x86_64")]
        match rows {
            1 => avx512::tile_rows::<1>(self, nt, acts, r0, out),
            2 => avx512::tile_rows::<2>(self, nt, acts, r0, out),
            3 => avx512::tile_rows::<3>(self, nt, acts, r0, out),
            4 => avx512::tile_rows::<4>(self, nt, acts, r0, out),
            5 => avx512::tile_rows::<5>(self, nt, acts, r0, out),
            6 => avx512::tile_rows::<6>(self, nt, acts, r0, out),
            7 => avx512::tile_rows::<7>(self, nt, acts, r0, out),
            _ => avx512::tile_rows::<8>(self, nt, acts, r0, out),
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (nt, acts, r0, rows, out);
            unreachable!("PackedQ8 is only built where `available()`");
        }
    }
}

/// Activation blocks per work item when quantising.
const QUANT_CHUNK: usize = 32;

/// Activations quantised per 32 values: `q = round(x / d)`, `d = max|x| / 127`.
struct QuantizedRows {
    q: Vec<i8>,
    /// `[m][k/32]` scales.
    d: Vec<f32>,
    /// `[m][k/32]`: 128 × Σq, what the +128 weight offset adds to each block's dot product.
    offset: Vec<i32>,
    k: usize,
}

impl QuantizedRows {
    /// On all cores: for a few decode rows this was a serial stretch the other core spent
    /// waiting through, in every matmul.
    fn new(x: &[f32], k: usize) -> Self {
        let blocks = x.len() / BLOCK;
        let mut q = vec![0i8; x.len()];
        let mut d = vec![0f32; blocks];
        let mut offset = vec![0i32; blocks];
        let (q_ptr, d_ptr, off_ptr) = (SyncPtr(q.as_mut_ptr()), SyncPtr(d.as_mut_ptr()), SyncPtr(offset.as_mut_ptr()));
        candle_core::utils::barrier_pool().execute_chunked(blocks.div_ceil(QUANT_CHUNK), |chunks| {
            let (q_ptr, d_ptr, off_ptr) = (q_ptr, d_ptr, off_ptr);
            for c in chunks {
                for b in c * QUANT_CHUNK..blocks.min((c + 1) * QUANT_CHUNK) {
                    // SAFETY: chunks are disjoint block ranges inside the three buffers.
                    let qs = unsafe { std::slice::from_raw_parts_mut(q_ptr.get().add(b * BLOCK), BLOCK) };
                    let (scale, sum) = quantize_block(&x[b * BLOCK..(b + 1) * BLOCK], qs);
                    unsafe {
                        *d_ptr.get().add(b) = scale;
                        *off_ptr.get().add(b) = 128 * sum;
                    }
                }
            }
        });
        Self { q, d, offset, k }
    }
}

/// One block of 32 activations; returns its scale and the sum of the quantised values.
fn quantize_block(xs: &[f32], qs: &mut [i8]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the features were detected.
        return unsafe { avx512::quantize_block(xs, qs) };
    }
    quantize_block_portable(xs, qs)
}

fn quantize_block_portable(xs: &[f32], qs: &mut [i8]) -> (f32, i32) {
    let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0;
    for (q, x) in qs.iter_mut().zip(xs) {
        *q = (x * id).round_ties_even() as i8;
        sum += *q as i32;
    }
    (d, sum)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{PackedQ8, QuantizedRows, BLOCK, TILE_N};
    use core::arch::x86_64::*;

    /// How far ahead, in 16×32 weight blocks (8 KiB here), to ask for the weights.
    /// 8–16 measured alike on this machine; 0 and 32 were slower.
    const PREFETCH_BLOCKS: usize = 16;

    /// `rows` activation rows from `r0` against output tile `nt`, all of `k`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile_rows<const ROWS: usize>(
        p: &PackedQ8,
        nt: usize,
        acts: &QuantizedRows,
        r0: usize,
        out: *mut f32,
    ) {
        let kb_n = p.k / BLOCK;
        let qs = p.qs.as_ptr().add(nt * kb_n * TILE_N * BLOCK);
        let scales = p.scales.as_ptr().add(nt * kb_n * TILE_N);
        let mut acc = [_mm512_setzero_ps(); ROWS];
        for b in 0..kb_n {
            let w = qs.add(b * TILE_N * BLOCK);
            // The hardware prefetcher alone does not keep up once several rows share a
            // tile: without this, loading and computing took turns (8 rows: 1.5× slower).
            // Past the end of this thread's tiles it only prefetches lines it will not use.
            let ahead = w.wrapping_add(PREFETCH_BLOCKS * TILE_N * BLOCK);
            for line in 0..TILE_N * BLOCK / 64 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line * 64) as *const i8);
            }
            _mm_prefetch::<_MM_HINT_T0>(scales.wrapping_add((b + PREFETCH_BLOCKS) * TILE_N) as *const i8);
            let ws = _mm512_cvtph_ps(_mm256_loadu_si256(scales.add(b * TILE_N) as *const __m256i));
            let wv: [__m512i; 8] = core::array::from_fn(|g| _mm512_loadu_si512(w.add(g * 64) as *const _));
            for (r, acc) in acc.iter_mut().enumerate() {
                let row = r0 + r;
                let a = acts.q.as_ptr().add(row * acts.k + b * BLOCK) as *const i32;
                let blk = row * kb_n + b;
                // Start from −128·Σq to cancel the weights' +128 offset; integer sums are exact.
                let mut isum = _mm512_set1_epi32(-acts.offset[blk]);
                for (g, wg) in wv.iter().enumerate() {
                    isum = _mm512_dpbusd_epi32(isum, *wg, _mm512_set1_epi32(a.add(g).read_unaligned()));
                }
                let scale = _mm512_mul_ps(ws, _mm512_set1_ps(acts.d[blk]));
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *acc);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add((r0 + r) * p.n + nt * TILE_N), *acc);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn quantize_block(xs: &[f32], qs: &mut [i8]) -> (f32, i32) {
        assert!(xs.len() == BLOCK && qs.len() == BLOCK, "one block of 32");
        let lo = _mm512_loadu_ps(xs.as_ptr());
        let hi = _mm512_loadu_ps(xs.as_ptr().add(16));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let vid = _mm512_set1_ps(id);
        // Round to nearest even, as `round_ties_even` in the portable version.
        let qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vid));
        let qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vid));
        _mm_storeu_si128(qs.as_mut_ptr() as *mut __m128i, _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128(qs.as_mut_ptr().add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(qhi));
        (d, _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)))
    }
}

/// The kernel's arithmetic written as plain loops, for tests: the same integer sums and the
/// same float operations in the same order.
#[cfg(test)]
fn matmul_portable(p: &PackedQ8, x: &[f32]) -> Vec<f32> {
    let (n, k) = (p.n, p.k);
    let kb_n = k / BLOCK;
    let m = x.len() / k;
    let mut out = vec![0f32; m * n];
    for r in 0..m {
        let mut q = vec![0i8; k];
        let mut blocks = Vec::new();
        for (xs, qs) in x[r * k..(r + 1) * k].chunks_exact(BLOCK).zip(q.chunks_exact_mut(BLOCK)) {
            blocks.push(quantize_block_portable(xs, qs));
        }
        for col in 0..n {
            let (nt, lane) = (col / TILE_N, col % TILE_N);
            let mut acc = 0f32;
            for (b, &(d, sum)) in blocks.iter().enumerate() {
                let tile = (nt * kb_n + b) * TILE_N * BLOCK;
                let mut isum = -128 * sum;
                for i in 0..BLOCK {
                    let w = p.qs[tile + (i / 4 * TILE_N + lane) * 4 + i % 4] as i32;
                    isum += w * q[b * BLOCK + i] as i32;
                }
                let scale = p.scales[(nt * kb_n + b) * TILE_N + lane].to_f32() * d;
                acc = (isum as f32).mul_add(scale, acc);
            }
            out[r * n + col] = acc;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    fn packed(n: usize, k: usize) -> (PackedQ8, Vec<f32>) {
        let w = Tensor::from_vec(random(n * k, 7), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let dense = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (PackedQ8::from_qtensor(&q).unwrap().unwrap(), dense)
    }

    #[test]
    fn kernel_equals_the_portable_loops_bitwise_and_every_row_count_agrees() {
        if !available() {
            eprintln!("skipped: no AVX-512 VNNI on this CPU");
            return;
        }
        let (n, k) = (48, 576);
        let (p, _) = packed(n, k);
        let x = random(19 * k, 11);
        let all = p.matmul(&x);
        assert_eq!(all, matmul_portable(&p, &x));
        for (r, row) in all.chunks_exact(n).enumerate() {
            assert_eq!(row, p.matmul(&x[r * k..(r + 1) * k]).as_slice(), "row {r} alone");
        }
        assert_eq!(&all[..5 * n], p.matmul(&x[..5 * k]).as_slice(), "first 5 rows");
    }

    #[test]
    fn result_is_close_to_the_dense_product() {
        if !available() {
            eprintln!("skipped: no AVX-512 VNNI on this CPU");
            return;
        }
        let (n, k) = (32, 96);
        let (p, dense) = packed(n, k);
        let x = random(3 * k, 5);
        let got = p.matmul(&x);
        for r in 0..3 {
            for c in 0..n {
                let exact: f32 = (0..k).map(|i| x[r * k + i] * dense[c * k + i]).sum();
                let norm: f32 = (0..k).map(|i| (x[r * k + i] * dense[c * k + i]).abs()).sum();
                assert!((got[r * n + c] - exact).abs() <= 0.02 * norm, "{r},{c}: {} vs {exact}", got[r * n + c]);
            }
        }
    }

    #[test]
    fn shapes_off_the_tiling_are_refused() {
        assert!(!fits(24, 64));
        assert!(!fits(32, 48));
        assert!(fits(32, 64));
    }
}
