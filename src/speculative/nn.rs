//! The building blocks the learned drafters (DFlash, EAGLE-3) share, written with plain
//! differentiable candle ops so that one forward serves drafting and training: RMSNorm, NeoX
//! RoPE (Hugging Face's `rotate_half`), and grouped-query attention over cached keys followed
//! by the rows' own keys.

use anyhow::Result;
use candle_core::{Device, Tensor, D};

/// One attention layer's K and V for a run of rows: `[n_kv_heads, rows, head_dim]` each, K
/// already normed (where the layer norms keys) and rotated at the rows' absolute positions.
#[derive(Clone, Debug)]
pub struct LayerKv {
    pub k: Tensor,
    pub v: Tensor,
}

/// `x * rsqrt(mean(x²) + eps) * w` over the last dimension (f32, as Hugging Face computes it).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

/// NeoX RoPE on `[heads, rows, head_dim]`: `x·cos + rotate_half(x)·sin`, tables `[rows, head_dim]`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

/// RoPE inverse frequencies, computed in f32 as Hugging Face's rotary embeddings do.
#[derive(Clone, Debug)]
pub struct RopeTable {
    inv_freq: Vec<f32>,
}

impl RopeTable {
    pub fn new(head_dim: usize, theta: f64) -> Self {
        let inv_freq =
            (0..head_dim / 2).map(|j| 1.0f32 / (theta as f32).powf((2 * j) as f32 / head_dim as f32)).collect();
        Self { inv_freq }
    }

    /// The inverse frequency of each rotated pair (θᵢ), fastest first.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// cos and sin tables `[rows, head_dim]` for absolute positions (f32 angles, as HF).
    pub fn tables(&self, positions: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
        let d = 2 * self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(positions.len() * d), Vec::with_capacity(positions.len() * d));
        for &p in positions {
            let angles: Vec<f32> = self.inv_freq.iter().map(|f| p as f32 * f).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| (*a as f64).cos() as f32));
                sin.extend(angles.iter().map(|a| (*a as f64).sin() as f32));
            }
        }
        let shape = (positions.len(), d);
        Ok((Tensor::from_vec(cos, shape, device)?, Tensor::from_vec(sin, shape, device)?))
    }
}

/// Grouped-query attention of queries `q` `[n_heads, n, d]` over `past` K/V (`m` rows)
/// followed by the queries' own K/V (`n` rows). The two key runs are scored separately and
/// share one softmax, so a long cache is never copied. Query head j uses KV head
/// j / (n_heads / n_kv_heads), as Hugging Face's `repeat_kv`. `mask` (`[n, m + n]`, additive:
/// 0 or −∞) hides keys; None sees every key. Returns `[n, n_heads·d]`.
pub fn attention(q: &Tensor, past: &LayerKv, own: &LayerKv, mask: Option<&Tensor>) -> Result<Tensor> {
    let (n_heads, n, d) = q.dims3()?;
    let n_kv = own.k.dim(0)?;
    let groups = n_heads / n_kv;
    let scale = 1.0 / (d as f64).sqrt();
    // Heads kv·groups .. kv·groups+groups−1 share KV head kv: fold them into the rows.
    let q = q.reshape((n_kv, groups * n, d))?;
    let m = past.k.dim(1)?;
    let own_scores = (q.matmul(&own.k.t()?)? * scale)?;
    let scores =
        if m > 0 { Tensor::cat(&[&(q.matmul(&past.k.t()?)? * scale)?, &own_scores], D::Minus1)? } else { own_scores };
    let scores = match mask {
        Some(mask) => {
            scores.reshape((n_kv, groups, n, m + n))?.broadcast_add(mask)?.reshape((n_kv, groups * n, m + n))?
        }
        None => scores,
    };
    let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
    let mut out = probs.narrow(D::Minus1, m, n)?.matmul(&own.v)?;
    if m > 0 {
        out = (probs.narrow(D::Minus1, 0, m)?.matmul(&past.v)? + out)?;
    }
    // [n_kv, groups·n, d] → [n_heads, n, d] → [n, n_heads·d]
    Ok(out.reshape((n_heads, n, d))?.transpose(0, 1)?.reshape((n, n_heads * d))?)
}

/// A growable `[n_kv, capacity, head_dim]` buffer holding a window of rows `start..start+len`,
/// appended to in place; rows dropped at the front are reclaimed when it next grows.
#[derive(Default)]
pub struct RowBuffer {
    data: Option<Tensor>,
    start: usize,
    len: usize,
}

impl RowBuffer {
    /// The whole backing buffer, once anything was stored.
    pub fn data(&self) -> Option<&Tensor> {
        self.data.as_ref()
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.data.as_ref().map_or(0, |t| t.dims()[1])
    }

    pub fn append(&mut self, rows: &Tensor) -> Result<()> {
        let n = rows.dim(1)?;
        if n == 0 {
            return Ok(());
        }
        if self.start + self.len + n > self.capacity() {
            let (heads, _, d) = rows.dims3()?;
            let cap = (2 * (self.len + n)).max(64);
            let fresh = Tensor::zeros((heads, cap, d), rows.dtype(), rows.device())?;
            if self.len > 0 {
                fresh.slice_set(&self.view(rows)?.contiguous()?, 1, 0)?;
            }
            self.data = Some(fresh);
            self.start = 0;
        }
        let data = self.data.as_ref().expect("allocated above");
        data.slice_set(&rows.contiguous()?, 1, self.start + self.len)?;
        self.len += n;
        Ok(())
    }

    /// The live rows; `like` gives shape and type when nothing was ever stored.
    pub fn view(&self, like: &Tensor) -> Result<Tensor> {
        Ok(match &self.data {
            Some(t) => t.narrow(1, self.start, self.len)?,
            None => {
                let (heads, _, d) = like.dims3()?;
                Tensor::zeros((heads, 0, d), like.dtype(), like.device())?
            }
        })
    }

    pub fn keep_last(&mut self, n: usize) {
        if self.len > n {
            self.start += self.len - n;
            self.len = n;
        }
    }

    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }
}

/// A drafter's projection: exact f32 (loading, training, the reference checks), or converted to
/// 8-bit weights on the engine's own kernels for drafting, where a draft is a few rows and f32
/// matrix-vector products cost about as much as the target's whole step.
pub enum Projection {
    Exact(candle_nn::Linear),
    Served(crate::model::Linear),
}

impl Projection {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Projection::Exact(l) => Ok(candle_core::Module::forward(l, x)?),
            Projection::Served(l) => l.forward(x),
        }
    }

    /// Converts an exact projection to Q8_0 on the engine's kernels (the draft changes
    /// slightly; verification keeps the output exact). A bias stays f32.
    pub fn serve(&mut self, kernels: &crate::model::KernelSettings, device: &Device) -> Result<()> {
        use candle_core::quantized::{GgmlDType, QTensor};
        if let Projection::Exact(l) = self {
            let q = QTensor::quantize(l.weight(), GgmlDType::F32)?;
            let linear = crate::model::Linear::from_qtensor(
                std::sync::Arc::new(q),
                l.bias().cloned(),
                crate::model::WeightFormat::Q8_0,
                kernels,
                device,
            )?;
            *self = Projection::Served(linear);
        }
        Ok(())
    }
}
