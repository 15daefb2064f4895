//! The EAGLE-3 drafter `config.json`, in two layouts:
//!
//! * the one vLLM, SGLang and SpecForge share (`architectures: ["LlamaForCausalLMEagle3"]`): a
//!   Llama config with one decoder layer plus `draft_vocab_size`, `target_hidden_size`,
//!   `norm_before_residual` and `eagle_config.eagle_aux_hidden_state_layer_ids` (id k = output of
//!   decoder layer k);
//! * speculators' (`speculators_model_type: "eagle3"`, `Eagle3DraftModel`): the layer's shape in
//!   a nested `transformer_layer_config`, the EAGLE-3 fields at the top level, tapped layers in
//!   Hugging Face `hidden_states` numbering, and its options `norm_before_fc`, `fc_norm`,
//!   `norm_output` and sliding-window layers (see [`Eagle3Config::from_speculators`]).
//!
//! Both store `d2t` as offsets (target id = i + d2t[i]) and the same tensors (speculators names
//! the layer `layers.0.` where SpecForge says `midlayer.`).

use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;

/// Architecture names that mean this layout.
pub const ARCHITECTURES: &[&str] = &["LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"];

#[derive(Debug, Clone, PartialEq)]
pub struct Eagle3Config {
    /// The drafter's width H (its embedding and layer width).
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
    /// The target's vocabulary (rows of `embed_tokens` and of `t2d`).
    pub vocab: usize,
    /// Rows of the drafter's own LM head; `d2t` maps them to target ids.
    pub draft_vocab: usize,
    /// The width of the target's hidden states (`fc` takes three of them).
    pub target_hidden: usize,
    /// The target layers whose outputs are fused, as SGLang and SpecForge number them: id k is
    /// the residual stream after decoder layer k (Hugging Face's `hidden_states[k + 1]`).
    /// None: the default for the target's depth N, `[1, N/2 − 1, N − 4]`.
    pub aux_layer_ids: Option<Vec<usize>>,
    /// The residual around attention starts from the normed feature instead of the raw one.
    pub norm_before_residual: bool,
    /// An RMSNorm (`input_norm.weight`, `[3·target_hidden]`) over the concatenated taps before
    /// `fc` (speculators' `norm_before_fc`).
    pub norm_before_fc: bool,
    /// An RMSNorm per tap (`fc_norm.{i}.weight`, `[target_hidden]`) before `fc`, after
    /// `input_norm` when both are on (speculators' `fc_norm`).
    pub fc_norm: bool,
    /// A pass outputs its final-normed state, which is both what the head reads and the next
    /// pass's feature (speculators' `norm_output`); otherwise the pre-norm state is fed back.
    pub norm_output: bool,
    /// A sliding-window layer of this width (speculators' `sliding_attention`): as speculators
    /// trains it, a committed row r sees rows r − W + 1 ..= r, and every row of a draft chain
    /// started from row e − 1 sees rows e − W ..< e plus the chain's own earlier rows (the
    /// window is measured from the row the chain starts at, not from each draft position).
    pub window: Option<usize>,
    /// The drafter trained its own embedding (speculators' `embed_requires_grad`), so the
    /// checkpoint must hold `embed_tokens.weight`.
    pub own_embedding: bool,
}

/// How many target features EAGLE-3 fuses.
pub const N_TAPS: usize = 3;

/// SpecForge's and SGLang's default taps for an `n`-layer target: the outputs of layers 1,
/// n/2 − 1 and n − 4 (Hugging Face's `hidden_states[2, n/2, n − 3]`, vLLM's default too).
pub fn default_aux_layer_ids(n: usize) -> Vec<usize> {
    vec![1.min(n.saturating_sub(1)), (n / 2).saturating_sub(1), n.saturating_sub(4)]
}

fn as_usize(v: &Value, key: &str) -> Result<usize> {
    v.as_u64().map(|n| n as usize).with_context(|| format!("`{key}` should be a non-negative integer, found {v}"))
}

/// Bounds every size a config may ask for, so no allocation is sized by an unchecked field.
const MAX_DIM: usize = 1 << 20;

