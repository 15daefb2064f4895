//! Matmul weights in the chosen format: the types our own kernels take (`quant_matmul`, where
//! `KernelSettings::packed_kernels_take` says so) on them, everything else on candle's, padded
//! where that unlocks its fast kernels.
//!
//! candle 0.11.1's repacked x86 kernels (one weight read for up to 16 activation rows, VNNI
//! dot products) apply to Q8_0/Q4_K/Q6_K only when the input width is a multiple of 256.
//! SmolLM2's 576 and Qwen2.5-0.5B's 896 are not, so their weights are zero-padded to the next
//! multiple and activations padded to match: ~30% more multiply-adds, 3–9× less time
//! (docs/performance.md).

use super::kernels::{repacked_q8_available, KernelSettings, WeightFormat};
use super::quant_matmul::PackedMatrix;
use super::source::TensorSource;
use anyhow::{Context, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::sync::Arc;

const REPACK_K: usize = 256;

#[derive(Clone)]
enum Weight {
    Candle(QMatMul),
    /// Quantised weights on our own kernels (`quant_matmul`), where the CPU has them.
    Vnni(Arc<PackedMatrix>),
}

#[derive(Clone)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
    in_features: usize,
    /// Input width the weight was padded to, when padded.
    padded_in: Option<usize>,
    /// Whether candle's AMX kernel may take Q4_K batches (`KernelSettings::amx`).
    amx: bool,
}

impl Linear {
    /// Reads `name.weight` (and `name.bias` when `bias`) from the file.
    pub fn load(
        file: &mut dyn TensorSource,
        name: &str,
        bias: bool,
        format: WeightFormat,
        kernels: &KernelSettings,
        device: &Device,
    ) -> Result<Self> {
        let q = Arc::new(file.qtensor(&format!("{name}.weight"), device)?);
        let bias = if bias { Some(file.dense(&format!("{name}.bias"), device)?) } else { None };
        Self::from_qtensor(q, bias, format, kernels, device).with_context(|| format!("loading `{name}.weight`"))
    }

    pub fn from_qtensor(
        q: Arc<QTensor>,
        bias: Option<Tensor>,
        format: WeightFormat,
        kernels: &KernelSettings,
        device: &Device,
    ) -> Result<Self> {
        let (_, in_features) = q.shape().dims2()?;
        let amx = kernels.amx;
        let target = match format {
            WeightFormat::Native => None,
            WeightFormat::F32 => {
                let weight = Weight::Candle(QMatMul::Tensor(q.dequantize(device)?));
                return Ok(Self { weight, bias, in_features, padded_in: None, amx });
            }
            WeightFormat::F16 => {
                let w = q.dequantize(device)?.to_dtype(DType::F16)?;
                let weight = Weight::Candle(QMatMul::TensorF16(w));
                return Ok(Self { weight, bias, in_features, padded_in: None, amx });
            }
            WeightFormat::Q8_0 => Some(GgmlDType::Q8_0),
            WeightFormat::Q4_0 => Some(GgmlDType::Q4_0),
        };
        let out_features = q.shape().dims2()?.0;
        // The file's own Q8_0/Q4_1 tensors (`native`), or anything converted to Q8_0, run on
        // our kernels where the CPU has them.
        let final_type = target.unwrap_or(q.dtype());
        if device.is_cpu() && kernels.packed_kernels_take(final_type, out_features, in_features) {
            let converted = if final_type == q.dtype() {
                q.clone()
            } else {
                Arc::new(QTensor::quantize(&q.dequantize(device)?, final_type)?)
            };
            if let Some(packed) = PackedMatrix::from_qtensor(&converted, kernels.activation_levels, kernels.amx)? {
                return Ok(Self { weight: Weight::Vnni(Arc::new(packed)), bias, in_features, padded_in: None, amx });
            }
        }
        let pad = target == Some(GgmlDType::Q8_0)
            && in_features % REPACK_K != 0
            && device.is_cpu()
            && repacked_q8_available(kernels);
        let weight = match target {
            None => QMatMul::from_arc(q)?,
            Some(t) if t == q.dtype() && !pad => QMatMul::from_arc(q)?,
            Some(t) if in_features % t.block_size() != 0 => QMatMul::from_arc(q)?,
            Some(t) => {
                let mut dense = q.dequantize(device)?;
                if pad {
                    dense = dense.pad_with_zeros(1, 0, in_features.next_multiple_of(REPACK_K) - in_features)?;
                }
                QMatMul::from_arc(Arc::new(QTensor::quantize(&dense, t)?))?
            }
        };
        let padded_in = pad.then(|| in_features.next_multiple_of(REPACK_K));
        Ok(Self { weight: Weight::Candle(weight), bias, in_features, padded_in, amx })
    }

