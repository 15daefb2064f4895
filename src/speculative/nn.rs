//! The building blocks the learned drafters (DFlash, EAGLE-3) share, all differentiable so that
//! one forward serves drafting and training: RMSNorm, NeoX RoPE (Hugging Face's
//! `rotate_half`), softmax (one-pass CPU kernels with their backward written out, in
//! [`super::fused`]), and grouped-query attention over cached keys followed by the rows' own
//! keys.

use anyhow::Result;
use candle_core::{Device, Tensor, D};

pub use super::fused::{matmul_constant_input, matmul_frozen_weight};

/// One attention layer's K and V for a run of rows: `[n_kv_heads, rows, head_dim]` each, K
/// already normed (where the layer norms keys) and rotated at the rows' absolute positions.
#[derive(Clone, Debug)]
pub struct LayerKv {
    pub k: Tensor,
    pub v: Tensor,
}

/// `x * rsqrt(mean(x²) + eps) * w` over the last dimension (f32, as Hugging Face computes it).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    if let Some(fused) = super::fused::rms_norm(x, w, eps) {
        return fused;
    }
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

/// NeoX RoPE on `[heads, rows, head_dim]`: `x·cos + rotate_half(x)·sin`, tables `[rows, head_dim]`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    if let Some(fused) = super::fused::rope(x, cos, sin) {
        return fused;
    }
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
    let probs = softmax_last_dim(&scores)?;
    let mut out = probs.narrow(D::Minus1, m, n)?.matmul(&own.v)?;
    if m > 0 {
        out = (probs.narrow(D::Minus1, 0, m)?.matmul(&past.v)? + out)?;
    }
    // [n_kv, groups·n, d] → [n_heads, n, d] → [n, n_heads·d]
    Ok(out.reshape((n_heads, n, d))?.transpose(0, 1)?.reshape((n, n_heads * d))?)
}

/// Masks for [`block_attention`], additive (0 or −∞): `past` `[n, m]` over the cached rows,
/// `own` `[n, b]` over the rows of each query's own block. None hides nothing.
#[derive(Default, Clone, Copy)]
pub struct BlockMasks<'a> {
    pub past: Option<&'a Tensor>,
    pub own: Option<&'a Tensor>,
}

/// Attention of `blocks` equal blocks of query rows packed in one call: every query sees the
/// `past` rows (`m`, shared by all blocks) and the rows of its own block only. Training packs
/// dozens of blocks into one forward; scoring each row against its own block's `b` keys rather
/// than all `n` rows keeps the score matrices at `m + b` columns instead of `m + n` (the
/// others would be masked out anyway). With one block this is [`attention`].
/// `q` `[n_heads, n, d]`, `own` `[n_kv, n, d]`; returns `[n, n_heads·d]`.
pub fn block_attention(q: &Tensor, past: &LayerKv, own: &LayerKv, blocks: usize, masks: BlockMasks) -> Result<Tensor> {
    let (n_heads, n, d) = q.dims3()?;
    let n_kv = own.k.dim(0)?;
    if blocks == 0 || n % blocks != 0 {
        anyhow::bail!("{n} query rows do not split into {blocks} equal blocks");
    }
    let b = n / blocks;
    let groups = n_heads / n_kv;
    let scale = 1.0 / (d as f64).sqrt();
    let m = past.k.dim(1)?;
    // Heads kv·groups .. kv·groups+groups−1 share KV head kv: fold them into the rows.
    let q = q.reshape((n_kv, groups * n, d))?;
    // Per block: queries [n_kv·blocks, groups·b, d] against that block's keys [n_kv·blocks, b, d].
    let per_block = |t: &Tensor, cols: usize| -> candle_core::Result<Tensor> {
        // [n_kv, groups·n, cols] → [n_kv·blocks, groups·b, cols]
        if blocks == 1 {
            return Ok(t.clone());
        }
        t.reshape((n_kv, groups, blocks, b, cols))?.permute((0, 2, 1, 3, 4))?.reshape((n_kv * blocks, groups * b, cols))
    };
    let from_blocks = |t: &Tensor, cols: usize| -> candle_core::Result<Tensor> {
        if blocks == 1 {
            return Ok(t.clone());
        }
        t.reshape((n_kv, blocks, groups, b, cols))?.permute((0, 2, 1, 3, 4))?.reshape((n_kv, groups * n, cols))
    };
    let own_k = own.k.reshape((n_kv * blocks, b, d))?;
    let own_v = own.v.reshape((n_kv * blocks, b, d))?;
    let own_scores = from_blocks(&(per_block(&q, d)?.matmul(&own_k.t()?)? * scale)?, b)?;
    let add_mask = |scores: Tensor, mask: Option<&Tensor>, cols: usize| -> candle_core::Result<Tensor> {
        match mask {
            Some(mask) => {
                scores.reshape((n_kv, groups, n, cols))?.broadcast_add(mask)?.reshape((n_kv, groups * n, cols))
            }
            None => Ok(scores),
        }
    };
    let own_scores = add_mask(own_scores, masks.own, b)?;
    let scores = if m > 0 {
        let past_scores = add_mask((q.matmul(&past.k.t()?)? * scale)?, masks.past, m)?;
        Tensor::cat(&[&past_scores, &own_scores], D::Minus1)?
    } else {
        own_scores
    };
    let probs = softmax_last_dim(&scores)?;
    let own_probs = per_block(&probs.narrow(D::Minus1, m, b)?, b)?;
    let mut out = from_blocks(&own_probs.matmul(&own_v)?, d)?;
    if m > 0 {
        out = (probs.narrow(D::Minus1, 0, m)?.matmul(&past.v)? + out)?;
    }
    // [n_kv, groups·n, d] → [n_heads, n, d] → [n, n_heads·d]
    Ok(out.reshape((n_heads, n, d))?.transpose(0, 1)?.reshape((n, n_heads * d))?)
}

