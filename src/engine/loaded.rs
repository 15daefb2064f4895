//! A model ready to serve: weights, tokenizer and chat template from one GGUF file.

use crate::model::{GgufFile, HfModelDir, KernelSettings, Transformer, WeightFormat};
use crate::tokenize::{ChatMessage, ChatTemplate, Tokenizer};
use anyhow::{Context, Result};
use candle_core::Device;
use std::path::{Path, PathBuf};

pub struct LoadedModel {
    pub path: PathBuf,
    pub model: Transformer,
    pub tokenizer: Tokenizer,
    /// None when the file has no template and ChatML cannot be assumed.
    pub template: Option<ChatTemplate>,
}

impl LoadedModel {
    /// Loads a GGUF file or a Hugging Face model directory with the environment's kernel
    /// settings ([`KernelSettings::from_env`]); `weights` None picks the measured default for
    /// the file's types.
    pub fn load(path: &Path, weights: Option<WeightFormat>, device: &Device) -> Result<Self> {
        Self::load_with(path, &KernelSettings::from_env().with_weights(weights), device)
    }

    /// [`Self::load`] with explicit kernel settings.
    pub fn load_with(path: &Path, kernels: &KernelSettings, device: &Device) -> Result<Self> {
        if HfModelDir::is_model_dir(path) {
            return Self::load_hf(path, kernels, device);
        }
        let mut file = GgufFile::open(path)?;
        // Architecture first: an unsupported model should say so, not fail on its tokenizer.
        crate::model::ModelConfig::from_gguf(&file.content).with_context(|| format!("{}", path.display()))?;
        let tokenizer = Tokenizer::from_gguf(&file.content)
            .with_context(|| format!("{}: cannot build the tokenizer", path.display()))?;
        let template = ChatTemplate::from_gguf(&file.content).ok();
        let model = Transformer::load(&mut file, kernels, device)?.with_source_path(path);
        model.warm_up()?;
        check_vocab_fits(path, &tokenizer, &model)?;
        Ok(Self { path: path.to_path_buf(), model, tokenizer, template })
    }

    fn load_hf(path: &Path, kernels: &KernelSettings, device: &Device) -> Result<Self> {
        let mut dir = HfModelDir::open(path)?;
        let config = dir.config()?;
        let model_type = dir.config_json["model_type"].as_str().unwrap_or("").to_string();
        let vocab = crate::tokenize::hf_json::content_from_hf_dir(path, &model_type)?;
        let tokenizer =
            Tokenizer::from_gguf(&vocab).with_context(|| format!("{}: cannot build the tokenizer", path.display()))?;
        let template = ChatTemplate::from_gguf(&vocab).ok();
        let model =
            Transformer::load_from(&mut dir, config, kernels.weights.unwrap_or(WeightFormat::Native), kernels, device)?
                .with_source_path(path);
        model.warm_up()?;
        check_vocab_fits(path, &tokenizer, &model)?;
        Ok(Self { path: path.to_path_buf(), model, tokenizer, template })
    }

    /// Token ids of a completion prompt (BOS added when the model asks for it).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text, true)
    }

    /// Token ids of a chat conversation rendered with the model's template.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        self.encode_chat_with(messages, &crate::tokenize::TemplateKwargs::new())
    }

    /// [`Self::encode_chat`] with extra template variables (`{"enable_thinking": false}`).
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        kwargs: &crate::tokenize::TemplateKwargs,
    ) -> Result<Vec<u32>> {
        let template = self.template.as_ref().context("this model has no chat template; use a completion prompt")?;
        let text = template.render_with(messages, true, kwargs)?;
        self.tokenizer.encode(&text, true)
    }

    /// A chat template from source, with this model's BOS/EOS texts and stripping rules.
    pub fn template_from_source(&self, source: &str) -> Result<ChatTemplate> {
        let (bos, eos) = match &self.template {
            Some(t) => (t.bos_token().to_string(), t.eos_token().to_string()),
            None => Default::default(),
        };
        ChatTemplate::from_source(source, &bos, &eos)
    }

    /// What a drafter needs of this model.
    pub fn target(&self) -> crate::speculative::Target<'_> {
        crate::speculative::Target { model: &self.model, tokenizer: &self.tokenizer }
    }

    /// Token ids that end generation: the tokenizer's end-of-sequence / end-of-turn ids.
    pub fn stop_ids(&self) -> Vec<u32> {
        self.tokenizer.stop_ids().to_vec()
    }
}

/// Every token id the tokenizer can produce (prompts, stop tokens) must have a logits column:
/// the files come from different places and nothing else ties them together.
fn check_vocab_fits(path: &Path, tokenizer: &Tokenizer, model: &Transformer) -> Result<()> {
    if tokenizer.vocab_size() > model.config.vocab {
        anyhow::bail!(
            "{}: the tokenizer has {} tokens but the embedding only {} rows",
            path.display(),
            tokenizer.vocab_size(),
            model.config.vocab
        );
    }
    Ok(())
}