    /// Output rows × input width of the weight as stored (before padding).
    pub fn out_features(&self) -> usize {
        match &self.weight {
            Weight::Candle(QMatMul::QTensor(q)) => q.shape().dims()[0],
            Weight::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => t.dims()[0],
            Weight::Vnni(p) => p.out_features(),
        }
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Whether the matmul runs on quantised (int8) products: our kernels or candle's quantised
    /// ones, not dense f32/f16 weights.
    pub fn runs_int8(&self) -> bool {
        matches!(self.weight, Weight::Vnni(_) | Weight::Candle(QMatMul::QTensor(_)))
    }

    /// `x`: `[rows, in_features]` → `[rows, out_features]`. Each row's result is the same
    /// whatever the number of rows (see [`row_invariant_matmul`]).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match (&self.weight, self.padded_in) {
            (Weight::Vnni(p), _) => {
                let rows = x.dim(0)?;
                let input = x.flatten_all()?.to_vec1::<f32>()?;
                Tensor::from_vec(p.matmul(&input)?, (rows, p.out_features()), x.device())?
            }
            (Weight::Candle(w), Some(p)) => {
                row_invariant_matmul(w, &x.pad_with_zeros(1, 0, p - self.in_features)?, self.amx)?
            }
            (Weight::Candle(w), None) => row_invariant_matmul(w, x, self.amx)?,
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// `weight.forward(x)`, arranged so that a row's output does not depend on how many rows
/// are multiplied together. Lossless speculative decoding needs this: verifying a block of
/// m tokens must give each token exactly the logits a single decode step would, or greedy
/// output can flip at near-ties. candle 0.11.1 picks its x86 kernel by row count, and two of
/// its one-row paths round differently from its batched ones: Q6_K's compact kernel and the
/// dense f32/f16 gemv. So a single row is padded with a zero row for those. Q4_K's AMX path
/// (from 32 rows) needs nothing: it applies the same per-sub-block scale and min updates in
/// the same order as the tile kernel to exact integer sums, so it matches it bit for bit.
/// Checked by `tests/forward_equivalence.rs` (`*_bitwise_*`, blocks of up to 40 rows).
fn row_invariant_matmul(weight: &QMatMul, x: &Tensor, amx: bool) -> Result<Tensor> {
    let rows = x.dim(0)?;
    let dtype = match weight {
        QMatMul::QTensor(q) if cfg!(target_arch = "x86_64") => Some(q.dtype()),
        QMatMul::QTensor(_) => return Ok(weight.forward(x)?),
        QMatMul::Tensor(_) | QMatMul::TensorF16(_) => None, // dense: gemv at one row
    };
    match dtype {
        None | Some(GgmlDType::Q6K) if rows == 1 => {
            let two = x.pad_with_zeros(0, 0, 1)?;
            Ok(weight.forward(&two)?.narrow(0, 0, 1)?)
        }
        Some(GgmlDType::Q4K) if rows >= Q4K_AMX_MIN_ROWS && !amx => {
            // Same results either way (see above); this only trades prefill speed for memory.
            let chunk = (Q4K_AMX_MIN_ROWS - 1) / 4 * 4; // whole 4-row units of the tile kernel
            let parts = (0..rows)
                .step_by(chunk)
                .map(|start| weight.forward(&x.narrow(0, start, chunk.min(rows - start))?))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok(Tensor::cat(&parts, 0)?)
        }
        _ => Ok(weight.forward(x)?),
    }
}

/// Batches of this many rows or more take candle's AMX kernel for Q4_K (where the CPU has it);
/// with `KernelSettings::amx` off they run in chunks below it.
const Q4K_AMX_MIN_ROWS: usize = 32;

/// Several projections of the same input run as one matmul (q/k/v, gate/up): one parallel
/// region and one activation quantisation instead of several. Falls back to separate
/// matmuls when the file stores the parts in different types.
pub struct FusedLinear {
    parts: Vec<Linear>,
    /// Output width of each logical projection.
    widths: Vec<usize>,
}

impl FusedLinear {
    pub fn load(
        file: &mut dyn TensorSource,
        names: &[String],
        bias: bool,
        format: WeightFormat,
        kernels: &KernelSettings,
        device: &Device,
    ) -> Result<Self> {
        let mut qs = Vec::with_capacity(names.len());
        let mut biases = Vec::with_capacity(names.len());
        for name in names {
            qs.push(file.qtensor(&format!("{name}.weight"), device)?);
            biases.push(if bias { Some(file.dense(&format!("{name}.bias"), device)?) } else { None });
        }
        let widths: Vec<usize> = qs.iter().map(|q| q.shape().dims()[0]).collect();
        let k = qs[0].shape().dims2()?.1;
        let same_type = qs.iter().all(|q| q.dtype() == qs[0].dtype() && q.shape().dims2().map(|d| d.1).ok() == Some(k));
        if !same_type {
            let parts = qs
                .into_iter()
                .zip(biases)
                .map(|(q, b)| Linear::from_qtensor(Arc::new(q), b, format, kernels, device))
                .collect::<Result<Vec<_>>>()?;
            return Ok(Self { parts, widths });
        }
        // GGML rows are independent runs of blocks, so stacking the raw bytes stacks the rows.
        let dtype = qs[0].dtype();
        let mut bytes = Vec::new();
        for q in &qs {
            bytes.extend_from_slice(&q.data()?);
        }
        let rows: usize = widths.iter().sum();
        let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), device, dtype)?;
        let stacked = Arc::new(QTensor::new(storage, (rows, k))?);
        let bias = if bias {
            let bs: Vec<Tensor> = biases.into_iter().flatten().collect();
            Some(Tensor::cat(&bs, 0)?)
        } else {
            None
        };
        Ok(Self { parts: vec![Linear::from_qtensor(stacked, bias, format, kernels, device)?], widths })
    }