/// Attention of one unrolled step of EAGLE-3's training-time test: query i sees the `context`
/// rows `context_mask` (`[n, m]`, additive) leaves visible, and row i of every earlier step's
/// K/V (`earlier`, `[n_kv, n, d]` each) and of its own (`own`). Those are the only step keys
/// it may see, so they are scored row by row (`n·steps` scores) rather than against all
/// `n·steps` step rows with a mask. `q` `[n_heads, n, d]`; returns `[n, n_heads·d]`.
pub fn unrolled_attention(
    q: &Tensor,
    context: &LayerKv,
    context_mask: &Tensor,
    earlier: &[LayerKv],
    own: &LayerKv,
) -> Result<Tensor> {
    let (n_heads, n, d) = q.dims3()?;
    let n_kv = own.k.dim(0)?;
    let groups = n_heads / n_kv;
    let scale = 1.0 / (d as f64).sqrt();
    let m = context.k.dim(1)?;
    // Step keys and values [n_kv, 1, n, steps, d] (a singleton for the query groups).
    let stack = |part: fn(&LayerKv) -> &Tensor| -> candle_core::Result<Tensor> {
        let parts: Vec<&Tensor> = earlier.iter().chain(std::iter::once(own)).map(part).collect();
        Tensor::stack(&parts, 2)?.unsqueeze(1)
    };
    let (step_k, step_v) = (stack(|kv| &kv.k)?, stack(|kv| &kv.v)?);
    let steps = earlier.len() + 1;
    let q4 = q.reshape((n_kv, groups, n, d))?;
    let step_scores = (q4.unsqueeze(3)?.broadcast_mul(&step_k)?.sum(D::Minus1)? * scale)?; // [n_kv, groups, n, steps]
    let scores = if m > 0 {
        let ctx = (q.reshape((n_kv, groups * n, d))?.matmul(&context.k.t()?)? * scale)?;
        let ctx = ctx.reshape((n_kv, groups, n, m))?.broadcast_add(context_mask)?;
        Tensor::cat(&[&ctx, &step_scores], D::Minus1)?
    } else {
        step_scores
    };
    let probs = softmax_last_dim(&scores)?;
    let step_probs = probs.narrow(D::Minus1, m, steps)?.unsqueeze(D::Minus1)?; // [n_kv, groups, n, steps, 1]
    let mut out = step_probs.broadcast_mul(&step_v)?.sum(3)?; // [n_kv, groups, n, d]
    if m > 0 {
        let ctx_probs = probs.narrow(D::Minus1, 0, m)?.reshape((n_kv, groups * n, m))?;
        out = (ctx_probs.matmul(&context.v)?.reshape((n_kv, groups, n, d))? + out)?;
    }
    Ok(out.reshape((n_heads, n, d))?.transpose(0, 1)?.reshape((n, n_heads * d))?)
}

