//! The DFlash drafter network (spec §2.4), written once with plain differentiable candle ops
//! (matmul, softmax, an RMSNorm and a NeoX RoPE built from elementwise ops) so the same code can
//! serve training.
//!
//! The forward is split where the proposer caches: [`DflashDrafter::context_kv`] turns target
//! hidden states into every layer's rotated context K/V (what the drafter's cache holds), and
//! [`DflashDrafter::forward_block`] runs the block rows against that context. The stateless
//! [`DflashDrafter::forward`] is the two composed.

use super::config::{DflashConfig, LayerAttention};
use crate::model::{Linear as TargetLinear, Transformer};
pub use crate::speculative::nn::LayerKv;
use crate::speculative::nn::{block_attention, rms_norm, rope, BlockMasks, Projection, RopeTable};
use anyhow::{bail, Context, Result};
use candle_core::quantized::QTensor;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, VarBuilder};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a DFlash drafter borrows from its target: the token embedding, the LM head, and the
/// final norm (see [`TargetHead::hidden_state`]). All reference-counted: cloning is cheap.
#[derive(Clone)]
pub struct TargetHead {
    embedding: Arc<QTensor>,
    /// The target's embedding multiplier (Gemma: √hidden), so drafters see what its first
    /// layer sees.
    embed_scale: Option<f32>,
    final_norm: Tensor,
    rms_eps: f64,
    n_layers: usize,
    lm_head: TargetLinear,
    device: Device,
}

impl TargetHead {
    pub fn of(target: &Transformer) -> Self {
        let (embedding, final_norm, lm_head) = target.embedding_norm_head();
        let c = &target.config;
        Self {
            embedding,
            embed_scale: c.extras.embed_scale,
            final_norm,
            rms_eps: c.rms_eps,
            n_layers: c.n_layers,
            lm_head,
            device: target.device().clone(),
        }
    }

    /// From the parts directly (tests, tools): `embedding` and `lm_head` `[vocab, hidden]`, the
    /// final norm weight `[hidden]`, and the target's depth.
    pub fn from_parts(
        embedding: Arc<QTensor>,
        final_norm: Tensor,
        rms_eps: f64,
        n_layers: usize,
        lm_head: TargetLinear,
        device: &Device,
    ) -> Self {
        Self { embedding, embed_scale: None, final_norm, rms_eps, n_layers, lm_head, device: device.clone() }
    }

    /// The feature DFlash means by "target layer `layer`": Hugging Face's
    /// `hidden_states[layer + 1]` given the engine's tap (the residual stream after `layer`).
    /// They are the same except for the last layer, where Hugging Face returns the output
    /// *after* the final norm; the reference (and so every published drafter) uses that.
    pub fn hidden_state(&self, layer: usize, tap: &Tensor) -> Result<Tensor> {
        let tap = tap.to_dtype(DType::F32)?;
        if layer + 1 == self.n_layers {
            return Ok(candle_nn::ops::rms_norm(&tap, &self.final_norm.to_dtype(DType::F32)?, self.rms_eps as f32)?);
        }
        Ok(tap)
    }

    /// The target's embedding table (also its identity for [`super::ContextStore`]).
    pub fn embedding(&self) -> &Arc<QTensor> {
        &self.embedding
    }

    /// Token embeddings `[ids, hidden]` (f32), scaled as the target scales them.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let ids = Tensor::new(ids, &self.device)?;
        let x = self.embedding.embedding(&ids)?.to_dtype(DType::F32)?;
        Ok(match self.embed_scale {
            Some(s) => (x * s as f64)?,
            None => x,
        })
    }

    /// Logits `[rows, vocab]` of already-normalised hidden states (no final norm here).
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)
    }
}

/// How the rows of one [`DflashDrafter::forward_block`] call are packed.
#[derive(Clone, Copy)]
pub struct Packing<'a> {
    /// Equal blocks of consecutive rows; a row attends to the rows of its own block only.
    pub blocks: usize,
    /// Additive (0 or −∞) `[rows, context]`: context rows a row must not see (training: those
    /// at or after its block's anchor).
    pub context_mask: Option<&'a Tensor>,
}

impl Packing<'_> {
    /// One block seeing the whole context: drafting.
    pub const ONE_BLOCK: Packing<'static> = Packing { blocks: 1, context_mask: None };
}

