//! The EAGLE-3 drafter network: one Llama decoder layer whose attention reads the token
//! embedding concatenated with a feature vector (`2H` wide), its own LM head over a draft
//! vocabulary, and `fc`, which fuses three target hidden states into the first feature.
//!
//! One pass ([`Eagle3Drafter::forward`]) over rows `(embedding of token t+1, feature of row t)`
//! at position t returns the rows' outputs and their K/V. The first pass of a draft uses target
//! features (`fc` of the taps, after speculators' optional `input_norm` / `fc_norm`); every
//! later one feeds the previous pass's output back as the feature: the pre-norm state, or the
//! final-normed one with speculators' `norm_output`. Written with plain differentiable candle
//! ops so the same code serves drafting and training (training-time test unrolls it).

use super::config::{Eagle3Config, N_TAPS};
use crate::model::KernelSettings;
use crate::speculative::dflash::TargetHead;
use crate::speculative::nn::{attention, rms_norm, rope, unrolled_attention, LayerKv, Projection, RopeTable};
use anyhow::{bail, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use candle_nn::Linear;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Every weight a checkpoint must hold, by its SpecForge name, with its `[out, in]` shape.
/// `embed_tokens.weight` (`[vocab, hidden]`) is optional and `d2t` is read separately.
pub fn expected_tensors(c: &Eagle3Config) -> Vec<(String, Vec<usize>)> {
    let (h, q, kv) = (c.hidden, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let mut t: Vec<(String, Vec<usize>)> = vec![
        ("fc.weight".into(), vec![h, N_TAPS * c.target_hidden]),
        ("norm.weight".into(), vec![h]),
        ("lm_head.weight".into(), vec![c.draft_vocab, h]),
    ];
    if c.norm_before_fc {
        t.push(("input_norm.weight".into(), vec![N_TAPS * c.target_hidden]));
    }
    if c.fc_norm {
        for i in 0..N_TAPS {
            t.push((format!("fc_norm.{i}.weight"), vec![c.target_hidden]));
        }
    }
    for (name, shape) in [
        ("input_layernorm.weight", vec![h]),
        ("hidden_norm.weight", vec![h]),
        ("post_attention_layernorm.weight", vec![h]),
        ("self_attn.q_proj.weight", vec![q, 2 * h]),
        ("self_attn.k_proj.weight", vec![kv, 2 * h]),
        ("self_attn.v_proj.weight", vec![kv, 2 * h]),
        ("self_attn.o_proj.weight", vec![h, q]),
        ("mlp.gate_proj.weight", vec![c.ffn, h]),
        ("mlp.up_proj.weight", vec![c.ffn, h]),
        ("mlp.down_proj.weight", vec![h, c.ffn]),
    ] {
        t.push((format!("midlayer.{name}"), shape));
    }
    t
}

pub struct Eagle3Drafter {
    pub config: Eagle3Config,
    pub path: PathBuf,
    fc: Projection,
    /// speculators' `norm_before_fc`: an RMSNorm over the concatenated taps.
    fc_input_norm: Option<Tensor>,
    /// speculators' `fc_norm`: an RMSNorm per tap.
    fc_norms: Vec<Tensor>,
    input_norm: Tensor,
    hidden_norm: Tensor,
    post_norm: Tensor,
    q_proj: Projection,
    k_proj: Projection,
    v_proj: Projection,
    o_proj: Projection,
    gate_proj: Projection,
    up_proj: Projection,
    down_proj: Projection,
    norm: Tensor,
    lm_head: Projection,
    /// The drafter's own token embedding; None: it uses its target's.
    embed: Option<Tensor>,
    /// Target id of each draft-vocabulary entry.
    draft_to_target: Vec<u32>,
    rope: RopeTable,
    device: Device,
}

impl Eagle3Drafter {
    /// Loads a drafter directory (see [`read_checkpoint`]).
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let mut c = read_checkpoint(dir, device)?;
        let get = |name: &str, _shape: &[usize]| -> Result<Tensor> {
            c.tensors.get(name).cloned().with_context(|| format!("tensor `{name}` was not read"))
        };
        let mut drafter = Self::from_tensors(c.config.clone(), std::mem::take(&mut c.draft_to_target), get, device)?;
        drafter.embed = c.embed;
        drafter.path = dir.to_path_buf();
        Ok(drafter)
    }

    /// Builds the network from any weight source (a checkpoint, or trainable variables), each
    /// tensor asked for by its SpecForge name and shape. Without an embedding of its own the
    /// drafter embeds tokens with its target's.
    pub fn from_tensors(
        config: Eagle3Config,
        draft_to_target: Vec<u32>,
        get: impl Fn(&str, &[usize]) -> Result<Tensor>,
        device: &Device,
    ) -> Result<Self> {
        if draft_to_target.len() != config.draft_vocab {
            bail!("{} draft-vocabulary ids for a draft vocabulary of {}", draft_to_target.len(), config.draft_vocab);
        }
        let shapes: HashMap<String, Vec<usize>> = expected_tensors(&config).into_iter().collect();
        let w = |name: &str| -> Result<Tensor> {
            let shape = shapes.get(name).with_context(|| format!("unknown tensor `{name}`"))?;
            let t = get(name, shape).with_context(|| format!("tensor `{name}`"))?;
            if t.dims() != shape.as_slice() {
                bail!("tensor `{name}` has shape {:?}, expected {shape:?}", t.dims());
            }
            Ok(t)
        };
        let linear = |name: &str| -> Result<Projection> { Ok(Projection::Exact(Linear::new(w(name)?, None))) };
        let m = |s: &str| format!("midlayer.{s}");
        let fc_input_norm = if config.norm_before_fc { Some(w("input_norm.weight")?) } else { None };
        let fc_norms = match config.fc_norm {
            true => (0..N_TAPS).map(|i| w(&format!("fc_norm.{i}.weight"))).collect::<Result<Vec<_>>>()?,
            false => Vec::new(),
        };
        Ok(Self {
            fc: linear("fc.weight")?,
            fc_input_norm,
            fc_norms,
            input_norm: w(&m("input_layernorm.weight"))?,
            hidden_norm: w(&m("hidden_norm.weight"))?,
            post_norm: w(&m("post_attention_layernorm.weight"))?,
            q_proj: linear(&m("self_attn.q_proj.weight"))?,
            k_proj: linear(&m("self_attn.k_proj.weight"))?,
            v_proj: linear(&m("self_attn.v_proj.weight"))?,
            o_proj: linear(&m("self_attn.o_proj.weight"))?,
            gate_proj: linear(&m("mlp.gate_proj.weight"))?,
            up_proj: linear(&m("mlp.up_proj.weight"))?,
            down_proj: linear(&m("mlp.down_proj.weight"))?,
            norm: w("norm.weight")?,
            lm_head: linear("lm_head.weight")?,
            embed: None,
            draft_to_target,
            rope: RopeTable::new(config.head_dim, config.rope_theta),
            device: device.clone(),
            path: PathBuf::new(),
            config,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Converts every projection to 8-bit weights on the engine's kernels, for drafting (the
    /// draft changes slightly; verification keeps the output exact). Exact f32 otherwise.
    pub fn prepare_for_serving(&mut self, kernels: &KernelSettings) -> Result<()> {
        let device = self.device.clone();
        for p in [
            &mut self.fc,
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
            &mut self.gate_proj,
            &mut self.up_proj,
            &mut self.down_proj,
            &mut self.lm_head,
        ] {
            p.serve(kernels, &device)?;
        }
        Ok(())
    }

    /// Whether the drafter carries its own token embedding.
    pub fn has_embedding(&self) -> bool {
        self.embed.is_some()
    }

    /// Target id of draft-vocabulary entry `id`.
    pub fn target_token(&self, id: u32) -> u32 {
        self.draft_to_target[id as usize]
    }

    /// The draft vocabulary as target ids.
    pub fn draft_vocab(&self) -> &[u32] {
        &self.draft_to_target
    }

    /// Token embeddings `[ids, hidden]`: the drafter's own table, or else `target`'s.
    pub fn embed(&self, ids: &[u32], target: Option<&TargetHead>) -> Result<Tensor> {
        match &self.embed {
            Some(table) => {
                if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.config.vocab) {
                    bail!("token {bad} is outside the drafter's {} embedding rows", self.config.vocab);
                }
                Ok(table.index_select(&Tensor::new(ids, &self.device)?, 0)?)
            }
            None => {
                target.context("this EAGLE-3 drafter has no embedding of its own and no target was given")?.embed(ids)
            }
        }
    }

    /// The first feature of each row: `fc` of its three target states `[rows, 3·target_hidden]`
    /// (concatenated in tap order), after speculators' `input_norm` and per-tap `fc_norm` when
    /// the drafter has them.
    pub fn fuse(&self, taps: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        let want = N_TAPS * c.target_hidden;
        if taps.rank() != 2 || taps.dim(1)? != want {
            bail!("EAGLE-3 fuses target states of shape [rows, {want}], got {:?}", taps.dims());
        }
        let taps = taps.to_dtype(DType::F32)?;
        if self.fc_input_norm.is_none() && self.fc_norms.is_empty() {
            return self.fc.forward_constant_input(&taps);
        }
        let mut x = match &self.fc_input_norm {
            Some(w) => rms_norm(&taps, w, c.rms_eps)?,
            None => taps,
        };
        if !self.fc_norms.is_empty() {
            let parts = (0..N_TAPS)
                .map(|i| rms_norm(&x.narrow(1, i * c.target_hidden, c.target_hidden)?, &self.fc_norms[i], c.rms_eps))
                .collect::<candle_core::Result<Vec<_>>>()?;
            x = Tensor::cat(&parts, 1)?;
        }
        self.fc.forward(&x)
    }

    /// One pass of the decoder layer over `n` rows at `positions`: `embeds` and `features`
    /// `[n, hidden]`. Queries see every `past` row and, unless `mask` (`[n, past + n]`,
    /// additive) says otherwise, their own rows causally. Returns the outputs `[n, hidden]` (the
    /// next pass's features and what [`Self::logits`] reads: pre-norm, or final-normed with
    /// `norm_output`) and the rows' K/V.
    pub fn forward(
        &self,
        embeds: &Tensor,
        features: &Tensor,
        positions: &[usize],
        past: &LayerKv,
        mask: Option<&Tensor>,
    ) -> Result<(Tensor, LayerKv)> {
        self.pass(embeds, features, positions, |q, own| {
            let n = q.dim(1)?;
            let causal;
            let mask = match mask {
                Some(m) => Some(m),
                None if n > 1 => {
                    causal = causal_mask(past.k.dim(1)?, n, &self.device)?;
                    Some(&causal)
                }
                None => None,
            };
            attention(q, past, own, mask)
        })
    }

    /// An unrolled step of the training-time test ([`Self::forward`] otherwise): query i sees
    /// the `context` rows `context_mask` (`[n, context]`, additive) leaves visible, and its own
    /// row of every `earlier` step's K/V and of this step's.
    pub fn forward_unrolled(
        &self,
        embeds: &Tensor,
        features: &Tensor,
        positions: &[usize],
        context: &LayerKv,
        context_mask: &Tensor,
        earlier: &[LayerKv],
    ) -> Result<(Tensor, LayerKv)> {
        self.pass(embeds, features, positions, |q, own| unrolled_attention(q, context, context_mask, earlier, own))
    }

    /// The decoder layer, with `attend(q, own K/V)` → `[n, heads·head_dim]` for its attention.
    fn pass(
        &self,
        embeds: &Tensor,
        features: &Tensor,
        positions: &[usize],
        attend: impl FnOnce(&Tensor, &LayerKv) -> Result<Tensor>,
    ) -> Result<(Tensor, LayerKv)> {
        let c = &self.config;
        let n = embeds.dim(0)?;
        if features.dims() != [n, c.hidden] || embeds.dims() != [n, c.hidden] || positions.len() != n {
            bail!(
                "EAGLE-3 pass: embeddings {:?}, features {:?}, {} positions",
                embeds.dims(),
                features.dims(),
                positions.len()
            );
        }
        let normed_features = rms_norm(features, &self.hidden_norm, c.rms_eps)?;
        let residual = if c.norm_before_residual { normed_features.clone() } else { features.clone() };
        let x = Tensor::cat(&[&rms_norm(embeds, &self.input_norm, c.rms_eps)?, &normed_features], 1)?;
        let (cos, sin) = self.rope.tables(positions, &self.device)?;
        let heads = |t: Tensor, h: usize| -> Result<Tensor> {
            Ok(t.reshape((n, h, c.head_dim))?.transpose(0, 1)?.contiguous()?)
        };
        let q = rope(&heads(self.q_proj.forward(&x)?, c.n_heads)?, &cos, &sin)?;
        let k = rope(&heads(self.k_proj.forward(&x)?, c.n_kv_heads)?, &cos, &sin)?;
        let v = heads(self.v_proj.forward(&x)?, c.n_kv_heads)?;
        let own = LayerKv { k, v };
        let h = (residual + self.o_proj.forward(&attend(&q, &own)?)?)?;
        let u = rms_norm(&h, &self.post_norm, c.rms_eps)?;
        let mlp = self.down_proj.forward(&(self.gate_proj.forward(&u)?.silu()? * self.up_proj.forward(&u)?)?)?;
        let out = (h + mlp)?;
        if c.norm_output {
            return Ok((rms_norm(&out, &self.norm, c.rms_eps)?, own));
        }
        Ok((out, own))
    }

    /// Draft logits `[rows, draft_vocab]` of a pass's outputs (final norm, then the head; the
    /// head alone with `norm_output`, whose outputs are normed already).
    pub fn logits(&self, outputs: &Tensor) -> Result<Tensor> {
        if self.config.norm_output {
            return self.lm_head.forward(outputs);
        }
        self.lm_head.forward(&rms_norm(outputs, &self.norm, self.config.rms_eps)?)
    }

    /// Empty K/V, for a first pass with no earlier rows.
    pub fn empty_kv(&self) -> Result<LayerKv> {
        let empty = Tensor::zeros((self.config.n_kv_heads, 0, self.config.head_dim), DType::F32, &self.device)?;
        Ok(LayerKv { k: empty.clone(), v: empty })
    }
}

/// A drafter checkpoint as read from disk: its config, draft vocabulary and weights in f32
/// under their SpecForge names.
pub struct Eagle3Checkpoint {
    pub config: Eagle3Config,
    /// Target id of each draft-vocabulary entry.
    pub draft_to_target: Vec<u32>,
    /// Every tensor of [`expected_tensors`].
    pub tensors: HashMap<String, Tensor>,
    /// The drafter's own token embedding, if it has one.
    pub embed: Option<Tensor>,
}

/// Reads a drafter directory: `config.json` (either layout, see [`super::config`]) +
/// `*.safetensors` (f32/bf16/f16 weights, held in f32). Names may carry vLLM's and speculators'
/// `layers.0.` instead of `midlayer.`, or a `model.` prefix. Every tensor is checked for
/// presence, type and shape before any is read.
pub fn read_checkpoint(dir: &Path, device: &Device) -> Result<Eagle3Checkpoint> {
    let origin = dir.display();
    let config = Eagle3Config::from_file(&dir.join("config.json"))?;
    let shards = crate::speculative::weight_cache::safetensors_shards(dir)?;
    // SAFETY: mapped read-only; like every mmap loader we assume nobody truncates the files
    // while they are loaded.
    let st = unsafe { MmapedSafetensors::multi(&shards) }
        .map_err(|e| anyhow::anyhow!("{origin}: cannot read safetensors: {e}"))?;
    let find = |name: &str| -> Option<String> { stored_names(name).into_iter().find(|n| st.get(n).is_ok()) };
    let check = |name: &str, shape: &[usize]| -> Result<String> {
        let full = find(name).with_context(|| match name.strip_prefix("midlayer.") {
            Some(rest) => format!("{origin}: missing tensor `{name}` (or `layers.0.{rest}`)"),
            None => format!("{origin}: missing tensor `{name}`"),
        })?;
        let view = st.get(&full).map_err(|e| anyhow::anyhow!("{origin}: `{full}`: {e}"))?;
        if view.shape() != shape {
            bail!("{origin}: tensor `{full}` has shape {:?}, expected {shape:?}", view.shape());
        }
        if !matches!(DType::try_from(view.dtype()), Ok(DType::F32 | DType::BF16 | DType::F16)) {
            bail!("{origin}: tensor `{full}` has type {:?} (supported: f32, bf16, f16)", view.dtype());
        }
        Ok(full)
    };
    let mut names = HashMap::new();
    for (name, shape) in expected_tensors(&config) {
        names.insert(name.clone(), check(&name, &shape)?);
    }
    let embed_shape = [config.vocab, config.hidden];
    let embed = match find("embed_tokens.weight") {
        Some(_) => Some(check("embed_tokens.weight", &embed_shape)?),
        None if config.own_embedding => {
            bail!("{origin}: `embed_requires_grad` is true (a trained embedding) but there is no `embed_tokens.weight`")
        }
        None => None,
    };
    let d2t = match find("d2t") {
        Some(full) => {
            let view = st.get(&full).map_err(|e| anyhow::anyhow!("{origin}: `{full}`: {e}"))?;
            if view.shape() != [config.draft_vocab] {
                bail!("{origin}: tensor `{full}` has shape {:?}, expected [{}]", view.shape(), config.draft_vocab);
            }
            let t = st.load(&full, &Device::Cpu).map_err(|e| anyhow::anyhow!("{origin}: `{full}`: {e}"))?;
            Some(t.to_dtype(DType::I64)?.to_vec1::<i64>()?)
        }
        None if config.draft_vocab == config.vocab => None,
        None => bail!("{origin}: `draft_vocab_size` is {} but there is no `d2t` tensor", config.draft_vocab),
    };
    let draft_to_target = draft_to_target(d2t.as_deref(), config.draft_vocab, config.vocab)
        .with_context(|| format!("{origin}: `d2t`"))?;
    let load = |full: &str| -> Result<Tensor> { Ok(st.load(full, device)?.to_dtype(DType::F32)?) };
    let tensors = names.into_iter().map(|(name, full)| Ok((name, load(&full)?))).collect::<Result<_>>()?;
    let embed = embed.map(|full| load(&full)).transpose()?;
    Ok(Eagle3Checkpoint { config, draft_to_target, tensors, embed })
}

/// The names a checkpoint may store tensor `name` under: SpecForge's, vLLM's `layers.0.` for
/// `midlayer.`, each with or without a `model.` prefix.
fn stored_names(name: &str) -> [String; 4] {
    let alt = name.replace("midlayer.", "layers.0.");
    [name.to_string(), format!("model.{name}"), alt.clone(), format!("model.{alt}")]
}

/// `[n, m + n]`: every one of `m` earlier rows is visible, own rows causally.
pub fn causal_mask(m: usize, n: usize, device: &Device) -> Result<Tensor> {
    let values: Vec<f32> =
        (0..n).flat_map(|i| (0..m + n).map(move |j| if j <= m + i { 0.0 } else { f32::NEG_INFINITY })).collect();
    Ok(Tensor::from_vec(values, (n, m + n), device)?)
}

/// [`causal_mask`] of a sliding-window layer: `m` earlier rows then `n` own rows, all
/// consecutive positions; row i (at `m + i`) sees the rows j ≤ m + i with m + i − j < `window`.
pub fn windowed_causal_mask(m: usize, n: usize, window: usize, device: &Device) -> Result<Tensor> {
    let values: Vec<f32> = (0..n)
        .flat_map(|i| (0..m + n).map(move |j| if j <= m + i && m + i - j < window { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(values, (n, m + n), device)?)
}

/// Target ids of the draft vocabulary from the checkpoint's `d2t` offsets (target id =
/// i + d2t[i]); without `d2t` the vocabularies are the same. Every id must be a target token.
pub fn draft_to_target(d2t: Option<&[i64]>, draft_vocab: usize, vocab: usize) -> Result<Vec<u32>> {
    let Some(d2t) = d2t else { return Ok((0..draft_vocab as u32).collect()) };
    if d2t.len() != draft_vocab {
        bail!("{} offsets for a draft vocabulary of {draft_vocab}", d2t.len());
    }
    d2t.iter()
        .enumerate()
        .map(|(i, &off)| {
            let id = (i as i64).checked_add(off).filter(|&id| id >= 0 && (id as usize) < vocab);
            id.map(|id| id as u32)
                .with_context(|| format!("entry {i} maps to {} + {off}, not a token below {vocab}", i))
        })
        .collect()
}

/// `d2t` offsets for a draft vocabulary given as target ids (the inverse of [`draft_to_target`]).
pub fn d2t_offsets(draft_to_target: &[u32]) -> Vec<i64> {
    draft_to_target.iter().enumerate().map(|(i, &t)| t as i64 - i as i64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn d2t_round_trips_and_refuses_ids_outside_the_vocabulary() {
        let ids = vec![0u32, 5, 7, 99];
        let d2t = d2t_offsets(&ids);
        assert_eq!(d2t, vec![0, 4, 5, 96]);
        assert_eq!(draft_to_target(Some(&d2t), 4, 100).unwrap(), ids);
        assert!(draft_to_target(Some(&d2t), 4, 99).is_err());
        assert!(draft_to_target(Some(&[i64::MAX]), 1, 10).is_err());
        assert!(draft_to_target(Some(&[-1]), 1, 10).is_err());
        assert!(draft_to_target(Some(&d2t), 5, 100).is_err());
        assert_eq!(draft_to_target(None, 3, 10).unwrap(), vec![0, 1, 2]);
    }

    #[test]
    fn causal_mask_sees_the_past_and_earlier_own_rows() {
        let m = causal_mask(2, 2, &Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(m[0][..3], [0.0, 0.0, 0.0]);
        assert!(m[0][3].is_infinite());
        assert_eq!(m[1], [0.0; 4]);
    }
}