/// Softmax over the last dimension.
pub fn softmax_last_dim(x: &Tensor) -> candle_core::Result<Tensor> {
    match super::fused::softmax_last_dim(x) {
        Some(fused) => fused,
        None => candle_nn::ops::softmax(x, D::Minus1),
    }
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

    /// The projection of an input that takes no gradient (the target's features): training
    /// then forms the weight's gradient only.
    pub fn forward_constant_input(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Projection::Exact(l) => {
                let y = matmul_constant_input(x, l.weight())?;
                Ok(match l.bias() {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            }
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A reproducible tensor of uniform values in [−1, 1) (xorshift).
    pub(crate) fn random(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let values: Vec<f32> = (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    /// Packed blocks give what [`attention`] gives with the dense mask that hides every other
    /// block's rows, for grouped heads, a context mask, an own-block mask and no context at all.
    #[test]
    fn block_attention_equals_attention_with_a_block_diagonal_mask() {
        let (n_heads, n_kv, d, blocks, b) = (6, 2, 8, 3, 4);
        let n = blocks * b;
        for m in [0usize, 5] {
            let q = random(&[n_heads, n, d], 1);
            let past = LayerKv { k: random(&[n_kv, m, d], 2), v: random(&[n_kv, m, d], 3) };
            let own = LayerKv { k: random(&[n_kv, n, d], 4), v: random(&[n_kv, n, d], 5) };
            // Row r sees context rows < 1 + r % (m + 1) and, in its block, keys up to itself.
            let past_mask: Vec<f32> = (0..n)
                .flat_map(|r| (0..m).map(move |k| if k < 1 + r % (m + 1) { 0.0 } else { f32::NEG_INFINITY }))
                .collect();
            let own_mask: Vec<f32> =
                (0..n).flat_map(|r| (0..b).map(move |k| if k <= r % b { 0.0 } else { f32::NEG_INFINITY })).collect();
            let dense: Vec<f32> = (0..n)
                .flat_map(|r| {
                    let (past_mask, own_mask) = (&past_mask, &own_mask);
                    (0..m + n).map(move |k| match k.checked_sub(m) {
                        None => past_mask[r * m + k],
                        Some(j) if j / b == r / b => own_mask[r * b + j % b],
                        Some(_) => f32::NEG_INFINITY,
                    })
                })
                .collect();
            let past_mask = Tensor::from_vec(past_mask, (n, m), &Device::Cpu).unwrap();
            let own_mask = Tensor::from_vec(own_mask, (n, b), &Device::Cpu).unwrap();
            let dense = Tensor::from_vec(dense, (n, m + n), &Device::Cpu).unwrap();
            let expected: Vec<Vec<f32>> = attention(&q, &past, &own, Some(&dense)).unwrap().to_vec2().unwrap();
            let masks = BlockMasks { past: (m > 0).then_some(&past_mask), own: Some(&own_mask) };
            let packed: Vec<Vec<f32>> = block_attention(&q, &past, &own, blocks, masks).unwrap().to_vec2().unwrap();
            for (e, p) in expected.iter().flatten().zip(packed.iter().flatten()) {
                assert!((e - p).abs() < 1e-6, "m = {m}: {e} vs {p}");
            }
            assert!(block_attention(&q, &past, &own, 5, BlockMasks::default()).is_err(), "12 rows in 5 blocks");
        }
    }

    /// An unrolled step gives what [`attention`] gives over the context and all step rows
    /// concatenated, with the mask that leaves each query its own row of every step.
    #[test]
    fn unrolled_attention_equals_attention_over_every_step_with_a_diagonal_mask() {
        let (n_heads, n_kv, d, n, m) = (6, 2, 8, 5, 7);
        let q = random(&[n_heads, n, d], 11);
        let context = LayerKv { k: random(&[n_kv, m, d], 12), v: random(&[n_kv, m, d], 13) };
        let steps: Vec<LayerKv> =
            (0..3).map(|s| LayerKv { k: random(&[n_kv, n, d], 20 + s), v: random(&[n_kv, n, d], 30 + s) }).collect();
        let (earlier, own) = steps.split_at(2);
        // Query i sees context rows ..= i + 1.
        let context_mask: Vec<f32> =
            (0..n).flat_map(|i| (0..m).map(move |k| if k <= i + 1 { 0.0 } else { f32::NEG_INFINITY })).collect();
        let width = m + 2 * n;
        let dense: Vec<f32> = (0..n)
            .flat_map(|i| {
                let context_mask = &context_mask;
                (0..width + n).map(move |k| match k.checked_sub(m) {
                    None => context_mask[i * m + k],
                    Some(j) if j % n == i => 0.0,
                    Some(_) => f32::NEG_INFINITY,
                })
            })
            .collect();
        let past = LayerKv {
            k: Tensor::cat(&[&context.k, &earlier[0].k, &earlier[1].k], 1).unwrap(),
            v: Tensor::cat(&[&context.v, &earlier[0].v, &earlier[1].v], 1).unwrap(),
        };
        let dense = Tensor::from_vec(dense, (n, width + n), &Device::Cpu).unwrap();
        let expected: Vec<Vec<f32>> = attention(&q, &past, &own[0], Some(&dense)).unwrap().to_vec2().unwrap();
        let context_mask = Tensor::from_vec(context_mask, (n, m), &Device::Cpu).unwrap();
        let unrolled: Vec<Vec<f32>> =
            unrolled_attention(&q, &context, &context_mask, earlier, &own[0]).unwrap().to_vec2().unwrap();
        for (e, u) in expected.iter().flatten().zip(unrolled.iter().flatten()) {
            assert!((e - u).abs() < 1e-6, "{e} vs {u}");
        }
    }
}