impl Eagle3Config {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let json: Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_json(&json).with_context(|| format!("{}", path.display()))
    }

    pub fn from_json(c: &Value) -> Result<Self> {
        match c.get("speculators_model_type").filter(|v| !v.is_null()) {
            None => Self::from_published(c),
            Some(v) => match v.as_str() {
                Some("eagle3") => Self::from_speculators(c),
                Some("dflash") => bail!("a speculators DFlash drafter (`speculators_model_type` \"dflash\"): load it with `--drafter dflash:DIR`"),
                _ => bail!("`speculators_model_type` is {v}: only speculators' \"eagle3\" drafters load as EAGLE-3"),
            },
        }
    }

    /// A speculators (0.9) EAGLE-3 config (`Eagle3DraftModel`): the layer's shape in
    /// `transformer_layer_config` (a Llama config, RoPE in `rope_parameters`), the rest at the
    /// top level.
    ///
    /// * `eagle_aux_hidden_state_layer_ids` count Hugging Face `hidden_states` (id k = output
    ///   of decoder layer k − 1): specula's tap is k − 1 (0, the embeddings, is refused); null
    ///   means speculators' default `[2, N/2, N − 3]`, which is specula's default.
    /// * `norm_before_fc`, `fc_norm`, `norm_output`, `norm_before_residual` and
    ///   `embed_requires_grad` are honoured; `target_hidden_size` must be null or the drafter's
    ///   width (speculators' `fc` reads taps of the drafter's width).
    /// * Refused: more than one decoder layer (speculators appends plain decoder layers after
    ///   the first), a layer type other than Llama's (Qwen3 layers add q/k norms), and other
    ///   than three taps.
    /// * `layer_types: ["sliding_attention"]` windows the layer as speculators trains it (see
    ///   [`Self::window`]).
    pub fn from_speculators(c: &Value) -> Result<Self> {
        let top = |name: &str| c.get(name).filter(|v| !v.is_null());
        let layer = top("transformer_layer_config")
            .filter(|v| v.is_object())
            .context("a speculators EAGLE-3 config needs a `transformer_layer_config` object (the layer's shape)")?;
        let ltop = |name: &str| layer.get(name).filter(|v| !v.is_null());
        if let Some(t) = ltop("model_type").and_then(Value::as_str) {
            if t != "llama" {
                bail!("`transformer_layer_config.model_type` is {t:?}: only Llama-style EAGLE-3 layers are supported (speculators' {t:?} layer differs, e.g. Qwen3 adds q/k norms)");
            }
        }
        if let Some(n) = ltop("num_hidden_layers").and_then(Value::as_u64) {
            if n != 1 {
                bail!("`transformer_layer_config.num_hidden_layers` is {n}: only one decoder layer is supported (speculators' extra `layers.1+` are not run by specula)");
            }
        }
        let mut flat = layer.clone();
        let obj = flat.as_object_mut().expect("checked to be an object");
        for key in ["eagle_config", "fc_norm", "draft_vocab_size", "target_hidden_size", "norm_before_residual"] {
            obj.remove(key);
        }
        obj.insert("architectures".into(), json!(["LlamaForCausalLMEagle3"]));
        for key in ["draft_vocab_size", "norm_before_residual"] {
            if let Some(v) = top(key) {
                obj.insert(key.into(), v.clone());
            }
        }
        let mut config = Self::from_published(&flat).context("`transformer_layer_config`")?;
        if let Some(v) = top("target_hidden_size") {
            let n = as_usize(v, "target_hidden_size")?;
            if n != config.hidden {
                bail!("`target_hidden_size` {n} is not the drafter's width {}: not supported (speculators' `fc` reads taps of the drafter's width)", config.hidden);
            }
        }
        config.aux_layer_ids = match top("eagle_aux_hidden_state_layer_ids") {
            None => None,
            Some(Value::Array(a)) => {
                if a.len() != N_TAPS {
                    bail!(
                        "`eagle_aux_hidden_state_layer_ids` has {} entries, specula's EAGLE-3 fuses {N_TAPS}",
                        a.len()
                    );
                }
                let ids = a
                    .iter()
                    .map(|v| match as_usize(v, "eagle_aux_hidden_state_layer_ids")? {
                        0 => bail!("`eagle_aux_hidden_state_layer_ids` holds 0, the embedding output (Hugging Face numbering: id k is the output of decoder layer k − 1)"),
                        k => Ok(k - 1),
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some(ids)
            }
            Some(v) => bail!("`eagle_aux_hidden_state_layer_ids` should be a list, found {v}"),
        };
        let flag = |name: &str| -> Result<bool> {
            match top(name) {
                None => Ok(false),
                Some(v) => v.as_bool().with_context(|| format!("`{name}` should be true or false, found {v}")),
            }
        };
        config.norm_before_fc = flag("norm_before_fc")?;
        config.fc_norm = flag("fc_norm")?;
        config.norm_output = flag("norm_output")?;
        config.own_embedding = flag("embed_requires_grad")?;
        config.window = match ltop("layer_types") {
            None => None,
            Some(v) => {
                let types = v.as_array().context("`layer_types` should be a list")?;
                match types.iter().map(Value::as_str).collect::<Vec<_>>().as_slice() {
                    [Some("full_attention")] => None,
                    [Some("sliding_attention")] => {
                        let w = ltop("sliding_window")
                            .context("`layer_types` is sliding_attention but `sliding_window` is not set")?;
                        match as_usize(w, "sliding_window")? {
                            0 => bail!("`sliding_window` must be positive"),
                            w => Some(w),
                        }
                    }
                    _ => bail!("`layer_types` is {v}, expected one of [\"full_attention\"] or [\"sliding_attention\"]"),
                }
            }
        };
        Ok(config)
    }

    /// The layout vLLM, SGLang and SpecForge share.
    fn from_published(c: &Value) -> Result<Self> {
        let arches: Vec<&str> = c
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if !arches.iter().any(|a| ARCHITECTURES.contains(a)) {
            bail!("not an EAGLE-3 drafter: `architectures` is {arches:?} (expected \"LlamaForCausalLMEagle3\")");
        }
        let top = |name: &str| c.get(name).filter(|v| !v.is_null());
        let req = |name: &str| -> Result<usize> {
            let n = as_usize(top(name).with_context(|| format!("config.json is missing `{name}`"))?, name)?;
            if n == 0 || n > MAX_DIM {
                bail!("`{name}` is {n}, expected 1..={MAX_DIM}");
            }
            Ok(n)
        };
        let opt = |name: &str| -> Result<Option<usize>> {
            top(name)
                .map(|v| {
                    let n = as_usize(v, name)?;
                    if n == 0 || n > MAX_DIM {
                        bail!("`{name}` is {n}, expected 1..={MAX_DIM}");
                    }
                    Ok(n)
                })
                .transpose()
        };
        let layers = req("num_hidden_layers")?;
        if layers != 1 {
            bail!("an EAGLE-3 drafter has one decoder layer, this config says {layers}");
        }
        let hidden = req("hidden_size")?;
        let n_heads = req("num_attention_heads")?;
        let n_kv_heads = opt("num_key_value_heads")?.unwrap_or(n_heads);
        let head_dim = opt("head_dim")?.unwrap_or(hidden / n_heads);
        if n_heads % n_kv_heads != 0 || head_dim == 0 || head_dim % 2 != 0 || n_heads * head_dim > MAX_DIM {
            bail!("invalid attention shape: {n_heads} query heads, {n_kv_heads} key/value heads, head_dim {head_dim}");
        }
        let vocab = req("vocab_size")?;
        let draft_vocab = opt("draft_vocab_size")?.unwrap_or(vocab);
        if draft_vocab > vocab {
            bail!("`draft_vocab_size` {draft_vocab} is larger than `vocab_size` {vocab}");
        }
        if let Some(act) = top("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                bail!("`hidden_act` {act:?} is not supported (EAGLE-3 drafters use silu)");
            }
        }
        if top("attention_bias").and_then(Value::as_bool) == Some(true)
            || top("mlp_bias").and_then(Value::as_bool) == Some(true)
        {
            bail!("biased projections (`attention_bias`/`mlp_bias`) are not supported");
        }
        if top("fc_norm").and_then(Value::as_bool) == Some(true) {
            bail!("`fc_norm` (per-tap norms before `fc`) is not supported");
        }
        if let Some(s) = top("rope_scaling") {
            let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
            if kind != "default" {
                bail!("`rope_scaling` of type {kind:?} is not supported");
            }
        }
        let aux_layer_ids = match c.get("eagle_config").and_then(|e| e.get("eagle_aux_hidden_state_layer_ids")) {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => {
                let ids =
                    a.iter().map(|v| as_usize(v, "eagle_aux_hidden_state_layer_ids")).collect::<Result<Vec<_>>>()?;
                if ids.len() != N_TAPS {
                    bail!("`eagle_aux_hidden_state_layer_ids` has {} entries, EAGLE-3 fuses {N_TAPS}", ids.len());
                }
                Some(ids)
            }
            Some(v) => bail!("`eagle_aux_hidden_state_layer_ids` should be a list, found {v}"),
        };
        // Newer configs (transformers 5) keep RoPE in `rope_parameters`; only plain RoPE runs.
        if let Some(p) = top("rope_parameters") {
            let kind = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str).unwrap_or("default");
            if kind != "default" {
                bail!("`rope_parameters` of type {kind:?} is not supported");
            }
        }
        let rms_eps = top("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6);
        let rope_theta = top("rope_theta")
            .or_else(|| top("rope_parameters").and_then(|p| p.get("rope_theta")))
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0);
        if !(rms_eps.is_finite() && rms_eps > 0.0 && rope_theta.is_finite() && rope_theta > 0.0) {
            bail!("`rms_norm_eps` ({rms_eps}) and `rope_theta` ({rope_theta}) must be positive");
        }
        Ok(Self {
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn: req("intermediate_size")?,
            rms_eps,
            rope_theta,
            vocab,
            draft_vocab,
            target_hidden: opt("target_hidden_size")?.unwrap_or(hidden),
            aux_layer_ids,
            norm_before_residual: top("norm_before_residual").and_then(Value::as_bool).unwrap_or(false),
            norm_before_fc: false,
            fc_norm: false,
            norm_output: false,
            window: None,
            own_embedding: false,
        })
    }

    /// Whether it uses an option of speculators' layout that the published layout cannot
    /// express ([`Self::to_json`] would drop it).
    pub fn uses_speculators_options(&self) -> bool {
        self.norm_before_fc || self.fc_norm || self.norm_output || self.window.is_some() || self.own_embedding
    }

    /// The config as the published layout writes it (without speculators' options: see
    /// [`Self::uses_speculators_options`]).
    pub fn to_json(&self) -> Value {
        let mut c = json!({
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": 32768,
            "vocab_size": self.vocab,
            "draft_vocab_size": self.draft_vocab,
            "target_hidden_size": self.target_hidden,
            "norm_before_residual": self.norm_before_residual,
            "tie_word_embeddings": false,
            "torch_dtype": "float16",
        });
        if let Some(ids) = &self.aux_layer_ids {
            c["eagle_config"] = json!({ "use_aux_hidden_state": true, "eagle_aux_hidden_state_layer_ids": ids });
        }
        c
    }

    /// The target layers tapped for an `n_layers`-deep target.
    pub fn tap_layers(&self, n_layers: usize) -> Vec<usize> {
        self.aux_layer_ids.clone().unwrap_or_else(|| default_aux_layer_ids(n_layers))
    }

    /// Refuses a target this drafter cannot draft for, naming the mismatch.
    pub fn check_target(&self, target: &ModelConfig) -> Result<()> {
        if self.target_hidden != target.hidden {
            bail!(
                "hidden size mismatch: the drafter fuses target states of width {}, the target's is {}",
                self.target_hidden,
                target.hidden
            );
        }
        if self.vocab != target.vocab {
            bail!(
                "vocabulary mismatch: the drafter's vocab_size is {}, the target has {} tokens",
                self.vocab,
                target.vocab
            );
        }
        let taps = self.tap_layers(target.n_layers);
        if let Some(&bad) = taps.iter().find(|&&l| l >= target.n_layers) {
            bail!(
                "eagle_aux_hidden_state_layer_ids {taps:?}: layer {bad} is beyond the target's {} decoder layers",
                target.n_layers
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        json!({
            "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
            "vocab_size": 300, "draft_vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}
        })
    }

    #[test]
    fn reads_the_published_layout_and_writes_it_back() {
        let c = Eagle3Config::from_json(&base()).unwrap();
        assert_eq!((c.hidden, c.head_dim, c.draft_vocab, c.target_hidden), (64, 16, 100, 64));
        assert_eq!(c.aux_layer_ids, Some(vec![0, 2, 3]));
        assert!(!c.norm_before_residual);
        assert_eq!(Eagle3Config::from_json(&c.to_json()).unwrap(), c);
    }

    #[test]
    fn refuses_what_it_cannot_run() {
        for (key, value, why) in [
            ("num_hidden_layers", json!(2), "one decoder layer"),
            ("draft_vocab_size", json!(400), "larger than"),
            ("hidden_act", json!("gelu"), "hidden_act"),
            ("architectures", json!(["LlamaForCausalLM"]), "not an EAGLE-3"),
            ("hidden_size", json!(1u64 << 40), "hidden_size"),
            ("eagle_config", json!({"eagle_aux_hidden_state_layer_ids": [1, 2]}), "fuses 3"),
            ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0}), "yarn"),
        ] {
            let mut c = base();
            c[key] = value;
            let err = format!("{:#}", Eagle3Config::from_json(&c).unwrap_err());
            assert!(err.contains(why), "{key}: {err}");
        }
    }

    /// speculators' layout, as `speculators train` writes it (trimmed).
    fn speculators() -> Value {
        json!({
            "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
            "draft_vocab_size": 128, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
            "embed_requires_grad": false, "fc_norm": false, "norm_before_fc": true,
            "norm_before_residual": true, "norm_output": true, "target_hidden_size": null,
            "transformer_layer_config": {
                "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "vocab_size": 256,
                "layer_types": ["sliding_attention"], "sliding_window": 2048, "mlp_bias": false
            }
        })
    }

    #[test]
    fn reads_the_speculators_layout() {
        let c = Eagle3Config::from_json(&speculators()).unwrap();
        assert_eq!((c.hidden, c.head_dim, c.vocab, c.draft_vocab, c.target_hidden), (64, 16, 256, 128, 64));
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.aux_layer_ids, Some(vec![0, 1, 2]));
        assert!(c.norm_before_residual && c.norm_before_fc && c.norm_output && !c.fc_norm && !c.own_embedding);
        assert_eq!(c.window, Some(2048));
        assert!(c.uses_speculators_options());
        let mut j = speculators();
        j["eagle_aux_hidden_state_layer_ids"] = Value::Null;
        j["transformer_layer_config"]["layer_types"] = json!(["full_attention"]);
        j["fc_norm"] = json!(true);
        let c = Eagle3Config::from_json(&j).unwrap();
        assert_eq!((c.aux_layer_ids.clone(), c.window, c.fc_norm), (None, None, true));
        assert_eq!(c.tap_layers(28), default_aux_layer_ids(28), "speculators' default [2, N/2, N-3] − 1");
        let names: Vec<String> =
            crate::speculative::eagle3::model::expected_tensors(&c).into_iter().map(|t| t.0).collect();
        for n in ["input_norm.weight", "fc_norm.0.weight", "fc_norm.2.weight"] {
            assert!(names.iter().any(|x| x == n), "{n}");
        }
    }

    #[test]
    fn refuses_speculators_configs_it_cannot_run() {
        let with = |key: &str, v: Value| {
            let mut c = speculators();
            c[key] = v;
            c
        };
        let layer = |key: &str, v: Value| {
            let mut c = speculators();
            c["transformer_layer_config"][key] = v;
            c
        };
        for (c, why) in [
            (with("eagle_aux_hidden_state_layer_ids", json!([0, 1, 2])), "embedding output"),
            (with("eagle_aux_hidden_state_layer_ids", json!([1, 2, 3, 4])), "fuses 3"),
            (with("eagle_aux_hidden_state_layer_ids", json!(3)), "list"),
            (with("target_hidden_size", json!(128)), "target_hidden_size"),
            (with("norm_output", json!("yes")), "norm_output"),
            (with("transformer_layer_config", Value::Null), "transformer_layer_config"),
            (with("speculators_model_type", json!("dflash")), "dflash:DIR"),
            (with("speculators_model_type", json!("mtp")), "mtp"),
            (layer("model_type", json!("qwen3")), "qwen3"),
            (layer("num_hidden_layers", json!(2)), "only one decoder layer"),
            (layer("layer_types", json!(["sliding_attention", "full_attention"])), "layer_types"),
            (layer("sliding_window", Value::Null), "sliding_window"),
            (layer("sliding_window", json!(0)), "sliding_window"),
            (layer("rope_parameters", json!({"rope_type": "llama3", "rope_theta": 1.0})), "llama3"),
            (layer("hidden_size", json!(1u64 << 40)), "hidden_size"),
            (layer("vocab_size", json!(100)), "draft_vocab_size"),
        ] {
            let err = format!("{:#}", Eagle3Config::from_json(&c).unwrap_err());
            assert!(err.contains(why), "{why}: {err}");
        }
    }

    #[test]
    fn default_taps_follow_specforge() {
        assert_eq!(default_aux_layer_ids(30), vec![1, 14, 26]);
        assert_eq!(default_aux_layer_ids(28), vec![1, 13, 24]);
    }
}
