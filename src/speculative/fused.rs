//! One-pass CPU kernels for the learned drafters' building blocks (RMSNorm, NeoX RoPE, softmax
//! over the last dimension), each a candle custom op with its backward written out, so the same
//! op serves drafting and training. Composed from candle's elementwise ops, each of these is
//! five to seven passes with a fresh allocation each; a draft of a few rows is mostly that
//! per-op overhead. Other devices and dtypes take the composed path
//! ([`super::nn`]), and the backward passes are composed ops on every device, on detached
//! inputs: gradients carry no graph of their own (an optimiser's moments built from them would
//! otherwise keep every step's graph alive).

use crate::parallel::SyncPtr;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Shape, Tensor, D};

/// Elements below which a kernel runs on the calling thread: waking candle's pool costs more
/// than a draft's few rows (a drafting step has dozens of these ops), while a training batch's
/// tensors are far larger.
const MIN_PARALLEL: usize = 1 << 16;

/// Runs `f(first_row, rows_in, rows_out)` over chunks of `width`-wide rows, on candle's pool
/// (chunks of about a quarter of [`MIN_PARALLEL`] elements) when there are many.
fn for_row_chunks(input: &[f32], out: &mut [f32], width: usize, f: impl Fn(usize, &[f32], &mut [f32]) + Sync) {
    let rows = input.len() / width.max(1);
    let rows_per_task = (MIN_PARALLEL / 4 / width.max(1)).max(1);
    let tasks = rows.div_ceil(rows_per_task);
    if input.len() < MIN_PARALLEL || tasks <= 1 {
        f(0, input, out);
        return;
    }
    let out_ptr = SyncPtr(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(tasks, |items| {
        // Captures the whole `SyncPtr` (a closure would otherwise capture its raw field).
        #[allow(clippy::redundant_locals)]
        let out_ptr = out_ptr;
        for t in items {
            let (lo, hi) = (t * rows_per_task, rows.min((t + 1) * rows_per_task));
            // SAFETY: tasks cover disjoint row ranges of `out`.
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(lo * width), (hi - lo) * width) };
            f(lo, &input[lo * width..hi * width], dst);
        }
    });
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    let Some((lo, hi)) = l.contiguous_offsets() else {
        candle_core::bail!("{what}: the input must be contiguous");
    };
    Ok(&s.as_slice::<f32>()?[lo..hi])
}

/// `x / sqrt(mean(x²) + eps) * w` over the last dimension.
struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "drafter-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w) = (f32_slice(xs, xl, "rms_norm")?, f32_slice(ws, wl, "rms_norm")?);
        let width = w.len();
        if xl.dims().last() != Some(&width) {
            candle_core::bail!("rms_norm: {width} weights for rows of {:?}", xl.dims());
        }
        let mut out = vec![0f32; x.len()];
        let eps = self.eps;
        for_row_chunks(x, &mut out, width, |_, x, out| {
            for (row, dst) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
                let ms = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                for ((d, &v), &a) in dst.iter_mut().zip(row).zip(w) {
                    *d = v * inv * a;
                }
            }
        });
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (x, w, g) = (&x.detach(), &w.detach(), &g.detach());
        // y = x·r·w, r = (mean(x²) + eps)^(−1/2):
        // dx = r·(g·w) − x·r³·mean(g·w·x),  dw = Σ_rows g·x·r.
        let r = (x.sqr()?.mean_keepdim(D::Minus1)? + self.eps as f64)?.sqrt()?.recip()?;
        let gw = g.broadcast_mul(w)?;
        let dot = (&gw * x)?.mean_keepdim(D::Minus1)?;
        let dx = (gw.broadcast_mul(&r)? - x.broadcast_mul(&(r.powf(3.0)? * dot)?)?)?;
        let width = w.dim(0)?;
        let dw = (g * x.broadcast_mul(&r)?)?.reshape(((), width))?.sum(0)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// NeoX RoPE of `x` `[…, rows, d]` with tables `[rows, d]`: `x·cos + rotate_half(x)·sin`,
