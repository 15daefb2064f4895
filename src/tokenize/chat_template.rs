//! Chat templates: the Jinja template stored in the GGUF (`tokenizer.chat_template`),
//! rendered with minijinja the way Hugging Face and llama.cpp render it.
//!
//! HF renders with `trim_blocks` and `lstrip_blocks`, passes `messages`,
//! `add_generation_prompt`, `bos_token` and `eos_token`, and offers `raise_exception`;
//! templates also call Python string methods (`.strip()`, `.startswith()`), which
//! `minijinja-contrib`'s pycompat layer provides. Like llama.cpp, a BOS (EOS) the template
//! writes itself is stripped when the tokenizer adds one anyway, so it is not doubled.

use std::collections::BTreeMap;

use anyhow::{anyhow, bail, Result};
use candle_core::quantized::gguf_file::Content;
use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value};

use super::gguf_bpe::{metadata_opt_string, GgufVocab};

const TEMPLATE_NAME: &str = "chat";

/// ChatML, used only for GGUFs without a template whose vocabulary has `<|im_start|>`.
const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Extra variables a chat template may read, as vLLM's and llama.cpp's `chat_template_kwargs`:
/// `{"enable_thinking": false}` turns Qwen3's thinking off.
pub type TemplateKwargs = serde_json::Map<String, serde_json::Value>;

/// Parses `--chat-template-kwargs` (a JSON object).
pub fn parse_template_kwargs(text: &str) -> Result<TemplateKwargs> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => bail!("chat template kwargs must be a JSON object, like {{\"enable_thinking\": false}}"),
        Err(e) => bail!("chat template kwargs are not valid JSON: {e}"),
    }
}

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Where the template came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateOrigin {
    /// `tokenizer.chat_template` in the GGUF.
    Gguf,
    /// Built-in ChatML (the GGUF had no template).
    ChatMlFallback,
}

/// A compiled chat template plus the special-token texts it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    origin: TemplateOrigin,
    bos_token: String,
    eos_token: String,
    /// The tokenizer adds BOS/EOS itself; strip the template's copy (as llama.cpp does).
    strip_bos: bool,
    strip_eos: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("source_len", &self.source.len())
            .finish()
    }
}

/// Instructions one render may run: real templates take a few thousand per message, so a
/// conversation of thousands of messages fits, and a template that loops for ever stops
/// with an error within about a second.
const TEMPLATE_FUEL: u64 = 20_000_000;

impl ChatTemplate {
    /// Reads `tokenizer.chat_template`; without one, falls back to ChatML only if the
    /// vocabulary has `<|im_start|>`.
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let vocab = GgufVocab::read(content)?;
        let token_text = |id: Option<u32>| id.map(|id| vocab.rendered_text(id)).unwrap_or_default();
        let bos_token = token_text(vocab.bos);
        let eos_token = token_text(vocab.eos);
        let (source, origin) = match metadata_opt_string(content, "tokenizer.chat_template")? {
            Some(source) => (source, TemplateOrigin::Gguf),
            None if vocab.texts.iter().any(|t| t == "<|im_start|>") => {
                (CHATML_TEMPLATE.to_string(), TemplateOrigin::ChatMlFallback)
            }
            None => bail!(
                "the GGUF has no chat template (tokenizer.chat_template) and its vocabulary has no \
                 <|im_start|> token, so ChatML cannot be assumed; use plain completion instead"
            ),
        };
        let mut template = Self::from_source(&source, &bos_token, &eos_token)?;
        template.origin = origin;
        template.strip_bos = vocab.add_bos;
        template.strip_eos = vocab.add_eos;
        Ok(template)
    }

    /// Compiles a template from source (no BOS/EOS stripping).
    pub fn from_source(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| anyhow!("configuring template syntax: {e}"))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // Templates are code from a downloaded file: nested loops could run for hours.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| anyhow!("chat template does not compile: {e:#}"))?;
        Ok(Self {
            env,
            source: source.to_string(),
            origin: TemplateOrigin::Gguf,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            strip_bos: false,
            strip_eos: false,
        })
    }

    /// Renders a conversation into the prompt text to encode with `add_special = true`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &TemplateKwargs::new())
    }

    /// [`Self::render`] with extra template variables (`enable_thinking` and the like).
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &TemplateKwargs,
    ) -> Result<String> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut map = BTreeMap::new();
                map.insert("role".to_string(), Value::from(m.role.as_str()));
                map.insert("content".to_string(), Value::from(m.content.as_str()));
                Value::from(map)
            })
            .collect();
        self.render_values(Value::from(messages), None, add_generation_prompt, kwargs)
    }

    /// Renders OpenAI-style JSON messages (and optional `tools`), for requests whose messages
    /// carry more than role and content.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        kwargs: &TemplateKwargs,
    ) -> Result<String> {
        if !messages.is_array() {
            bail!("chat messages must be a JSON array");
        }
        self.render_values(json_to_value(messages), tools.map(json_to_value), add_generation_prompt, kwargs)
    }

    fn render_values(
        &self,
        messages: Value,
        tools: Option<Value>,
        add_generation_prompt: bool,
        kwargs: &TemplateKwargs,
    ) -> Result<String> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| anyhow!("chat template missing: {e}"))?;
        // The caller's variables first: the ones named here take precedence.
        let extra = json_to_value(&serde_json::Value::Object(kwargs.clone()));
        let ctx = minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            ..extra
        };
        let mut text = template.render(ctx).map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => anyhow!("chat template refused the messages: {e}"),
            _ => anyhow!("rendering chat template: {e:#}"),
        })?;
        if self.strip_bos && !self.bos_token.is_empty() && text.starts_with(&self.bos_token) {
            text.drain(..self.bos_token.len());
        }
        if self.strip_eos && !self.eos_token.is_empty() && text.ends_with(&self.eos_token) {
            text.truncate(text.len() - self.eos_token.len());
        }
        Ok(text)
    }

    pub fn origin(&self) -> TemplateOrigin {
        self.origin
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }
}