struct DflashLayer {
    input_norm: Tensor,
    post_norm: Tensor,
    q_proj: Projection,
    k_proj: Projection,
    v_proj: Projection,
    o_proj: Projection,
    q_norm: Tensor,
    k_norm: Tensor,
    gate_proj: Projection,
    up_proj: Projection,
    down_proj: Projection,
    attention: LayerAttention,
}

/// A reduced drafter vocabulary (our extension of the z-lab format: `dflash_config.draft_vocab_size`
/// and a `d2t` tensor of target ids; or speculators' `draft_vocab_size` with `d2t` offsets): the
/// drafter scores only these tokens, with the target's own LM-head rows for them. Verification still uses the full target, so output
/// stays lossless; tokens outside the set are simply never drafted.
struct DraftVocab {
    draft_to_target: Vec<u32>,
    /// The target's head rows for `draft_to_target`, built by [`DflashDrafter::attach_target`].
    head: Option<TargetLinear>,
}

/// Rows `ids` of a `[rows, cols]` quantised matrix, copied block for block (no requantisation).
pub fn select_rows(q: &QTensor, ids: &[u32], device: &Device) -> Result<QTensor> {
    let (rows, cols) = q.shape().dims2()?;
    let dtype = q.dtype();
    if cols % dtype.block_size() != 0 {
        bail!("a row of {cols} values is not a whole number of {:?} blocks", dtype);
    }
    let row_bytes = cols / dtype.block_size() * dtype.type_size();
    let data = q.data()?;
    let mut out = Vec::with_capacity(ids.len() * row_bytes);
    for &id in ids {
        let id = id as usize;
        if id >= rows {
            bail!("token {id} is beyond the head's {rows} rows");
        }
        out.extend_from_slice(&data[id * row_bytes..(id + 1) * row_bytes]);
    }
    Ok(candle_core::quantized::ggml_file::qtensor_from_ggml(dtype, &out, vec![ids.len(), cols], device)?)
}

pub struct DflashDrafter {
    pub config: DflashConfig,
    pub path: PathBuf,
    fc: Projection,
    hidden_norm: Tensor,
    norm: Tensor,
    layers: Vec<DflashLayer>,
    rope: RopeTable,
    device: Device,
    draft_vocab: Option<DraftVocab>,
    /// Context K/V of recent prompts, shared by every proposer of this drafter.
    pub context_store: super::ContextStore,
}

/// Prompt rows whose context K/V a drafter keeps for prefix-cache hits (about 3 KB per row
/// for a two-layer drafter of a 576-wide target).
const CONTEXT_STORE_ROWS: usize = 16_384;

