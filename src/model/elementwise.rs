//! `silu(gate) * up`, the MLP's gating, in one pass over both inputs on all cores.
//!
//! candle's `gate.silu()? * &up` ran on one core here: `gate` and `up` are column slices of
//! one stacked projection, and candle only parallelises contiguous inputs. The result is bit
//! for bit candle's: the same `v / (1 + exp(-v))` then `* u` in f32, with `exp` as glibc's
//! `expf` (`crate::vmath`), eight lanes at a time.

use anyhow::Result;
use candle_core::{DType, Storage, Tensor};

use crate::parallel::SyncPtr;

/// Elements per work item: small enough to split a single decode row across both cores.
const CHUNK: usize = 256;

/// `silu(gate) * up` for two `[rows, width]` f32 tensors on the CPU, whatever their row
/// strides; other devices and types take candle's ops.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (rows, width) = gate.dims2()?;
    let fast = gate.device().is_cpu()
        && up.device().is_cpu()
        && gate.dtype() == DType::F32
        && up.dtype() == DType::F32
        && up.dims2()? == (rows, width);
    if !fast {
        return Ok((gate.silu()? * up)?);
    }
    let (g_storage, g_layout) = gate.storage_and_layout();
    let (u_storage, u_layout) = up.storage_and_layout();
    let (Storage::Cpu(g), Storage::Cpu(u)) = (&*g_storage, &*u_storage) else {
        return Ok((gate.silu()? * up)?);
    };
    let (g, u) = (g.as_slice::<f32>()?, u.as_slice::<f32>()?);
    // Rows with unit column stride: what a column slice of a row-major matrix is.
    let row_view = |layout: &candle_core::Layout| {
        let s = layout.stride();
        (s[1] == 1 || width <= 1).then_some((layout.start_offset(), s[0]))
    };
    let (Some((g0, g_stride)), Some((u0, u_stride))) = (row_view(g_layout), row_view(u_layout)) else {
        return Ok((gate.silu()? * up)?);
    };
    let row_end = |start: usize, stride: usize| start + (rows.max(1) - 1) * stride + width;
    anyhow::ensure!(
        rows == 0 || (row_end(g0, g_stride) <= g.len() && row_end(u0, u_stride) <= u.len()),
        "silu_mul: views outside their storage"
    );

    let mut out: Vec<f32> = Vec::with_capacity(rows * width);
    let out_ptr = SyncPtr(out.as_mut_ptr());
    let chunks_per_row = width.div_ceil(CHUNK);
    candle_core::utils::barrier_pool().execute_chunked(rows * chunks_per_row, |items| {
        // Captures the whole `SyncPtr` (a closure would otherwise capture its raw field).
        #[allow(clippy::redundant_locals)]
        let out_ptr = out_ptr;
        for item in items {
            let (row, c) = (item / chunks_per_row, item % chunks_per_row);
            let (lo, hi) = (c * CHUNK, width.min((c + 1) * CHUNK));
            let gs = &g[g0 + row * g_stride + lo..g0 + row * g_stride + hi];
            let us = &u[u0 + row * u_stride + lo..u0 + row * u_stride + hi];
            // SAFETY: items are disjoint ranges of `out`, whose capacity is rows × width.
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(row * width + lo), hi - lo) };
            silu_mul_slice(gs, us, dst);
        }
    });
    // SAFETY: every element was written by exactly one item above.
    unsafe { out.set_len(rows * width) };
    drop((g_storage, u_storage));
    Ok(Tensor::from_vec(out, (rows, width), gate.device())?)
}

/// candle's `Silu::f32` followed by its f32 `Mul`.
#[inline]
fn silu_mul_scalar(v: f32, u: f32) -> f32 {
    (v / (1.0 + (-v).exp())) * u
}

fn silu_mul_slice(g: &[f32], u: &[f32], out: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::vmath::exp8_available() {
        // SAFETY: the CPU has AVX-512F.
        done = unsafe { x86::silu_mul_avx512(g, u, out) };
    }
    for ((o, &v), &w) in out[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
        *o = silu_mul_scalar(v, w);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::vmath::x86::Exp8;
    use core::arch::x86_64::*;

    /// Whole groups of eight; a group whose `-v` is out of `Exp8`'s range goes through the
    /// scalar formula. Returns how many elements were done.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn silu_mul_avx512(g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
        let n = g.len().min(u.len()).min(out.len()) / 8 * 8;
        unsafe {
            let exp = Exp8::new();
            let (one, sign) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
            let mut i = 0;
            while i < n {
                let v = _mm256_loadu_ps(g.as_ptr().add(i));
                let neg = _mm256_xor_ps(v, sign);
                if Exp8::in_range(neg) {
                    let silu = _mm256_div_ps(v, _mm256_add_ps(one, exp.exp(neg)));
                    _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(silu, _mm256_loadu_ps(u.as_ptr().add(i))));
                } else {
                    for j in i..i + 8 {
                        out[j] = super::silu_mul_scalar(g[j], u[j]);
                    }
                }
                i += 8;
            }
            n
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Bit for bit candle's `silu` then `*`, on column slices of one matrix (as the MLP calls
    /// it) and on contiguous tensors, with values far outside the vector exp's range too.
    #[test]
    fn equals_candle_silu_times_up_bitwise() {
        let mut s = 99u64;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 24.0
        };
        for (rows, width) in [(1usize, 1536usize), (8, 1536), (3, 4864), (5, 13), (2, 300)] {
            let mut data: Vec<f32> = (0..rows * 2 * width).map(|_| next()).collect();
            data[0] = 95.0;
            data[rows * 2 * width - 1] = -200.0;
            data[3 % (2 * width)] = f32::NAN;
            let stacked = Tensor::from_vec(data, (rows, 2 * width), &Device::Cpu).unwrap();
            let gate = stacked.narrow(1, 0, width).unwrap();
            let up = stacked.narrow(1, width, width).unwrap();
            let want = (gate.silu().unwrap() * &up).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let got = silu_mul(&gate, &up).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{rows}×{width}, column slices");
            let (gate, up) = (gate.contiguous().unwrap(), up.contiguous().unwrap());
            let got = silu_mul(&gate, &up).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(bits(&got), bits(&want), "{rows}×{width}, contiguous");
        }
    }
}
