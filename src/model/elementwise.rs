//! Row-wise ops of the forward that candle runs slowly at decode sizes, bit for bit as
//! candle computes them.
//!
//! `act(gate) * up`, the MLP's gating, in one pass over both inputs on all cores. candle's
//! `gate.silu()? * &up` ran on one core here: `gate` and `up` are column slices of one
//! stacked projection, and candle only parallelises contiguous inputs. SiLU is candle's
//! `v / (1 + exp(-v))` then `* u` in f32, bit for bit, with `exp` as glibc's `expf`
//! (`crate::vmath`), eight lanes at a time. GELU (tanh approximation, Gemma) is computed as
//! `v / (1 + exp(-2·√(2/π)·(v + 0.044715·v³)))`, the same function as `0.5·v·(1 + tanh(…))`
//! without a tanh: candle's `gelu` on one core was 15% of Gemma 3's prefill.
//!
//! RMSNorm, several rows at once. candle sums each row's squares in one sequential chain,
//! row after row; a decode step's 8 rows of 576 spent 8 µs per norm waiting on that chain's
//! latency. Here up to 8 rows advance together, each still summed in its own order.

use anyhow::Result;
use candle_core::{DType, Storage, Tensor};

use super::config::Activation;
use crate::parallel::SyncPtr;

/// Elements per work item: small enough to split a single decode row across both cores.
const CHUNK: usize = 256;

/// candle's version of [`gated_mul`], for other devices and types.
fn gated_mul_candle(gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
    Ok(match act {
        Activation::Silu => (gate.silu()? * up)?,
        Activation::GeluTanh => (gate.gelu()? * up)?,
    })
}

/// `act(gate) * up` for two `[rows, width]` f32 tensors on the CPU, whatever their row
/// strides; other devices and types take candle's ops.
pub fn gated_mul(gate: &Tensor, up: &Tensor, act: Activation) -> Result<Tensor> {
    let (rows, width) = gate.dims2()?;
    let fast = gate.device().is_cpu()
        && up.device().is_cpu()
        && gate.dtype() == DType::F32
        && up.dtype() == DType::F32
        && up.dims2()? == (rows, width);
    if !fast {
        return gated_mul_candle(gate, up, act);
    }
    let (g_storage, g_layout) = gate.storage_and_layout();
    let (u_storage, u_layout) = up.storage_and_layout();
    let (Storage::Cpu(g), Storage::Cpu(u)) = (&*g_storage, &*u_storage) else {
        return gated_mul_candle(gate, up, act);
    };
    let (g, u) = (g.as_slice::<f32>()?, u.as_slice::<f32>()?);
    // Rows with unit column stride: what a column slice of a row-major matrix is.
    let row_view = |layout: &candle_core::Layout| {
        let s = layout.stride();
        (s[1] == 1 || width <= 1).then_some((layout.start_offset(), s[0]))
    };
    let (Some((g0, g_stride)), Some((u0, u_stride))) = (row_view(g_layout), row_view(u_layout)) else {
        return gated_mul_candle(gate, up, act);
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
            match act {
                Activation::Silu => silu_mul_slice(gs, us, dst),
                Activation::GeluTanh => gelu_mul_slice(gs, us, dst),
            }
        }
    });
    // SAFETY: every element was written by exactly one item above.
    unsafe { out.set_len(rows * width) };
    drop((g_storage, u_storage));
    Ok(Tensor::from_vec(out, (rows, width), gate.device())?)
}

/// Rows normalised together: their sums of squares are independent chains.
const NORM_ROWS: usize = 8;