    /// Output widths of the logical projections.
    pub fn widths(&self) -> &[usize] {
        &self.widths
    }

    pub fn in_features(&self) -> usize {
        self.parts[0].in_features()
    }

    /// Whether every part runs on quantised (int8) products ([`Linear::runs_int8`]).
    pub fn runs_int8(&self) -> bool {
        self.parts.iter().all(Linear::runs_int8)
    }

    /// One output per logical projection, as host rows: `[rows, width]` each, row-major.
    /// Splits the stacked output with plain row copies; candle's copy of each narrowed
    /// view was a measurable part of a decode step.
    pub fn forward_host(&self, x: &Tensor) -> Result<Vec<Vec<f32>>> {
        if self.parts.len() > 1 {
            return self.parts.iter().map(|p| Ok(p.forward(x)?.flatten_all()?.to_vec1::<f32>()?)).collect();
        }
        let y = self.parts[0].forward(x)?.flatten_all()?.to_vec1::<f32>()?;
        let total: usize = self.widths.iter().sum();
        let rows = y.len() / total.max(1);
        let mut out: Vec<Vec<f32>> = self.widths.iter().map(|&w| Vec::with_capacity(rows * w)).collect();
        for row in y.chunks_exact(total.max(1)) {
            let mut start = 0;
            for (part, &w) in out.iter_mut().zip(&self.widths) {
                part.extend_from_slice(&row[start..start + w]);
                start += w;
            }
        }
        Ok(out)
    }

    /// One output per logical projection.
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        if self.parts.len() > 1 {
            return self.parts.iter().map(|p| p.forward(x)).collect();
        }
        let y = self.parts[0].forward(x)?;
        let mut out = Vec::with_capacity(self.widths.len());
        let mut start = 0;
        for &w in &self.widths {
            out.push(y.narrow(1, start, w)?);
            start += w;
        }
        Ok(out)
    }
}