/// `raise_exception(msg)` from HF templates: aborts rendering with the template's message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn json_to_value(json: &serde_json::Value) -> Value {
    match json {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(items) => items.iter().map(json_to_value).collect(),
        serde_json::Value::Object(map) => {
            Value::from(map.iter().map(|(k, v)| (k.clone(), json_to_value(v))).collect::<BTreeMap<String, Value>>())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenize::gguf_bpe::tests::toy_content;
    use crate::tokenize::test_models;
    use candle_core::quantized::gguf_file::Value as GgufValue;

    /// Shaped like the HF templates: whitespace control via trim/lstrip_blocks, a Python
    /// string method, `raise_exception`, and `bos_token`.
    const HF_STYLE: &str = "{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if message.content.strip().startswith('/') %}
<cmd>{{ message['content'].strip() | upper }}</cmd>
    {% else %}
[{{ message.role }}] {{ message.content.strip() }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[assistant]{% endif %}";

    #[test]
    fn renders_hf_style_templates_with_trim_and_lstrip_blocks() {
        let template = ChatTemplate::from_source(HF_STYLE, "<s>", "</s>").unwrap();
        let messages = [ChatMessage::system("  be brief "), ChatMessage::user("/help")];
        let text = template.render(&messages, true).unwrap();
        assert_eq!(text, "<s>\n[system] be brief\n<cmd>/HELP</cmd>\n[assistant]");
        let text = template.render(&messages[..1], false).unwrap();
        assert_eq!(text, "<s>\n[system] be brief\n");
    }

    #[test]
    fn raise_exception_surfaces_the_template_message() {
        let template = ChatTemplate::from_source(HF_STYLE, "<s>", "</s>").unwrap();
        let err = template.render(&[ChatMessage::new("tool", "x")], true).unwrap_err();
        assert!(err.to_string().contains("Unknown role: tool"), "{err}");
    }

    #[test]
    fn template_syntax_errors_are_reported_at_load() {
        let err = ChatTemplate::from_source("{% for m in messages %}", "", "").unwrap_err();
        assert!(err.to_string().contains("chat template does not compile"), "{err}");
    }

    #[test]
    fn bos_written_by_the_template_is_not_doubled_when_the_tokenizer_adds_one() {
        // The toy GGUF has add_bos_token = true with BOS = <|im_start|>.
        let content = toy_content("gpt2", Some("smollm"), Some("{{ bos_token }}hi {{ messages[0].content }}"));
        let template = ChatTemplate::from_gguf(&content).unwrap();
        assert_eq!(template.bos_token(), "<|im_start|>");
        assert_eq!(template.render(&[ChatMessage::user("there")], false).unwrap(), "hi there");
    }

    #[test]
    fn falls_back_to_chatml_only_when_the_vocab_has_im_start() {
        let content = toy_content("gpt2", Some("smollm"), None);
        let template = ChatTemplate::from_gguf(&content).unwrap();
        assert_eq!(template.origin(), TemplateOrigin::ChatMlFallback);
        let text = template.render(&[ChatMessage::system("s"), ChatMessage::user("u")], true).unwrap();
        let chatml = "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n";
        // The toy tokenizer adds BOS = <|im_start|> itself, so the template's copy is dropped
        // and encoding with add_special restores exactly the ChatML token sequence.
        assert_eq!(Some(text.as_str()), chatml.strip_prefix("<|im_start|>"));
        let tokenizer = crate::tokenize::Tokenizer::from_gguf(&content).unwrap();
        assert_eq!(tokenizer.encode(&text, true).unwrap(), tokenizer.encode(chatml, false).unwrap());

        let mut content = toy_content("gpt2", Some("smollm"), None);
        let Some(GgufValue::Array(tokens)) = content.metadata.get_mut("tokenizer.ggml.tokens") else {
            panic!("toy tokens")
        };
        for token in tokens.iter_mut() {
            if matches!(token, GgufValue::String(t) if t == "<|im_start|>") {
                *token = GgufValue::String("<|begin|>".into());
            }
        }
        let err = ChatTemplate::from_gguf(&content).unwrap_err();
        assert!(err.to_string().contains("no chat template"), "{err}");
    }

    #[test]
    fn render_json_accepts_openai_style_messages() {
        let template = ChatTemplate::from_source(CHATML_TEMPLATE, "", "").unwrap();
        let messages = serde_json::json!([{"role": "user", "content": "hi", "name": "x"}]);
        let text = template.render_json(&messages, None, true, &TemplateKwargs::new()).unwrap();
        assert_eq!(text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        assert!(template
            .render_json(&serde_json::json!({"role": "user"}), None, true, &TemplateKwargs::new())
            .is_err());
    }

    #[test]
    fn chat_prompt_token_counts_match_llama_cpp() {
        for (key, model, counts) in test_models::all_available() {
            assert_eq!(model.template.as_ref().unwrap().origin(), TemplateOrigin::Gguf, "{key}");
            for case in counts.iter().filter(|c| c.chat) {
                let text = model.template.as_ref().unwrap().render(&[ChatMessage::user(case.prompt)], true).unwrap();
                let ids = model.tokenizer.encode(&text, true).unwrap();
                assert_eq!(ids.len(), case.prompt_tokens, "{key}: {text:?}");
            }
        }
    }

    #[test]
    fn smollm2_template_adds_its_default_system_message() {
        let Some(model) = test_models::smollm2() else {
            return;
        };
        let messages = [ChatMessage::user("What is 12 * 7? Answer briefly.")];
        let text = model.template.as_ref().unwrap().render(&messages, true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
             Face<|im_end|>\n<|im_start|>user\nWhat is 12 * 7? Answer briefly.<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        assert_eq!(model.tokenizer.encode(&text, true).unwrap().len(), 42);
    }

    /// Qwen3's, Gemma 3's and Llama 3.1's published templates render as Hugging Face's jinja2
    /// renders them (`tests/fixtures/chat-templates/`, made by
    /// `tools/chat_template_reference/render.py`): Qwen3 with thinking on, off and unset and an
    /// earlier reasoning turn; Gemma 3 folding the system message into the first turn and
    /// refusing roles that do not alternate; Llama 3.1's system header with its default date.
    #[test]
    fn published_templates_and_the_thinking_switch_render_as_jinja2_does() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat-templates");
        for (name, bos, eos) in
            [("qwen3", "", "<|im_end|>"), ("gemma3", "<bos>", "<eos>"), ("llama3.1", "<|begin_of_text|>", "<|eot_id|>")]
        {
            let source = std::fs::read_to_string(dir.join(format!("{name}.jinja"))).unwrap();
            let template = ChatTemplate::from_source(&source, bos, eos).unwrap();
            let expected: serde_json::Value =
                serde_json::from_slice(&std::fs::read(dir.join(format!("{name}-expected.json"))).unwrap()).unwrap();
            let cases = expected["cases"].as_array().unwrap();
            assert_eq!(cases.len(), 4, "{name}");
            for case in cases {
                let kwargs = case["kwargs"].as_object().unwrap();
                let tools = case.get("tools").filter(|t| !t.is_null());
                let text = template.render_json(&case["messages"], tools, true, kwargs).unwrap();
                assert_eq!(text, case["text"].as_str().unwrap(), "{name} {kwargs:?}");
            }
        }
        let qwen3 = std::fs::read_to_string(dir.join("qwen3.jinja")).unwrap();
        let template = ChatTemplate::from_source(&qwen3, "", "<|im_end|>").unwrap();
        let off = parse_template_kwargs(r#"{"enable_thinking": false}"#).unwrap();
        let text = template.render_with(&[ChatMessage::user("hi")], true, &off).unwrap();
        assert!(text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{text:?}");
        assert!(parse_template_kwargs("[1]").is_err() && parse_template_kwargs("{").is_err());
        let gemma3 = std::fs::read_to_string(dir.join("gemma3.jinja")).unwrap();
        let template = ChatTemplate::from_source(&gemma3, "<bos>", "<eos>").unwrap();
        let err = template.render(&[ChatMessage::user("a"), ChatMessage::user("b")], true).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }
}