/// `candle_nn::ops::rms_norm(x, alpha, eps)` for a contiguous `[rows, width]` f32 tensor on
/// the CPU (others take candle's op): `x / sqrt(mean(x²) + eps) * alpha`, per row.
pub fn rms_norm(x: &Tensor, alpha: &Tensor, eps: f32) -> Result<Tensor> {
    let fast = x.device().is_cpu() && x.dtype() == DType::F32 && alpha.dtype() == DType::F32 && x.rank() == 2;
    if !fast {
        return Ok(candle_nn::ops::rms_norm(x, alpha, eps)?);
    }
    let (rows, width) = x.dims2()?;
    let (x_storage, x_layout) = x.storage_and_layout();
    let (a_storage, a_layout) = alpha.storage_and_layout();
    let (Storage::Cpu(xs), Storage::Cpu(a), Some((x0, x1)), Some((a0, a1))) =
        (&*x_storage, &*a_storage, x_layout.contiguous_offsets(), a_layout.contiguous_offsets())
    else {
        drop((x_storage, a_storage));
        if !x.is_contiguous() || !alpha.is_contiguous() {
            return rms_norm(&x.contiguous()?, &alpha.contiguous()?, eps);
        }
        return Ok(candle_nn::ops::rms_norm(x, alpha, eps)?);
    };
    let (xs, alpha) = (&xs.as_slice::<f32>()?[x0..x1], &a.as_slice::<f32>()?[a0..a1]);
    anyhow::ensure!(alpha.len() == width, "rms_norm: {} weights for rows of {width}", alpha.len());
    let mut out: Vec<f32> = vec![0.0; rows * width];
    let groups = rows.div_ceil(NORM_ROWS);
    if groups <= 1 {
        rms_norm_rows(xs, alpha, eps, &mut out);
    } else {
        let out_ptr = SyncPtr(out.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(groups, |items| {
            // Captures the whole `SyncPtr` (a closure would otherwise capture its raw field).
            #[allow(clippy::redundant_locals)]
            let out_ptr = out_ptr;
            for g in items {
                let (lo, hi) = (g * NORM_ROWS * width, rows.min((g + 1) * NORM_ROWS) * width);
                // SAFETY: groups are disjoint row ranges of `out`.
                let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(lo), hi - lo) };
                rms_norm_rows(&xs[lo..hi], alpha, eps, dst);
            }
        });
    }
    drop((x_storage, a_storage));
    Ok(Tensor::from_vec(out, (rows, width), x.device())?)
}

/// At most `NORM_ROWS` rows of `alpha.len()`: candle's `rms_row` for each, the squares of
/// all rows summed in one pass so that their chains overlap.
fn rms_norm_rows(x: &[f32], alpha: &[f32], eps: f32, out: &mut [f32]) {
    let width = alpha.len();
    let rows = x.len() / width;
    debug_assert!(rows <= NORM_ROWS);
    let mut sum2 = [0f32; NORM_ROWS];
    for i in 0..width {
        for (r, s) in sum2.iter_mut().enumerate().take(rows) {
            let v = x[r * width + i];
            *s += v * v;
        }
    }
    for (r, s) in sum2.iter().enumerate().take(rows) {
        let m = (s / width as f32 + eps).sqrt();
        for ((d, &v), &a) in out[r * width..(r + 1) * width].iter_mut().zip(&x[r * width..(r + 1) * width]).zip(alpha) {
            *d = v / m * a;
        }
    }
}

/// candle's `Silu::f32` followed by its f32 `Mul`.
#[inline]
fn silu_mul_scalar(v: f32, u: f32) -> f32 {
    (v / (1.0 + (-v).exp())) * u
}

fn silu_mul_slice(g: &[f32], u: &[f32], out: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    match crate::vmath::exp8_isa() {
        // SAFETY: the CPU has the features each function is compiled for.
        Some(crate::vmath::ExpIsa::Avx512) => done = unsafe { x86::silu_mul_avx512(g, u, out) },
        Some(crate::vmath::ExpIsa::Avx2) => done = unsafe { x86::silu_mul_avx2(g, u, out) },
        None => {}
    }
    for ((o, &v), &w) in out[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
        *o = silu_mul_scalar(v, w);
    }
}

/// `2·√(2/π)`: GELU's tanh argument doubled, as the sigmoid form takes it.
const GELU_2C: f32 = (2.0 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2) as f32;
const GELU_CUBIC: f32 = 0.044715;

/// GELU (tanh approximation) of `v`, times `u`: `v / (1 + exp(-2c·v·(1 + 0.044715·v²)))`.
#[inline]
fn gelu_mul_scalar(v: f32, u: f32) -> f32 {
    let t = -GELU_2C * v * (1.0 + GELU_CUBIC * v * v);
    (v / (1.0 + t.exp())) * u
}

