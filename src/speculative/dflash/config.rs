//! The DFlash drafter `config.json`, in the layouts the trainers write:
//!
//! * z-lab (`dflash==0.1.0`, SpecForge, specula's own export): a Qwen3 config plus the DFlash
//!   fields (`block_size`, `dflash_config.{target_layer_ids, mask_token_id}`,
//!   `num_target_layers`), read the way the reference reads it: a DFlash field is looked up in
//!   `dflash_config` first, then at the top level. SpecForge 0.2.0 also writes a top-level
//!   `draft_vocab_size` equal to `vocab_size`: the full vocabulary. A smaller
//!   `draft_vocab_size` is specula's reduced vocabulary (`d2t` holds absolute target ids).
//! * speculators (`speculators_model_type: "dflash"`, same `DFlashDraftModel` architecture):
//!   the shape in a nested `transformer_layer_config`, the DFlash fields at the top level,
//!   tapped layers as `aux_hidden_state_layer_ids` in Hugging Face `hidden_states` numbering
//!   (id k = output of decoder layer k − 1), and a reduced vocabulary as `d2t` *offsets*
//!   (target id = i + d2t[i]). See [`DflashConfig::from_speculators`].

use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// How one drafter layer's block queries see the keys (spec §2.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerAttention {
    /// A block query sees only keys at its own position or before it.
    pub causal: bool,
    /// A query at position q sees keys at k only when |q − k| < window (q − k < window for
    /// causal layers).
    pub window: Option<usize>,
    /// The window is measured from the block's anchor P instead of from each query, and over
    /// the context only: the block sees context rows P − window ..< P and its own rows
    /// (speculators' training mask, `create_anchor_block_mask_mod`). z-lab layers measure
    /// from the query (the reference's rule).
    pub window_from_anchor: bool,
}

impl LayerAttention {
    pub const FULL: Self = Self { causal: false, window: None, window_from_anchor: false };

    pub fn is_full(&self) -> bool {
        !self.causal && self.window.is_none()
    }

    /// Whether a query at `q` of the block anchored at `anchor` sees a key at `k` (absolute
    /// positions; keys before the anchor are context rows).
    pub fn visible(&self, q: usize, k: usize, anchor: usize) -> bool {
        if self.causal && k > q {
            return false;
        }
        match self.window {
            None => true,
            Some(w) if self.window_from_anchor => k >= anchor || anchor - k <= w,
            Some(w) => q.abs_diff(k) < w,
        }
    }
}

/// Which trainer's layout a config came in: it decides how the `d2t` tensor of a reduced
/// vocabulary reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DflashLayout {
    /// z-lab / SpecForge / specula: `d2t` holds absolute target ids.
    #[default]
    ZLab,
    /// speculators: `d2t` holds offsets (target id = i + d2t[i]).
    Speculators,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DflashConfig {
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
    pub attention_bias: bool,
    /// B: block rows per draft (the anchor plus B − 1 masks).
    pub block_size: usize,
    /// Target decoder layers (0-based) whose outputs are concatenated into the context features.
    pub target_layer_ids: Vec<usize>,
    /// The MASK token: a row of the *target's* embedding.
    pub mask_token_id: u32,
    /// Target depth the drafter was built for, when the config says.
    pub num_target_layers: Option<usize>,
    /// Per drafter layer.
    pub layer_attention: Vec<LayerAttention>,
    /// Multiplies the block's token embeddings (1 for Qwen3 drafters).
    pub input_embedding_scale: f64,
    /// Multiplies the draft logits (1 for Qwen3 drafters).
    pub output_multiplier: f64,
    /// `tanh(logits / c) * c` when set (Gemma-style targets).
    pub final_logit_softcapping: Option<f64>,
    /// A reduced drafter vocabulary of this many target tokens (`dflash_config.draft_vocab_size`,
    /// with a `d2t` tensor; our extension, see `model::DraftVocab`; or speculators'
    /// `draft_vocab_size`). None: the target's.
    pub draft_vocab_size: Option<usize>,
    /// The layout the config was read from.
    pub layout: DflashLayout,
}