/// `rotate_half([a, b]) = [−b, a]`.
struct Rope;

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "drafter-rope"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, cos, sin) = (f32_slice(xs, xl, "rope")?, f32_slice(cs, cl, "rope")?, f32_slice(ss, sl, "rope")?);
        let dims = xl.dims();
        let (rows, d) = match dims {
            [.., rows, d] => (*rows, *d),
            _ => candle_core::bail!("rope: input of shape {dims:?}"),
        };
        if cl.dims() != [rows, d] || sl.dims() != [rows, d] || d % 2 != 0 {
            candle_core::bail!("rope: tables {:?}/{:?} for input {dims:?}", cl.dims(), sl.dims());
        }
        let half = d / 2;
        let mut out = vec![0f32; x.len()];
        for_row_chunks(x, &mut out, d, |first, x, out| {
            for (i, (src, dst)) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
                let r = (first + i) % rows;
                let (c, s) = (&cos[r * d..(r + 1) * d], &sin[r * d..(r + 1) * d]);
                for j in 0..half {
                    dst[j] = src[j] * c[j] - src[j + half] * s[j];
                    dst[j + half] = src[j + half] * c[j + half] + src[j] * s[j + half];
                }
            }
        });
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (cos, sin, g) = (&cos.detach(), &sin.detach(), &g.detach());
        // Linear in x: dx = g·cos + rotate_halfᵀ(g·sin), rotate_halfᵀ([a, b]) = [b, −a].
        let gs = g.broadcast_mul(sin)?;
        let half = gs.dim(D::Minus1)? / 2;
        let rotated =
            Tensor::cat(&[&gs.narrow(D::Minus1, half, half)?, &gs.narrow(D::Minus1, 0, half)?.neg()?], D::Minus1)?;
        Ok((Some((g.broadcast_mul(cos)? + rotated)?), None, None))
    }
}

/// Softmax over the last dimension (max-shifted).
struct Softmax;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "drafter-softmax"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(xs, xl, "softmax")?;
        let width = *xl.dims().last().unwrap_or(&1);
        let mut out = vec![0f32; x.len()];
        if width > 0 {
            for_row_chunks(x, &mut out, width, |_, x, out| {
                for (row, dst) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for (d, &v) in dst.iter_mut().zip(row) {
                        *d = (v - max).exp();
                        sum += *d;
                    }
                    for d in dst.iter_mut() {
                        *d /= sum;
                    }
                }
            });
        }
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (y, g) = (&y.detach(), &g.detach());
        // dx = y·(g − Σ g·y)
        let dot = (g * y)?.sum_keepdim(D::Minus1)?;
        Ok(Some((y * g.broadcast_sub(&dot)?)?))
    }
}

/// `x · wᵀ` (`x` `[rows, in]`, `w` `[out, in]`) where one operand is fixed and takes no
/// gradient; the op's argument is the other one, and the backward gives its gradient only.
/// candle's matmul backward forms both operands' gradients, and the unused one is a product as
/// large as the forward (the target's frozen LM head; the target's features into `fc`).
struct OneSidedMatmul {
    fixed: Tensor,
    /// Whether the argument is `w` (the fixed operand is `x`) rather than `x`.
    argument_is_weight: bool,
}

impl CustomOp1 for OneSidedMatmul {
    fn name(&self) -> &'static str {
        "one-sided-matmul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let arg = Tensor::from_slice(f32_slice(s, l, "one_sided_matmul")?, l.shape(), &Device::Cpu)?;
        let y = if self.argument_is_weight { self.fixed.matmul(&arg.t()?)? } else { arg.matmul(&self.fixed.t()?)? };
        Ok((CpuStorage::F32(y.flatten_all()?.to_vec1()?), y.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = g.detach();
        // dx = g·w, dw = gᵀ·x
        Ok(Some(if self.argument_is_weight { g.t()?.matmul(&self.fixed)? } else { g.matmul(&self.fixed)? }))
    }
}

fn fused_ok(tensors: &[&Tensor]) -> bool {
    tensors.iter().all(|t| t.device().is_cpu() && t.dtype() == DType::F32)
}

/// RMSNorm over the last dimension; None when the inputs are not f32 on the CPU.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Option<candle_core::Result<Tensor>> {
    fused_ok(&[x, w]).then(|| x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps: eps as f32 }))
}

/// NeoX RoPE; None when the inputs are not f32 on the CPU.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Option<candle_core::Result<Tensor>> {
    fused_ok(&[x, cos, sin]).then(|| x.contiguous()?.apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rope))
}

/// Softmax over the last dimension; None when the input is not f32 on the CPU.
pub fn softmax_last_dim(x: &Tensor) -> Option<candle_core::Result<Tensor>> {
    fused_ok(&[x]).then(|| x.contiguous()?.apply_op1(Softmax))
}

/// `x · wᵀ` (`x` `[rows, in]`, `w` `[out, in]`) where `w` takes no gradient: the target's frozen
/// LM head under a drafter's hidden states. Other devices and shapes take candle's matmul.
pub fn matmul_frozen_weight(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let w = w.detach();
    if fused_ok(&[x, &w]) && x.rank() == 2 && w.rank() == 2 {
        return x.contiguous()?.apply_op1(OneSidedMatmul { fixed: w.contiguous()?, argument_is_weight: false });
    }
    x.matmul(&w.t()?)
}