fn gelu_mul_slice(g: &[f32], u: &[f32], out: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    match crate::vmath::exp8_isa() {
        // SAFETY: the CPU has the features each function is compiled for.
        Some(crate::vmath::ExpIsa::Avx512) => done = unsafe { x86::gelu_mul_avx512(g, u, out) },
        Some(crate::vmath::ExpIsa::Avx2) => done = unsafe { x86::gelu_mul_avx2(g, u, out) },
        None => {}
    }
    for ((o, &v), &w) in out[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
        *o = gelu_mul_scalar(v, w);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::vmath::x86::{in_range, Exp8, Exp8Avx2, Exp8Avx512};
    use core::arch::x86_64::*;

    /// Whole groups of eight; a group whose `-v` is out of `Exp8`'s range goes through the
    /// scalar formula. Returns how many elements were done.
    #[inline(always)]
    unsafe fn silu_mul<E: Exp8>(g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
        let n = g.len().min(u.len()).min(out.len()) / 8 * 8;
        unsafe {
            let exp = E::new();
            let (one, sign) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
            let mut i = 0;
            while i < n {
                let v = _mm256_loadu_ps(g.as_ptr().add(i));
                let neg = _mm256_xor_ps(v, sign);
                if in_range(neg) {
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

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn silu_mul_avx512(g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
        unsafe { silu_mul::<Exp8Avx512>(g, u, out) }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul_avx2(g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
        unsafe { silu_mul::<Exp8Avx2>(g, u, out) }
    }

    /// As [`silu_mul`], with the exponent `-2c·v·(1 + 0.044715·v²)`, the same float
    /// operations as the scalar formula.
    #[inline(always)]
    unsafe fn gelu_mul<E: Exp8>(g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
        let n = g.len().min(u.len()).min(out.len()) / 8 * 8;
        unsafe {
            let exp = E::new();
            let one = _mm256_set1_ps(1.0);
            let (c2, cubic) = (_mm256_set1_ps(-super::GELU_2C), _mm256_set1_ps(super::GELU_CUBIC));
            let mut i = 0;
            while i < n {
                let v = _mm256_loadu_ps(g.as_ptr().add(i));
                let inner = _mm256_add_ps(one, _mm256_mul_ps(_mm256_mul_ps(cubic, v), v));
                let t = _mm256_mul_ps(_mm256_mul_ps(c2, v), inner);
                if in_range(t) {
                    let gelu = _mm256_div_ps(v, _mm256_add_ps(one, exp.exp(t)));
                    _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(gelu, _mm256_loadu_ps(u.as_ptr().add(i))));
                } else {
                    for j in i..i + 8 {
                        out[j] = super::gelu_mul_scalar(g[j], u[j]);
                    }
                }
                i += 8;
            }
            n
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gelu_mul_avx512(g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
        unsafe { gelu_mul::<Exp8Avx512>(g, u, out) }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gelu_mul_avx2(g: &[f32], u: &[f32], out: &mut [f32]) -> usize {
        unsafe { gelu_mul::<Exp8Avx2>(g, u, out) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Reproducible values uniform in [-scale/2, scale/2).
    fn values(seed: u64, scale: f32) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
        }
    }

    #[test]
    fn rms_norm_equals_candle_bitwise() {
        let mut next = values(7, 6.0);
        for (rows, width) in [(1usize, 576usize), (8, 576), (9, 576), (40, 896), (3, 13), (17, 1)] {
            let x =
                Tensor::from_vec((0..rows * width).map(|_| next()).collect::<Vec<_>>(), (rows, width), &Device::Cpu)
                    .unwrap();
            let alpha = Tensor::from_vec((0..width).map(|_| next()).collect::<Vec<_>>(), width, &Device::Cpu).unwrap();
            for eps in [1e-5f32, 1e-6] {
                let want =
                    candle_nn::ops::rms_norm(&x, &alpha, eps).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let got = rms_norm(&x, &alpha, eps).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{rows}×{width}, eps {eps}");
            }
        }
        // A row of zeros (eps alone under the root) and a non-contiguous input.
        let zeros = Tensor::zeros((2, 64), DType::F32, &Device::Cpu).unwrap();
        let alpha = Tensor::ones(64, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(rms_norm(&zeros, &alpha, 1e-6).unwrap().to_vec2::<f32>().unwrap(), vec![vec![0f32; 64]; 2]);
        let wide = Tensor::from_vec((0..4 * 128).map(|_| next()).collect::<Vec<_>>(), (4, 128), &Device::Cpu).unwrap();
        let half = wide.narrow(1, 0, 64).unwrap();
        assert_eq!(
            rms_norm(&half, &alpha, 1e-6).unwrap().to_vec2::<f32>().unwrap(),
            candle_nn::ops::rms_norm(&half.contiguous().unwrap(), &alpha, 1e-6).unwrap().to_vec2::<f32>().unwrap()
        );
    }

    /// Each vector path this CPU has (AVX-512, and AVX2 which AVX-512 machines have too)
    /// gives the scalar formulas' bits, whichever one `gated_mul` takes here.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_vector_path_equals_the_scalar_formulas_bitwise() {
        let mut next = values(11, 40.0);
        let n = 4096 + 5;
        let (mut g, u): (Vec<f32>, Vec<f32>) = ((0..n).map(|_| next()).collect(), (0..n).map(|_| next()).collect());
        g[3] = 95.0;
        g[17] = -100.0;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let silu: Vec<f32> = g.iter().zip(&u).map(|(&v, &w)| silu_mul_scalar(v, w)).collect();
        let gelu: Vec<f32> = g.iter().zip(&u).map(|(&v, &w)| gelu_mul_scalar(v, w)).collect();
        type Path = unsafe fn(&[f32], &[f32], &mut [f32]) -> usize;
        let mut paths: Vec<(&str, Path, Path)> = Vec::new();
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            paths.push(("avx2", x86::silu_mul_avx2, x86::gelu_mul_avx2));
        }
        if is_x86_feature_detected!("avx512f") {
            paths.push(("avx512", x86::silu_mul_avx512, x86::gelu_mul_avx512));
        }
        for (name, silu_path, gelu_path) in paths {
            let mut out = vec![0f32; n];
            // SAFETY: the CPU has the path's features (checked above).
            let done = unsafe { silu_path(&g, &u, &mut out) };
            assert_eq!(done, n / 8 * 8, "{name}");
            assert_eq!(bits(&out[..done]), bits(&silu[..done]), "{name} silu");
            let done = unsafe { gelu_path(&g, &u, &mut out) };
            assert_eq!(bits(&out[..done]), bits(&gelu[..done]), "{name} gelu");
        }
    }

    /// GELU-tanh times up: the vector and scalar paths agree bitwise (whole groups of eight and
    /// the tail), and both are within a few ulps of the formula in f64 (candle's f32
    /// `0.5·v·(1 + tanh(…))` loses digits to cancellation where tanh is near −1).
    #[test]
    fn gelu_mul_agrees_with_the_tanh_formula() {
        let mut next = values(5, 20.0);
        let (rows, width) = (3usize, 2051usize);
        let mut data: Vec<f32> = (0..rows * 2 * width).map(|_| next()).collect();
        data[1] = 120.0;
        data[2] = -130.0;
        let stacked = Tensor::from_vec(data, (rows, 2 * width), &Device::Cpu).unwrap();
        let (gate, up) = (stacked.narrow(1, 0, width).unwrap(), stacked.narrow(1, width, width).unwrap());
        let got = gated_mul(&gate, &up, Activation::GeluTanh).unwrap().to_vec2::<f32>().unwrap();
        let (g, u) = (gate.to_vec2::<f32>().unwrap(), up.to_vec2::<f32>().unwrap());
        for r in 0..rows {
            for c in 0..width {
                assert_eq!(got[r][c].to_bits(), gelu_mul_scalar(g[r][c], u[r][c]).to_bits(), "{r},{c}");
                let (v, w) = (g[r][c] as f64, u[r][c] as f64);
                // 0.5·(1 + tanh(a)) = 1 / (1 + exp(−2a)), which f64 keeps accurate for any a.
                let a = (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v);
                let want = v / (1.0 + (-2.0 * a).exp()) * w;
                // f32 rounding of the exponent grows with it: relative 1e-5 near 0, 1e-4 far out.
                let tol = if v.abs() < 4.0 { 1e-5 } else { 1e-4 };
                assert!(
                    (got[r][c] as f64 - want).abs() <= tol * want.abs() + 1e-30,
                    "{r},{c}: {} vs {want}",
                    got[r][c]
                );
            }
        }
    }

    /// Bit for bit candle's `silu` then `*`, on column slices of one matrix (as the MLP calls
    /// it) and on contiguous tensors, with values far outside the vector exp's range too.
    #[test]
    fn equals_candle_silu_times_up_bitwise() {
        let mut next = values(99, 24.0);
        for (rows, width) in [(1usize, 1536usize), (8, 1536), (3, 4864), (5, 13), (2, 300)] {
            let mut data: Vec<f32> = (0..rows * 2 * width).map(|_| next()).collect();
            data[0] = 95.0;
            data[rows * 2 * width - 1] = -200.0;
            data[3 % (2 * width)] = f32::NAN;
            let stacked = Tensor::from_vec(data, (rows, 2 * width), &Device::Cpu).unwrap();
            let gate = stacked.narrow(1, 0, width).unwrap();
            let up = stacked.narrow(1, width, width).unwrap();
            let want = (gate.silu().unwrap() * &up).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let got = gated_mul(&gate, &up, Activation::Silu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{rows}×{width}, column slices");
            let (gate, up) = (gate.contiguous().unwrap(), up.contiguous().unwrap());
            let got = gated_mul(&gate, &up, Activation::Silu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(bits(&got), bits(&want), "{rows}×{width}, contiguous");
        }
    }
}