/// The reference's default tapped layers (`build_target_layer_ids`): `n_draft_layers` ids
/// spread evenly from 1 to `n_target_layers − 3`, rounded half to even as Python does.
pub fn default_target_layer_ids(n_target_layers: usize, n_draft_layers: usize) -> Vec<usize> {
    if n_draft_layers == 1 {
        return vec![n_target_layers / 2];
    }
    let (start, end) = (1.0, n_target_layers as f64 - 3.0);
    let span = end - start;
    (0..n_draft_layers)
        .map(|i| (start + (i as f64 * span) / (n_draft_layers - 1) as f64).round_ties_even().max(0.0) as usize)
        .collect()
}

fn as_usize(v: &Value, key: &str) -> Result<usize> {
    v.as_u64().map(|n| n as usize).with_context(|| format!("`{key}` should be a non-negative integer, found {v}"))
}

fn as_f64(v: &Value, key: &str) -> Result<f64> {
    v.as_f64().with_context(|| format!("`{key}` should be a number, found {v}"))
}

impl DflashConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let json: Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_json(&json).with_context(|| format!("{}", path.display()))
    }

    pub fn from_json(c: &Value) -> Result<Self> {
        match c.get("speculators_model_type").filter(|v| !v.is_null()) {
            None => Self::from_zlab(c),
            Some(v) => match v.as_str() {
                Some("dflash") => Self::from_speculators(c),
                Some("eagle3") => bail!("a speculators EAGLE-3 drafter (`speculators_model_type` \"eagle3\"): load it with `--drafter eagle3:DIR`"),
                _ => bail!("`speculators_model_type` is {v}: only speculators' \"dflash\" drafters load as DFlash"),
            },
        }
    }

    /// A speculators (0.9) DFlash config: the drafter's shape in `transformer_layer_config`
    /// (a Qwen3 config), the DFlash fields at the top level.
    ///
    /// * `aux_hidden_state_layer_ids` count Hugging Face `hidden_states` (id k = output of
    ///   decoder layer k − 1), so specula's tapped layer is k − 1; 0 (the embeddings) is refused.
    /// * `sample_from_anchor: true` (row k predicts x[P + k + 1], DSpark's convention) is
    ///   refused: specula drafts rows 1.. of the block as x[P + 1]...
    /// * `sliding_window_non_causal` makes sliding layers bidirectional inside the block (full
    ///   layers always are). Sliding layers measure their window as speculators trains them:
    ///   the block sees context rows P − W ..< P for its anchor P, whatever the query (see
    ///   [`LayerAttention::window_from_anchor`]). The per-query rule (q − k < W, what an
    ///   attention kernel's sliding window does) would hide up to B − 1 more of the oldest rows
    ///   from the later block rows; both only differ once the context is longer than W − B.
    /// * `draft_vocab_size` smaller than the vocabulary comes with `d2t` offsets; speculators
    ///   freezes `lm_head` to the target's head rows, so the drafter scores with the target's
    ///   own rows (the stored copy is only checked for its shape).
    /// * `target_hidden_size` must be null or the drafter's width (its `fc` reads taps of that
    ///   width and it embeds with the target's embedding).
    pub fn from_speculators(c: &Value) -> Result<Self> {
        let top = |name: &str| c.get(name).filter(|v| !v.is_null());
        let layer = top("transformer_layer_config")
            .filter(|v| v.is_object())
            .context("a speculators DFlash config needs a `transformer_layer_config` object (the drafter's shape)")?;
        if top("sample_from_anchor").and_then(Value::as_bool) == Some(true) {
            bail!("`sample_from_anchor` is true (the anchor row predicts the next token, DSpark-style): not supported, specula drafts DFlash blocks with the anchor as the last committed token");
        }
        let ids = top("aux_hidden_state_layer_ids")
            .context("`aux_hidden_state_layer_ids` is not set (speculators writes the tapped target layers there)")?
            .as_array()
            .context("`aux_hidden_state_layer_ids` should be a list of layer indices")?;
        if ids.is_empty() || ids.len() > 1024 {
            bail!("`aux_hidden_state_layer_ids` has {} entries (1 to 1024)", ids.len());
        }
        let target_layer_ids = ids
            .iter()
            .map(|v| match as_usize(v, "aux_hidden_state_layer_ids")? {
                0 => bail!("`aux_hidden_state_layer_ids` holds 0, the embedding output (Hugging Face numbering: id k is the output of decoder layer k − 1); DFlash taps decoder layers"),
                k => Ok(k - 1),
            })
            .collect::<Result<Vec<_>>>()?;
        let mask = top("mask_token_id").context("`mask_token_id` is not set")?;
        // The shape fields in the layout the z-lab parser reads, with the DFlash fields speculators
        // keeps at the top level; per-layer settings speculators does not read are dropped.
        let mut flat = layer.clone();
        let obj = flat.as_object_mut().expect("checked to be an object");
        for key in [
            "dflash_config",
            "draft_vocab_size",
            "is_causal",
            "num_target_layers",
            "target_layer_ids",
            "mask_token_id",
            "input_embedding_scale",
            "output_multiplier",
            "final_logit_softcapping",
        ] {
            obj.remove(key);
        }
        obj.insert("architectures".into(), serde_json::json!(["DFlashDraftModel"]));
        obj.insert("block_size".into(), top("block_size").cloned().unwrap_or(8.into()));
        obj.insert(
            "dflash_config".into(),
            serde_json::json!({"mask_token_id": mask, "target_layer_ids": target_layer_ids}),
        );
        if top("sliding_window_non_causal").and_then(Value::as_bool) == Some(true) {
            obj.insert("is_causal".into(), false.into());
        }
        let mut config = Self::from_zlab(&flat).context("`transformer_layer_config`")?;
        config.layout = DflashLayout::Speculators;
        for a in &mut config.layer_attention {
            a.window_from_anchor = a.window.is_some();
        }
        if let Some(v) = top("target_hidden_size") {
            let n = as_usize(v, "target_hidden_size")?;
            if n != config.hidden {
                bail!("`target_hidden_size` {n} is not the drafter's width {}: not supported (the drafter embeds with its target's embedding)", config.hidden);
            }
        }
        let vocab = layer
            .get("vocab_size")
            .filter(|v| !v.is_null())
            .map(|v| as_usize(v, "vocab_size"))
            .transpose()?
            .context("`transformer_layer_config` has no `vocab_size`")?;
        config.draft_vocab_size = match top("draft_vocab_size") {
            None => None,
            Some(v) => match as_usize(v, "draft_vocab_size")? {
                n if n == vocab => None,
                n if n == 0 || n > vocab => bail!("`draft_vocab_size` is {n}, expected 1..={vocab} (`vocab_size`)"),
                n => Some(n),
            },
        };
        Ok(config)
    }

    /// The z-lab layout (see the module docs).
    fn from_zlab(c: &Value) -> Result<Self> {
        let arches: Vec<&str> = c
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if arches.contains(&"DFlash2DraftModel") {
            bail!("DFlash 2 drafters (`DFlash2DraftModel`: convolutions and a candidate selector) are a different method and not supported");
        }
        let dflash = c.get("dflash_config").filter(|v| !v.is_null());
        if !arches.contains(&"DFlashDraftModel") && dflash.is_none() {
            bail!("not a DFlash drafter: `architectures` is {arches:?} (expected \"DFlashDraftModel\") and there is no `dflash_config`");
        }
        // A DFlash field: `dflash_config` first, then the top level (the reference's `_draft_value`).
        let draft_value = |name: &str| -> Option<&Value> {
            dflash.and_then(|d| d.get(name)).or_else(|| c.get(name)).filter(|v| !v.is_null())
        };
        let top = |name: &str| c.get(name).filter(|v| !v.is_null());
        let req_usize = |name: &str| -> Result<usize> {
            as_usize(top(name).with_context(|| format!("config.json is missing `{name}`"))?, name)
        };

        let hidden = req_usize("hidden_size")?;
        let n_layers = req_usize("num_hidden_layers")?;
        let n_heads = req_usize("num_attention_heads")?;
        let n_kv_heads =
            top("num_key_value_heads").map(|v| as_usize(v, "num_key_value_heads")).transpose()?.unwrap_or(n_heads);
        let head_dim = match top("head_dim") {
            Some(v) => as_usize(v, "head_dim")?,
            None if n_heads > 0 => hidden / n_heads,
            None => 0,
        };
        if hidden == 0 || n_layers == 0 {
            bail!("`hidden_size` ({hidden}) and `num_hidden_layers` ({n_layers}) must be positive");
        }
        // Untrusted sizes: bounded before anything (layer lists, weight shapes) is sized by them.
        for (name, v, max) in [
            ("hidden_size", hidden, 1 << 16),
            ("num_hidden_layers", n_layers, 1024),
            ("num_attention_heads", n_heads, 1024),
            ("num_key_value_heads", n_kv_heads, 1024),
            ("head_dim", head_dim, 1024),
        ] {
            if v > max {
                bail!("`{name}` is {v}, more than {max}");
            }
        }
        if n_heads == 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            bail!("invalid head counts: {n_heads} query heads, {n_kv_heads} key/value heads");
        }
        if head_dim == 0 || head_dim % 2 != 0 {
            bail!("invalid `head_dim` {head_dim} (must be positive and even for RoPE)");
        }
        let ffn = req_usize("intermediate_size")?;
        if ffn > 1 << 20 {
            bail!("`intermediate_size` is {ffn}, more than {}", 1 << 20);
        }
        if let Some(act) = top("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                bail!("`hidden_act` is `{act}`; DFlash drafters use silu");
            }
        }
        let rms_eps = top("rms_norm_eps").map(|v| as_f64(v, "rms_norm_eps")).transpose()?.unwrap_or(1e-6);
        // Newer configs nest RoPE settings in `rope_parameters`; only plain RoPE is supported.
        let rope_params = top("rope_parameters");
        let rope_theta = match (top("rope_theta"), rope_params.and_then(|p| p.get("rope_theta"))) {
            (Some(v), _) | (None, Some(v)) => as_f64(v, "rope_theta")?,
            (None, None) => 10_000.0,
        };
        for scaling in [top("rope_scaling"), rope_params] {
            let kind = scaling.and_then(|s| s.get("rope_type").or_else(|| s.get("type"))).and_then(Value::as_str);
            if let Some(kind) = kind.filter(|k| *k != "default") {
                bail!("RoPE scaling `{kind}` is not supported (only plain RoPE)");
            }
        }
        if !(rms_eps.is_finite() && rms_eps > 0.0 && rope_theta.is_finite() && rope_theta > 0.0) {
            bail!("`rms_norm_eps` ({rms_eps}) and `rope_theta` ({rope_theta}) must be positive");
        }
        let attention_bias = top("attention_bias").and_then(Value::as_bool).unwrap_or(false);

        let block_size = draft_value("block_size").map(|v| as_usize(v, "block_size")).transpose()?.unwrap_or(16);
        if !(2..=1024).contains(&block_size) {
            bail!("`block_size` is {block_size}; a block needs the anchor and at least one mask, and at most 1024");
        }
        let mask_token_id = draft_value("mask_token_id")
            .context("config.json has no `mask_token_id` (in `dflash_config` or at the top level)")?;
        let mask_token_id = u32::try_from(as_usize(mask_token_id, "mask_token_id")?)
            .context("`mask_token_id` does not fit in 32 bits")?;
        let num_target_layers =
            draft_value("num_target_layers").map(|v| as_usize(v, "num_target_layers")).transpose()?;
        let target_layer_ids = match draft_value("target_layer_ids") {
            Some(v) => v
                .as_array()
                .context("`target_layer_ids` should be a list of layer indices")?
                .iter()
                .map(|x| as_usize(x, "target_layer_ids"))
                .collect::<Result<Vec<_>>>()?,
            None => {
                let n = num_target_layers.filter(|&n| n <= 1024).context(
                    "config.json has neither `target_layer_ids` nor a `num_target_layers` (at most 1024) to derive them from",
                )?;
                if n < 4 && n_layers > 1 {
                    bail!("`num_target_layers` is {n}: too shallow for the default tapped layers (1..=N−3); give `target_layer_ids`");
                }
                default_target_layer_ids(n, n_layers)
            }
        };
        if target_layer_ids.is_empty() || target_layer_ids.len() > 1024 {
            bail!("`target_layer_ids` has {} entries (1 to 1024)", target_layer_ids.len());
        }

        let layer_attention = Self::parse_layer_attention(c, n_layers)?;
        let scale = |name: &str| draft_value(name).map(|v| as_f64(v, name)).transpose();
        Ok(Self {
            hidden,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn,
            rms_eps,
            rope_theta,
            attention_bias,
            block_size,
            target_layer_ids,
            mask_token_id,
            num_target_layers,
            layer_attention,
            input_embedding_scale: scale("input_embedding_scale")?.unwrap_or(1.0),
            output_multiplier: scale("output_multiplier")?.unwrap_or(1.0),
            final_logit_softcapping: scale("final_logit_softcapping")?.filter(|c| *c > 0.0),
            // SpecForge writes the target's vocabulary size here: that is no reduction.
            draft_vocab_size: match draft_value("draft_vocab_size") {
                None => None,
                Some(v) => {
                    let vocab = top("vocab_size").and_then(Value::as_u64).map(|n| n as usize);
                    Some(as_usize(v, "draft_vocab_size")?).filter(|&n| n > 0 && Some(n) != vocab)
                }
            },
            layout: DflashLayout::ZLab,
        })
    }

    /// Per-layer attention as the reference builds it: `sliding_attention` layers are causal
    /// inside the block and windowed; `full_attention` layers see everything; a top-level
    /// `is_causal` overrides causality for every layer.
    fn parse_layer_attention(c: &Value, n_layers: usize) -> Result<Vec<LayerAttention>> {
        let top = |name: &str| c.get(name).filter(|v| !v.is_null());
        let window = top("sliding_window").map(|v| as_usize(v, "sliding_window")).transpose()?;
        let sliding: Vec<bool> = match top("layer_types") {
            Some(v) => {
                let types = v.as_array().context("`layer_types` should be a list")?;
                if types.len() != n_layers {
                    bail!("`layer_types` has {} entries for {n_layers} layers", types.len());
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("full_attention") => Ok(false),
                        Some("sliding_attention") => Ok(true),
                        _ => bail!("unknown layer type {t} (expected full_attention or sliding_attention)"),
                    })
                    .collect::<Result<_>>()?
            }
            // Without `layer_types`, Qwen3Config derives them from `use_sliding_window`.
            None => {
                let on = top("use_sliding_window").and_then(Value::as_bool).unwrap_or(false) && window.is_some();
                let from =
                    top("max_window_layers").map(|v| as_usize(v, "max_window_layers")).transpose()?.unwrap_or(28);
                (0..n_layers).map(|i| on && i >= from).collect()
            }
        };
        let causal_override = top("is_causal").and_then(Value::as_bool);
        sliding
            .into_iter()
            .map(|is_sliding| {
                let window = if is_sliding {
                    let w =
                        window.context("`layer_types` has sliding_attention layers but `sliding_window` is not set")?;
                    if w == 0 {
                        bail!("`sliding_window` must be positive");
                    }
                    Some(w)
                } else {
                    None
                };
                Ok(LayerAttention { causal: causal_override.unwrap_or(is_sliding), window, window_from_anchor: false })
            })
            .collect()
    }

    /// Checks that this drafter can draft for `target`: same hidden size, tapped layers inside
    /// the target, and a MASK token that is a row of the target's embedding.
    /// A drafter of `n_layers` full-attention layers for `target`, Qwen3-style (the shape every
    /// published DFlash drafter has; `specula train dflash` builds these).
    #[allow(clippy::too_many_arguments)]
    pub fn for_target(
        target: &ModelConfig,
        n_layers: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        ffn: usize,
        block_size: usize,
        target_layer_ids: Vec<usize>,
        mask_token_id: u32,
    ) -> Self {
        Self {
            hidden: target.hidden,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn,
            rms_eps: target.rms_eps,
            rope_theta: target.rope_theta as f64,
            attention_bias: false,
            block_size,
            target_layer_ids,
            mask_token_id,
            num_target_layers: Some(target.n_layers),
            layer_attention: vec![LayerAttention::FULL; n_layers],
            input_embedding_scale: 1.0,
            output_multiplier: 1.0,
            final_logit_softcapping: None,
            draft_vocab_size: None,
            layout: DflashLayout::ZLab,
        }
    }

    /// The z-lab `config.json` for this drafter (what [`Self::from_json`] reads back, and what
    /// the reference package loads), for a target of `vocab_size` tokens. Only full-attention
    /// drafters without scaling are written.
    pub fn to_json(&self, vocab_size: usize, max_positions: usize) -> Result<Value> {
        if self.layer_attention.iter().any(|a| !a.is_full())
            || self.input_embedding_scale != 1.0
            || self.output_multiplier != 1.0
            || self.final_logit_softcapping.is_some()
        {
            bail!("only full-attention drafters without embedding/logit scaling can be written as config.json");
        }
        let mut dflash = serde_json::json!({
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": self.target_layer_ids,
        });
        if let Some(n) = self.draft_vocab_size {
            dflash["draft_vocab_size"] = n.into();
        }
        Ok(serde_json::json!({
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": dflash,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": self.ffn,
            "layer_types": vec!["full_attention"; self.n_layers],
            "max_position_embeddings": max_positions,
            "max_window_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_hidden_layers": self.n_layers,
            "num_key_value_heads": self.n_kv_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_eps,
            "rope_scaling": null,
            "rope_theta": self.rope_theta,
            "sliding_window": null,
            "tie_word_embeddings": false,
            "torch_dtype": "float32",
            "use_cache": true,
            "use_sliding_window": false,
            "vocab_size": vocab_size,
        }))
    }

    pub fn check_target(&self, target: &ModelConfig) -> Result<()> {
        if self.hidden != target.hidden {
            bail!(
                "hidden size mismatch: the drafter's hidden_size is {}, the target's is {} (a DFlash drafter uses the target's embeddings, LM head and hidden states)",
                self.hidden,
                target.hidden
            );
        }
        if let Some(&bad) = self.target_layer_ids.iter().find(|&&l| l >= target.n_layers) {
            bail!(
                "target_layer_ids {:?}: layer {bad} is beyond the target's {} decoder layers (ids are 0-based)",
                self.target_layer_ids,
                target.n_layers
            );
        }
        if self.mask_token_id as usize >= target.vocab {
            bail!(
                "mask_token_id {} is outside the target's vocabulary ({} embedding rows)",
                self.mask_token_id,
                target.vocab
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Sizes no drafter has are refused before anything is allocated for them (a layer count
    /// of 10^14 once sized the per-layer attention list).
    #[test]
    fn sizes_beyond_any_model_are_refused() {
        for (key, value, needle) in [
            ("num_hidden_layers", json!(100_000_000_000_000u64), "num_hidden_layers"),
            ("hidden_size", json!(1u64 << 40), "hidden_size"),
            ("head_dim", json!(1u64 << 20), "head_dim"),
            ("intermediate_size", json!(1u64 << 40), "intermediate_size"),
            ("block_size", json!(1u64 << 40), "block_size"),
            ("rope_theta", json!(-1.0), "rope_theta"),
        ] {
            let mut c = base();
            c[key] = value;
            let err = format!("{:#}", DflashConfig::from_json(&c).unwrap_err());
            assert!(err.contains(needle), "{key}: {err}");
        }
        let mut c = base();
        c["dflash_config"] = json!({"mask_token_id": 5, "num_target_layers": 1u64 << 50});
        assert!(DflashConfig::from_json(&c).is_err());
    }

    fn base() -> Value {
        json!({
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "block_size": 8, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2, 3]}
        })
    }

    #[test]
    fn default_layer_ids_match_the_reference_rule() {
        assert_eq!(default_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(default_target_layer_ids(28, 5), vec![1, 7, 13, 19, 25]);
        assert_eq!(default_target_layer_ids(32, 5), vec![1, 8, 15, 22, 29]);
        assert_eq!(default_target_layer_ids(64, 5), vec![1, 16, 31, 46, 61]);
        assert_eq!(default_target_layer_ids(36, 1), vec![18]);
        // 1 + 3·26/4 = 20.5: Python rounds half to even (20), not away from zero (21).
        assert_eq!(default_target_layer_ids(30, 5), vec![1, 8, 14, 20, 27]);
    }

    #[test]
    fn reads_fields_from_dflash_config_before_the_top_level() {
        let mut c = base();
        c["dflash_config"]["block_size"] = json!(4);
        let cfg = DflashConfig::from_json(&c).unwrap();
        assert_eq!((cfg.block_size, cfg.mask_token_id, cfg.head_dim), (4, 5, 16));
        assert_eq!(cfg.target_layer_ids, vec![0, 2, 3]);
        assert!(cfg.layer_attention.iter().all(LayerAttention::is_full));

        // Without explicit ids they come from num_target_layers and the drafter's depth.
        let mut c = base();
        c["dflash_config"] = json!({"mask_token_id": 5});
        c["num_target_layers"] = json!(36);
        assert_eq!(DflashConfig::from_json(&c).unwrap().target_layer_ids, vec![1, 33]);
    }

    #[test]
    fn sliding_layers_are_causal_and_windowed() {
        let mut c = base();
        c["layer_types"] = json!(["sliding_attention", "full_attention"]);
        c["sliding_window"] = json!(3);
        let cfg = DflashConfig::from_json(&c).unwrap();
        assert_eq!(cfg.layer_attention[0], LayerAttention { causal: true, window: Some(3), window_from_anchor: false });
        assert!(cfg.layer_attention[1].is_full());
        let swa = cfg.layer_attention[0];
        assert!(swa.visible(10, 8, 9) && !swa.visible(10, 7, 9) && !swa.visible(10, 11, 9));
        c["is_causal"] = json!(false);
        let cfg = DflashConfig::from_json(&c).unwrap();
        assert_eq!(
            cfg.layer_attention[0],
            LayerAttention { causal: false, window: Some(3), window_from_anchor: false }
        );
        assert!(cfg.layer_attention[0].visible(10, 12, 9) && !cfg.layer_attention[0].visible(10, 13, 9));
    }

    #[test]
    fn bad_configs_name_the_problem() {
        let err = |c: Value| format!("{:#}", DflashConfig::from_json(&c).unwrap_err());
        let mut c = base();
        c["dflash_config"] = json!({"target_layer_ids": [1]});
        assert!(err(c).contains("mask_token_id"));
        let mut c = base();
        c["architectures"] = json!(["Qwen3ForCausalLM"]);
        c.as_object_mut().unwrap().remove("dflash_config");
        assert!(err(c).contains("not a DFlash drafter"));
        let mut c = base();
        c["architectures"] = json!(["DFlash2DraftModel"]);
        assert!(err(c).contains("DFlash 2"));
        let mut c = base();
        c["dflash_config"] = json!({"mask_token_id": 5});
        assert!(err(c).contains("num_target_layers"));
        let mut c = base();
        c["layer_types"] = json!(["sliding_attention", "full_attention"]);
        assert!(err(c).contains("sliding_window"));
        let mut c = base();
        c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        assert!(err(c).contains("yarn"));
    }

    /// speculators' layout, as `speculators train` writes it (trimmed).
    fn speculators() -> Value {
        json!({
            "architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash",
            "aux_hidden_state_layer_ids": [1, 3], "block_size": 4, "mask_token_id": 255,
            "draft_vocab_size": 128, "sample_from_anchor": false, "sliding_window_non_causal": false,
            "target_hidden_size": null,
            "transformer_layer_config": {
                "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "vocab_size": 256,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2048
            }
        })
    }

    #[test]
    fn reads_the_speculators_layout() {
        let cfg = DflashConfig::from_json(&speculators()).unwrap();
        assert_eq!(cfg.layout, DflashLayout::Speculators);
        assert_eq!((cfg.hidden, cfg.n_layers, cfg.head_dim, cfg.block_size, cfg.mask_token_id), (64, 2, 16, 4, 255));
        assert_eq!(cfg.rope_theta, 10000.0);
        assert_eq!(cfg.target_layer_ids, vec![0, 2]);
        assert_eq!(cfg.draft_vocab_size, Some(128));
        let swa = cfg.layer_attention[0];
        assert_eq!(swa, LayerAttention { causal: true, window: Some(2048), window_from_anchor: true });
        assert!(cfg.layer_attention[1].is_full());
        // The window counts from the anchor (20) over the context, and not inside the block.
        let w3 = LayerAttention { window: Some(3), ..swa };
        assert!(w3.visible(23, 17, 20) && !w3.visible(23, 16, 20) && w3.visible(23, 20, 20) && !w3.visible(21, 22, 20));
        // A full vocabulary is no reduction; non-causal sliding layers.
        let mut c = speculators();
        c["draft_vocab_size"] = json!(256);
        c["sliding_window_non_causal"] = json!(true);
        let cfg = DflashConfig::from_json(&c).unwrap();
        assert_eq!(cfg.draft_vocab_size, None);
        assert!(!cfg.layer_attention[0].causal && cfg.layer_attention[0].window_from_anchor);
        // SpecForge: a top-level draft_vocab_size equal to vocab_size in the z-lab layout.
        let mut c = base();
        c["vocab_size"] = json!(256);
        c["draft_vocab_size"] = json!(256);
        assert_eq!(DflashConfig::from_json(&c).unwrap().draft_vocab_size, None);
        c["draft_vocab_size"] = json!(100);
        assert_eq!(DflashConfig::from_json(&c).unwrap().draft_vocab_size, Some(100));
    }

    #[test]
    fn refuses_speculators_configs_it_cannot_run() {
        let remove = |key: &str| {
            let mut c = speculators();
            c.as_object_mut().unwrap().remove(key);
            c
        };
        let with = |key: &str, v: Value| {
            let mut c = speculators();
            c[key] = v;
            c
        };
        let mut layers = speculators();
        layers["transformer_layer_config"]["num_hidden_layers"] = json!(1u64 << 40);
        let mut no_vocab = speculators();
        no_vocab["transformer_layer_config"].as_object_mut().unwrap().remove("vocab_size");
        let mut no_window = speculators();
        no_window["transformer_layer_config"]["sliding_window"] = Value::Null;
        for (c, why) in [
            (with("sample_from_anchor", json!(true)), "sample_from_anchor"),
            (with("aux_hidden_state_layer_ids", json!([0, 3])), "embedding output"),
            (with("aux_hidden_state_layer_ids", json!([])), "aux_hidden_state_layer_ids"),
            (with("aux_hidden_state_layer_ids", json!("1,3")), "list"),
            (remove("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids"),
            (remove("mask_token_id"), "mask_token_id"),
            (remove("transformer_layer_config"), "transformer_layer_config"),
            (with("transformer_layer_config", json!([1])), "transformer_layer_config"),
            (with("target_hidden_size", json!(128)), "target_hidden_size"),
            (with("draft_vocab_size", json!(300)), "draft_vocab_size"),
            (with("draft_vocab_size", json!(0)), "draft_vocab_size"),
            (with("speculators_model_type", json!("eagle3")), "eagle3:DIR"),
            (with("speculators_model_type", json!("dspark")), "dspark"),
            (layers, "num_hidden_layers"),
            (no_vocab, "vocab_size"),
            (no_window, "sliding_window"),
        ] {
            let err = format!("{:#}", DflashConfig::from_json(&c).unwrap_err());
            assert!(err.contains(why), "{why}: {err}");
        }
    }

    #[test]
    fn target_checks_name_the_problem() {
        let cfg = DflashConfig::from_json(&base()).unwrap();
        let target = ModelConfig {
            arch: crate::model::Arch::Qwen3,
            n_layers: 4,
            hidden: 64,
            ffn: 128,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            vocab: 100,
            context_len: 512,
            rope_theta: 1e6,
            rope_dim: 16,
            rope_style: crate::model::RopeStyle::Halves,
            rms_eps: 1e-6,
            tied_head: false,
            qkv_bias: false,
            qk_norm: true,
            extras: Default::default(),
        };
        cfg.check_target(&target).unwrap();
        let err = |t: &ModelConfig| cfg.check_target(t).unwrap_err().to_string();
        assert!(err(&ModelConfig { hidden: 32, ..target.clone() }).contains("hidden size mismatch"));
        assert!(err(&ModelConfig { n_layers: 3, ..target.clone() }).contains("layer 3 is beyond"));
        assert!(err(&ModelConfig { vocab: 5, ..target.clone() }).contains("mask_token_id 5 is outside"));
    }
}