/// `x · wᵀ` (`x` `[rows, in]`, `w` `[out, in]`) where `x` takes no gradient: the target's
/// features into a drafter's fusion layer. Other devices and shapes take candle's matmul.
pub fn matmul_constant_input(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let x = x.detach();
    if fused_ok(&[&x, w]) && x.rank() == 2 && w.rank() == 2 {
        return w.contiguous()?.apply_op1(OneSidedMatmul { fixed: x.contiguous()?, argument_is_weight: true });
    }
    x.matmul(&w.t()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::nn::tests::random;
    use candle_core::{Device, Var};

    fn close(a: &Tensor, b: &Tensor, tol: f32, what: &str) {
        let (a, b): (Vec<f32>, Vec<f32>) =
            (a.flatten_all().unwrap().to_vec1().unwrap(), b.flatten_all().unwrap().to_vec1().unwrap());
        assert_eq!(a.len(), b.len(), "{what}");
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{what}: {x} vs {y}");
        }
    }

    /// Each fused op's value and gradients equal those of the same function composed from
    /// candle's differentiable ops (their backward is candle's own), on inputs whose rows span
    /// several of the pool's tasks.
    #[test]
    fn fused_ops_match_composed_ops_in_value_and_gradient() {
        let (heads, rows, d) = (3, 1400, 16); // 67,200 elements: past MIN_PARALLEL, on the pool
        let x = Var::from_tensor(&random(&[heads, rows, d], 1)).unwrap();
        let w = Var::from_tensor(&(random(&[d], 2) + 1.5).unwrap()).unwrap();
        let probe = random(&[heads, rows, d], 3);

        // RMSNorm
        let composed = {
            let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            x.broadcast_div(&(ms + 1e-6).unwrap().sqrt().unwrap()).unwrap().broadcast_mul(&w).unwrap()
        };
        let fused = rms_norm(&x, &w, 1e-6).unwrap().unwrap();
        close(&fused, &composed, 1e-6, "rms_norm value");
        let gc = (composed * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let gf = (fused * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        close(gf.get(&x).unwrap(), gc.get(&x).unwrap(), 1e-5, "rms_norm dx");
        close(gf.get(&w).unwrap(), gc.get(&w).unwrap(), 1e-4, "rms_norm dw");

        // RoPE
        let angles: Vec<f32> = (0..rows * d).map(|i| (i / d) as f32 * 0.1 * (1 + i % (d / 2)) as f32).collect();
        let angles = Tensor::from_vec(angles, (rows, d), &Device::Cpu).unwrap();
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let composed = {
            let x1 = x.narrow(D::Minus1, 0, d / 2).unwrap();
            let x2 = x.narrow(D::Minus1, d / 2, d / 2).unwrap();
            let rotated = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
            (x.broadcast_mul(&cos).unwrap() + rotated.broadcast_mul(&sin).unwrap()).unwrap()
        };
        let fused = rope(&x, &cos, &sin).unwrap().unwrap();
        close(&fused, &composed, 1e-6, "rope value");
        let gc = (composed * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let gf = (fused * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        close(gf.get(&x).unwrap(), gc.get(&x).unwrap(), 1e-5, "rope dx");

        // Softmax, with a row that is −∞ but for one entry.
        let mask: Vec<f32> =
            (0..rows * d).map(|i| if i / d == 7 && i % d != 3 { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (rows, d), &Device::Cpu).unwrap();
        let scores = x.broadcast_add(&mask).unwrap();
        let composed = candle_nn::ops::softmax(&scores, D::Minus1).unwrap();
        let fused = softmax_last_dim(&scores).unwrap().unwrap();
        close(&fused, &composed, 1e-6, "softmax value");
        let gc = (composed * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let gf = (fused * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        close(gf.get(&x).unwrap(), gc.get(&x).unwrap(), 1e-5, "softmax dx");
    }

    /// The one-sided products give the values and the one gradient that candle's matmul gives,
    /// and no gradient for the operand that takes none.
    #[test]
    fn one_sided_matmuls_match_candles_matmul() {
        let (rows, inner, out) = (37, 48, 80);
        let x = Var::from_tensor(&random(&[rows, inner], 4)).unwrap();
        let w = Var::from_tensor(&random(&[out, inner], 5)).unwrap();
        let probe = random(&[rows, out], 6);
        let composed = x.matmul(&w.t().unwrap()).unwrap();
        let gc = (&composed * &probe).unwrap().sum_all().unwrap().backward().unwrap();

        let frozen_w = matmul_frozen_weight(&x, &w).unwrap();
        close(&frozen_w, &composed, 1e-6, "frozen weight value");
        let g = (frozen_w * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        close(g.get(&x).unwrap(), gc.get(&x).unwrap(), 1e-5, "frozen weight dx");
        assert!(g.get(&w).is_none(), "a frozen weight takes no gradient");

        let constant_x = matmul_constant_input(&x, &w).unwrap();
        close(&constant_x, &composed, 1e-6, "constant input value");
        let g = (constant_x * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        close(g.get(&w).unwrap(), gc.get(&w).unwrap(), 1e-5, "constant input dw");
        assert!(g.get(&x).is_none(), "a constant input takes no gradient");
    }
}