/// Every tensor a checkpoint must hold, with its `[out, in]` shape (names without a prefix).
pub fn expected_tensors(c: &DflashConfig) -> Vec<(String, Vec<usize>)> {
    let (h, q, kv) = (c.hidden, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let mut t = vec![
        ("fc.weight".to_string(), vec![h, c.target_layer_ids.len() * h]),
        ("hidden_norm.weight".to_string(), vec![h]),
        ("norm.weight".to_string(), vec![h]),
    ];
    for i in 0..c.n_layers {
        let mut add = |name: &str, shape: Vec<usize>| t.push((format!("layers.{i}.{name}"), shape));
        add("input_layernorm.weight", vec![h]);
        add("post_attention_layernorm.weight", vec![h]);
        add("self_attn.q_proj.weight", vec![q, h]);
        add("self_attn.k_proj.weight", vec![kv, h]);
        add("self_attn.v_proj.weight", vec![kv, h]);
        add("self_attn.o_proj.weight", vec![h, q]);
        if c.attention_bias {
            add("self_attn.q_proj.bias", vec![q]);
            add("self_attn.k_proj.bias", vec![kv]);
            add("self_attn.v_proj.bias", vec![kv]);
            add("self_attn.o_proj.bias", vec![h]);
        }
        add("self_attn.q_norm.weight", vec![c.head_dim]);
        add("self_attn.k_norm.weight", vec![c.head_dim]);
        add("mlp.gate_proj.weight", vec![c.ffn, h]);
        add("mlp.up_proj.weight", vec![c.ffn, h]);
        add("mlp.down_proj.weight", vec![h, c.ffn]);
    }
    t
}

impl DflashDrafter {
    /// Loads a drafter directory: `config.json` (z-lab, SpecForge or speculators layout, see
    /// [`super::config`]) + `*.safetensors` (f32/bf16/f16, one file or shards; weights are held
    /// in f32; the tensor names are z-lab's in every layout). Every tensor is checked for
    /// presence and shape before any is read.
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let origin = dir.display();
        let config = DflashConfig::from_file(&dir.join("config.json"))?;
        let shards = crate::speculative::weight_cache::safetensors_shards(dir)?;
        // SAFETY: mapped read-only; like every mmap loader we assume nobody truncates the files
        // while they are loaded.
        let st = unsafe { MmapedSafetensors::multi(&shards) }
            .map_err(|e| anyhow::anyhow!("{origin}: cannot read safetensors: {e}"))?;
        // Released checkpoints have bare names (`fc.weight`); tolerate a `model.` prefix.
        let prefix = if st.get("fc.weight").is_err() && st.get("model.fc.weight").is_ok() { "model." } else { "" };
        for (name, shape) in expected_tensors(&config) {
            let full = format!("{prefix}{name}");
            let view = st.get(&full).map_err(|_| anyhow::anyhow!("{origin}: missing tensor `{full}`"))?;
            if view.shape() != shape.as_slice() {
                bail!("{origin}: tensor `{full}` has shape {:?}, expected {shape:?}", view.shape());
            }
            if !matches!(DType::try_from(view.dtype()), Ok(DType::F32 | DType::BF16 | DType::F16)) {
                bail!("{origin}: tensor `{full}` has type {:?} (supported: f32, bf16, f16)", view.dtype());
            }
        }
        let draft_to_target = match config.draft_vocab_size {
            None => None,
            Some(n) => {
                let full = format!("{prefix}d2t");
                let view = st.get(&full).map_err(|_| {
                    anyhow::anyhow!("{origin}: `draft_vocab_size` is {n} but tensor `{full}` is missing (a reduced vocabulary needs it)")
                })?;
                if view.shape() != [n] {
                    bail!("{origin}: tensor `{full}` has shape {:?}, expected [{n}]", view.shape());
                }
                if !matches!(DType::try_from(view.dtype()), Ok(DType::I64 | DType::I32 | DType::U32)) {
                    bail!("{origin}: tensor `{full}` has type {:?}, expected integers", view.dtype());
                }
                // speculators also stores its (frozen) copy of the target's head rows: its shape
                // must agree with the vocabulary we are about to build from the target's head.
                if let Ok(head) = st.get(&format!("{prefix}lm_head.weight")) {
                    if config.layout == super::config::DflashLayout::Speculators && head.shape() != [n, config.hidden] {
                        bail!(
                            "{origin}: tensor `lm_head.weight` has shape {:?}, expected [{n}, {}]",
                            head.shape(),
                            config.hidden
                        );
                    }
                }
                let t = st.load(&full, &Device::Cpu).map_err(|e| anyhow::anyhow!("{origin}: `{full}`: {e}"))?;
                let values: Vec<i64> = t.to_dtype(DType::I64)?.to_vec1()?;
                let ids = match config.layout {
                    // specula: absolute target ids.
                    super::config::DflashLayout::ZLab => values
                        .into_iter()
                        .map(|i| {
                            u32::try_from(i).with_context(|| format!("{origin}: `{full}` holds {i}, not a token id"))
                        })
                        .collect::<Result<Vec<u32>>>()?,
                    // speculators: offsets, target id = i + d2t[i].
                    super::config::DflashLayout::Speculators => values
                        .iter()
                        .enumerate()
                        .map(|(i, &off)| {
                            (i as i64).checked_add(off).and_then(|id| u32::try_from(id).ok()).with_context(|| {
                                format!("{origin}: `{full}` entry {i} maps to {i} + {off}, not a token id")
                            })
                        })
                        .collect::<Result<Vec<u32>>>()?,
                };
                Some(ids)
            }
        };
        let vb = VarBuilder::from_backend(Box::new(st), DType::F32, device.clone());
        let vb = if prefix.is_empty() { vb } else { vb.pp("model") };
        let mut drafter = Self::from_var_builder(config, vb).with_context(|| format!("{origin}"))?;
        drafter.path = dir.to_path_buf();
        drafter.set_draft_vocab(draft_to_target)?;
        Ok(drafter)
    }

    /// Builds the network from any variable source (a checkpoint, or a `VarMap` for training),
    /// with the shapes of [`expected_tensors`].
    pub fn from_var_builder(config: DflashConfig, vb: VarBuilder) -> Result<Self> {
        let device = vb.device().clone();
        let get = |name: &str, shape: &[usize]| -> Result<Tensor> {
            vb.get(shape, name).with_context(|| format!("tensor `{name}`"))
        };
        let (h, q, kv) = (config.hidden, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim);
        let linear = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Projection> {
            let w = get(&format!("{name}.weight"), &[out, inp])?;
            let b = if bias { Some(get(&format!("{name}.bias"), &[out])?) } else { None };
            Ok(Projection::Exact(Linear::new(w, b)))
        };
        let mut layers = Vec::with_capacity(config.n_layers);
        for i in 0..config.n_layers {
            let p = |s: &str| format!("layers.{i}.{s}");
            let bias = config.attention_bias;
            layers.push(DflashLayer {
                input_norm: get(&p("input_layernorm.weight"), &[h])?,
                post_norm: get(&p("post_attention_layernorm.weight"), &[h])?,
                q_proj: linear(&p("self_attn.q_proj"), q, h, bias)?,
                k_proj: linear(&p("self_attn.k_proj"), kv, h, bias)?,
                v_proj: linear(&p("self_attn.v_proj"), kv, h, bias)?,
                o_proj: linear(&p("self_attn.o_proj"), h, q, bias)?,
                q_norm: get(&p("self_attn.q_norm.weight"), &[config.head_dim])?,
                k_norm: get(&p("self_attn.k_norm.weight"), &[config.head_dim])?,
                gate_proj: linear(&p("mlp.gate_proj"), config.ffn, h, false)?,
                up_proj: linear(&p("mlp.up_proj"), config.ffn, h, false)?,
                down_proj: linear(&p("mlp.down_proj"), h, config.ffn, false)?,
                attention: config.layer_attention[i],
            });
        }
        Ok(Self {
            fc: linear("fc", h, config.target_layer_ids.len() * h, false)?,
            hidden_norm: get("hidden_norm.weight", &[h])?,
            norm: get("norm.weight", &[h])?,
            layers,
            rope: RopeTable::new(config.head_dim, config.rope_theta),
            device,
            path: PathBuf::new(),
            draft_vocab: None,
            context_store: super::ContextStore::new(CONTEXT_STORE_ROWS),
            config,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Converts every projection to 8-bit weights on the engine's kernels, for drafting (the
    /// draft changes slightly; verification keeps the output exact). Until then, and for
    /// training and the reference checks, they are exact f32.
    pub fn prepare_for_serving(&mut self, kernels: &crate::model::KernelSettings) -> Result<()> {
        let device = self.device.clone();
        self.fc.serve(kernels, &device)?;
        for l in &mut self.layers {
            for p in [
                &mut l.q_proj,
                &mut l.k_proj,
                &mut l.v_proj,
                &mut l.o_proj,
                &mut l.gate_proj,
                &mut l.up_proj,
                &mut l.down_proj,
            ] {
                p.serve(kernels, &device)?;
            }
        }
        Ok(())
    }

    /// Sets (or clears) the reduced vocabulary; the head is built by [`Self::attach_target`].
    pub fn set_draft_vocab(&mut self, draft_to_target: Option<Vec<u32>>) -> Result<()> {
        if let Some(ids) = &draft_to_target {
            if ids.is_empty() {
                bail!("an empty drafter vocabulary");
            }
            if self.config.draft_vocab_size != Some(ids.len()) {
                bail!("drafter vocabulary of {} tokens, config says {:?}", ids.len(), self.config.draft_vocab_size);
            }
        }
        self.draft_vocab = draft_to_target.map(|draft_to_target| DraftVocab { draft_to_target, head: None });
        Ok(())
    }

    /// cos and sin tables `[rows, head_dim]` for absolute positions.
    fn rope_tables(&self, positions: &[usize]) -> Result<(Tensor, Tensor)> {
        self.rope.tables(positions, &self.device)
    }

    /// Context features `hidden_norm(fc(concat(taps)))` `[rows, hidden]`: `taps[i]` is Hugging
    /// Face's `hidden_states[target_layer_ids[i] + 1]`, `[rows, hidden]` (from an engine tap via
    /// [`TargetHead::hidden_state`]).
    pub fn context_features(&self, taps: &[Tensor]) -> Result<Tensor> {
        let k = self.config.target_layer_ids.len();
        if taps.len() != k {
            bail!("DFlash needs {k} target hidden-state taps, got {}", taps.len());
        }
        for t in taps {
            if t.rank() != 2 || t.dim(1)? != self.config.hidden || t.dim(0)? != taps[0].dim(0)? {
                bail!("target tap of shape {:?}, expected [{}, {}]", t.dims(), taps[0].dim(0)?, self.config.hidden);
            }
        }
        let taps: Vec<Tensor> = taps.iter().map(|t| t.to_dtype(DType::F32)).collect::<candle_core::Result<_>>()?;
        self.fuse_features(&Tensor::cat(&taps, 1)?)
    }

    /// [`Self::context_features`] of taps already concatenated, `[rows, taps·hidden]` f32 (the
    /// trainer keeps them so). The taps are the target's and take no gradient.
    pub fn fuse_features(&self, concat: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(&self.fc.forward_constant_input(concat)?, &self.hidden_norm, self.config.rms_eps)?)
    }

    /// Per layer, the K/V of context rows with features `[rows, hidden]` at `positions`:
    /// that layer's k/v projections, k-norm, and RoPE at the rows' absolute positions.
    pub fn context_kv(&self, features: &Tensor, positions: &[usize]) -> Result<Vec<LayerKv>> {
        let (cos, sin) = self.rope_tables(positions)?;
        self.layers.iter().map(|l| self.project_kv(l, features, &cos, &sin)).collect()
    }

    /// `x` `[rows, hidden]` → K (normed, rotated) and V, `[n_kv, rows, head_dim]`.
    fn project_kv(&self, layer: &DflashLayer, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<LayerKv> {
        let c = &self.config;
        let rows = x.dim(0)?;
        let k = layer.k_proj.forward(x)?.reshape((rows, c.n_kv_heads, c.head_dim))?;
        let k = rms_norm(&k, &layer.k_norm, c.rms_eps)?.transpose(0, 1)?.contiguous()?;
        let k = rope(&k, cos, sin)?;
        let v = layer.v_proj.forward(x)?.reshape((rows, c.n_kv_heads, c.head_dim))?.transpose(0, 1)?.contiguous()?;
        Ok(LayerKv { k, v })
    }

    /// Runs block rows (token embeddings `[n, hidden]` at `block_positions`) against per-layer
    /// context K/V (`context[l]`, rows at `context_positions`) and returns the final-normed hidden
    /// states `[n, hidden]`. The rows are `packing.blocks` equal blocks of consecutive rows (one
    /// when drafting; training packs every anchor of a sequence into one call): a row sees every
    /// context row and every row of its own block, unless the layer is causal/windowed or
    /// `packing.context_mask` hides context rows.
    pub fn forward_block(
        &self,
        block: &Tensor,
        block_positions: &[usize],
        context: &[LayerKv],
        context_positions: &[usize],
        packing: Packing,
    ) -> Result<Tensor> {
        let c = &self.config;
        let n = block.dim(0)?;
        if n != block_positions.len() || context.len() != self.layers.len() {
            bail!(
                "forward_block: {n} block rows with {} positions, {} context layers",
                block_positions.len(),
                context.len()
            );
        }
        if packing.blocks == 0 || n % packing.blocks != 0 {
            bail!("forward_block: {n} rows do not split into {} equal blocks", packing.blocks);
        }
        let ctx_len = context_positions.len();
        let (cos, sin) = self.rope_tables(block_positions)?;
        let mut h = block.to_dtype(DType::F32)?;
        for (layer, ctx) in self.layers.iter().zip(context) {
            if ctx.k.dim(1)? != ctx_len {
                bail!("context K/V has {} rows for {ctx_len} positions", ctx.k.dim(1)?);
            }
            let u = rms_norm(&h, &layer.input_norm, c.rms_eps)?;
            let q = layer.q_proj.forward(&u)?.reshape((n, c.n_heads, c.head_dim))?;
            let q = rms_norm(&q, &layer.q_norm, c.rms_eps)?.transpose(0, 1)?.contiguous()?;
            let q = rope(&q, &cos, &sin)?;
            let own = self.project_kv(layer, &u, &cos, &sin)?;
            let (past_mask, own_mask) =
                self.layer_masks(layer.attention, block_positions, packing.blocks, context_positions)?;
            let past_mask = match (packing.context_mask, past_mask) {
                (Some(a), Some(b)) => Some((a + b)?),
                (Some(a), None) => Some(a.clone()),
                (None, b) => b,
            };
            let masks = BlockMasks { past: past_mask.as_ref(), own: own_mask.as_ref() };
            let attn = block_attention(&q, ctx, &own, packing.blocks, masks)?;
            h = (h + layer.o_proj.forward(&attn)?)?;
            let u = rms_norm(&h, &layer.post_norm, c.rms_eps)?;
            let mlp = layer.down_proj.forward(&(layer.gate_proj.forward(&u)?.silu()? * layer.up_proj.forward(&u)?)?)?;
            h = (h + mlp)?;
        }
        Ok(rms_norm(&h, &self.norm, c.rms_eps)?)
    }

    /// The stateless forward: context taps `[ctx, hidden]` each (at `context_positions`) and
    /// block embeddings `[n, hidden]` (at `block_positions`) → final-normed block hidden states.
    pub fn forward(
        &self,
        taps: &[Tensor],
        context_positions: &[usize],
        block: &Tensor,
        block_positions: &[usize],
        packing: Packing,
    ) -> Result<Tensor> {
        let features = self.context_features(taps)?;
        let context = self.context_kv(&features, context_positions)?;
        self.forward_block(block, block_positions, &context, context_positions, packing)
    }

    /// The additive masks a causal or windowed layer needs: over the context `[n, ctx]` and over
    /// each row's own block `[n, b]` (rows are `blocks` equal blocks); None for full layers.
    fn layer_masks(
        &self,
        attention: LayerAttention,
        queries: &[usize],
        blocks: usize,
        context: &[usize],
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if attention.is_full() {
            return Ok((None, None));
        }
        let b = queries.len() / blocks;
        // Each block's first row is its anchor.
        let anchor = |r: usize| queries[r / b * b];
        let mask = |q: usize, k: usize, a: usize| if attention.visible(q, k, a) { 0.0 } else { f32::NEG_INFINITY };
        let past: Vec<f32> = queries
            .iter()
            .enumerate()
            .flat_map(|(r, &q)| context.iter().map(move |&k| mask(q, k, anchor(r))))
            .collect();
        let own: Vec<f32> = queries
            .iter()
            .enumerate()
            .flat_map(|(r, &q)| queries[r / b * b..(r / b + 1) * b].iter().map(move |&k| mask(q, k, anchor(r))))
            .collect();
        Ok((
            Some(Tensor::from_vec(past, (queries.len(), context.len()), &self.device)?),
            Some(Tensor::from_vec(own, (queries.len(), b), &self.device)?),
        ))
    }

    /// Draft logits `[rows, vocab]` for final-normed hidden states: the target's LM head, then
    /// the optional output multiplier and soft-capping.
    /// With a reduced drafter vocabulary the columns are the drafter's ids
    /// ([`Self::target_token`] maps them back).
    pub fn logits(&self, head: &TargetHead, hidden: &Tensor) -> Result<Tensor> {
        let logits = match &self.draft_vocab {
            Some(v) => {
                v.head.as_ref().context("the drafter's reduced head was not built for a target")?.forward(hidden)?
            }
            None => head.logits(hidden)?,
        };
        self.finish_logits(logits.to_dtype(DType::F32)?)
    }

    /// The target token of drafter vocabulary entry `id` (the identity without a reduced
    /// vocabulary).
    pub fn target_token(&self, id: u32) -> u32 {
        match &self.draft_vocab {
            Some(v) => v.draft_to_target[id as usize],
            None => id,
        }
    }

    /// The drafter's vocabulary as target ids, when reduced.
    pub fn draft_vocab(&self) -> Option<&[u32]> {
        self.draft_vocab.as_ref().map(|v| v.draft_to_target.as_slice())
    }

    /// Builds the reduced LM head from `target`'s head rows (exactly those rows of the
    /// target's own weights, so a drafter's logit for a token equals the full head's).
    pub fn attach_target(&mut self, target: &Transformer, kernels: &crate::model::KernelSettings) -> Result<()> {
        let Some(vocab) = &mut self.draft_vocab else { return Ok(()) };
        let weights = target.lm_head_weights()?;
        let rows = select_rows(&weights, &vocab.draft_to_target, target.device())?;
        vocab.head =
            Some(TargetLinear::from_qtensor(Arc::new(rows), None, target.weight_format, kernels, target.device())?);
        Ok(())
    }

    /// Output multiplier and soft-capping on raw head logits (f32).
    pub fn finish_logits(&self, mut logits: Tensor) -> Result<Tensor> {
        if self.config.output_multiplier != 1.0 {
            logits = (logits * self.config.output_multiplier)?;
        }
        if let Some(cap) = self.config.final_logit_softcapping {
            logits = ((logits / cap)?.tanh()? * cap)?;
        }
        Ok(logits)
    }
}
