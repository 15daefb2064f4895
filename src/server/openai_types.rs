//! OpenAI request bodies → validated settings, and engine results → OpenAI response bodies.
//!
//! Requests are read field by field from a JSON value (not a derived struct) so each wrong
//! field gets its own 400 naming it, `null` means "not given" like in OpenAI's API, and fields
//! this server ignores (`user`, `metadata`, …) do no harm.

use super::api_error::ApiError;
use crate::engine::{FinishReason, TokenChunk, TokenLogprob, TokenSource, Usage};
use crate::grammar::GrammarSpec;
use crate::sample::SamplingParams;
use crate::tokenize::{ChatMessage, Tokenizer};
use serde_json::{json, Map, Value};

/// Which API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    pub fn label(&self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completion => "completion",
        }
    }
}

/// The prompt as given.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
    Chat(Vec<ChatMessage>),
    /// Chat with tool calls or tool results in it, or `tools` to offer: the messages as
    /// OpenAI-style JSON (role, content, `tool_calls`, `tool_call_id`, `name`) for the template.
    ChatJson(Value),
}

/// Which tool the model must call (`tool_choice`).
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// The model decides (OpenAI's default when `tools` are given).
    Auto,
    /// No call: the tools are not shown to the model.
    None,
    /// Some call, forced by a grammar.
    Required,
    /// This function, forced by a grammar.
    Function(String),
}

/// A parsed, type-checked request (ranges that depend on the prompt are checked later).
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    /// Chat: one. Completions: one or more (`prompt` as a list of strings or of token-id
    /// lists); each gets `n` choices, prompt `p`'s choice `i` at index `p·n + i`, as OpenAI
    /// numbers them.
    pub prompts: Vec<PromptInput>,
    /// `max_tokens` is `None` when not given.
    pub params: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
    /// Extension: `"speculate": false` turns the server's drafter off for this request.
    pub speculate: bool,
    /// Extension (as in vLLM): `"ignore_eos": true` generates past end-of-sequence tokens,
    /// up to `max_tokens` (for benchmarks that want fixed lengths).
    pub ignore_eos: bool,
    /// Extension (as in vLLM, SGLang and llama.cpp): variables for the chat template, e.g.
    /// `{"enable_thinking": false}`.
    pub chat_template_kwargs: crate::tokenize::TemplateKwargs,
    /// Choices to generate, each sampled (and speculated) on its own.
    pub n: usize,
    /// Log-probs of the output tokens with this many alternatives (chat: `logprobs: true` and
    /// `top_logprobs`; completions: `logprobs: N`).
    pub logprobs: Option<usize>,
    /// Completions: the prompt is returned before the output (with its log-probs when
    /// `logprobs` is set).
    pub echo: bool,
    /// Structured outputs: `response_format` (`json_object`, `json_schema`) or, as in vLLM,
    /// `structured_outputs` (`json`, `regex`, `choice`, `grammar`), with the field it came in.
    pub grammar: Option<(GrammarSpec, &'static str)>,
    /// Chat: the functions the model may call (OpenAI's `tools`, as given).
    pub tools: Vec<Value>,
    pub tool_choice: ToolChoice,
}

/// Most stop strings per request.
pub const MAX_STOP_STRINGS: usize = 16;
/// Most choices per request (`n`).
pub const MAX_CHOICES: usize = 16;
/// Most choices over all of a request's prompts (prompts × `n`).
pub const MAX_CHOICES_ALL_PROMPTS: usize = 64;

/// Parses a request body (already known to be within the size limit).
pub fn parse_request(body: &[u8], endpoint: Endpoint) -> Result<CompletionRequest, ApiError> {
    let obj = json_object(body)?;
    let f = Fields(&obj);

    let model = f.string("model")?;
    let (tools, tool_choice) = parse_tools(&f, endpoint)?;
    let prompts = match endpoint {
        Endpoint::Chat => {
            let messages = parse_messages(obj.get("messages"))?;
            let uses_tools = !tools.is_empty() && tool_choice != ToolChoice::None;
            vec![match tool_messages(obj.get("messages"), &messages)? {
                Some(json) => PromptInput::ChatJson(json),
                None if uses_tools => PromptInput::ChatJson(messages_json(&messages)),
                None => PromptInput::Chat(messages),
            }]
        }
        Endpoint::Completion => parse_prompts(obj.get("prompt"))?,
    };
    let n = match f.integer("n")? {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
        Some(n) => return Err(ApiError::invalid("n", format!("`n` must be between 1 and {MAX_CHOICES}, got {n}"))),
    };
    if prompts.len() * n > MAX_CHOICES_ALL_PROMPTS {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "{} prompts × n = {n} is {} choices; at most {MAX_CHOICES_ALL_PROMPTS} per request",
                prompts.len(),
                prompts.len() * n
            ),
        ));
    }
    if let Some(b) = f.integer("best_of")? {
        if b != n as i64 {
            return Err(ApiError::invalid(
                "best_of",
                format!("`best_of` other than `n` is not supported (got best_of = {b}, n = {n}); use n"),
            ));
        }
    }
    let chat_template_kwargs = match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => Default::default(),
        Some(Value::Object(map)) => map.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                "chat_template_kwargs",
                "`chat_template_kwargs` must be an object, like {\"enable_thinking\": false}",
            ))
        }
    };
    let echo = f.boolean("echo")?.unwrap_or(false);
    if echo && endpoint == Endpoint::Chat {
        return Err(ApiError::invalid("echo", "`echo` is a completions parameter"));
    }
    let logprobs = parse_logprobs(&f, endpoint)?;
    let grammar = parse_grammar(&f)?;

    let mut max_tokens = f.integer("max_tokens")?;
    if let Some(m) = f.integer("max_completion_tokens")? {
        max_tokens = Some(m);
    }
    let param_name = if obj.get("max_completion_tokens").is_some_and(|v| !v.is_null()) {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_tokens = match max_tokens {
        None => None,
        Some(m) if m <= 0 => {
            return Err(ApiError::invalid(param_name, format!("`{param_name}` must be at least 1, got {m}")))
        }
        Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
    };

    let temperature = f.number("temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid("temperature", format!("`temperature` must be in [0, 2], got {temperature}")));
    }
    let top_k = match f.integer("top_k")? {
        None | Some(-1) => 0,
        Some(k) if k < 0 => {
            return Err(ApiError::invalid("top_k", format!("`top_k` must be >= 0 (or -1 = off), got {k}")))
        }
        Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
    };
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Some(u),
            // Negative seeds are valid in OpenAI's API; any fixed mapping keeps them reproducible.
            (None, Some(i)) => Some(i as u64),
            _ => return Err(ApiError::invalid("seed", "`seed` must be an integer")),
        },
        Some(_) => return Err(ApiError::invalid("seed", "`seed` must be an integer")),
    };
    let stop_strings = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Value::String(s) => out.push(s.clone()),
                    _ => return Err(ApiError::invalid("stop", "`stop` must be a string or an array of strings")),
                }
            }
            out
        }
        Some(_) => return Err(ApiError::invalid("stop", "`stop` must be a string or an array of strings")),
    };
    if stop_strings.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid("stop", format!("At most {MAX_STOP_STRINGS} stop sequences are supported")));
    }
    let params = SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: f.number("top_p")?.unwrap_or(1.0) as f32,
        min_p: f.number("min_p")?.unwrap_or(0.0) as f32,
        seed,
        max_tokens,
        stop_strings,
        stop_token_ids: Vec::new(),
        presence_penalty: f.number("presence_penalty")?.unwrap_or(0.0) as f32,
        frequency_penalty: f.number("frequency_penalty")?.unwrap_or(0.0) as f32,
    };
    params.validate().map_err(|e| {
        let param = if e.field == "max_tokens" { param_name } else { e.field };
        ApiError::invalid(param, format!("`{param}` {}", e.reason))
    })?;

    let stream = f.boolean("stream")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => Fields(o)
            .boolean("include_usage")
            .map_err(|mut e| {
                e.param = Some("stream_options.include_usage".into());
                e
            })?
            .unwrap_or(false),
        Some(_) => return Err(ApiError::invalid("stream_options", "`stream_options` must be an object")),
    };
    let speculate = f.boolean("speculate")?.unwrap_or(true);
    let ignore_eos = f.boolean("ignore_eos")?.unwrap_or(false);
    Ok(CompletionRequest {
        endpoint,
        model,
        prompts,
        params,
        stream,
        include_usage: stream && include_usage,
        speculate,
        ignore_eos,
        chat_template_kwargs,
        n,
        logprobs,
        echo,
        grammar,
        tools,
        tool_choice,
    })
}

/// `tools` (functions with a `name`) and `tool_choice`; chat only.
fn parse_tools(f: &Fields, endpoint: Endpoint) -> Result<(Vec<Value>, ToolChoice), ApiError> {
    let tools = match f.get("tools") {
        None => Vec::new(),
        Some(_) if endpoint == Endpoint::Completion => {
            return Err(ApiError::invalid("tools", "`tools` is a chat completions parameter"))
        }
        Some(Value::Array(items)) => {
            for (i, t) in items.iter().enumerate() {
                let ok = t.get("type").and_then(Value::as_str) == Some("function")
                    && t.pointer("/function/name").and_then(Value::as_str).is_some_and(|n| !n.is_empty())
                    && t.pointer("/function/parameters").is_none_or(|p| p.is_object() || p.is_null());
                if !ok {
                    return Err(ApiError::invalid(
                        &format!("tools[{i}]"),
                        "each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}",
                    ));
                }
            }
            items.clone()
        }
        Some(_) => return Err(ApiError::invalid("tools", "`tools` must be an array")),
    };
    let choice = match f.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` must be auto, none, required or a function; got `{other}`"),
                ))
            }
        },
        Some(Value::Object(o)) => match o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) => ToolChoice::Function(name.to_string()),
            None => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
        Some(_) => return Err(ApiError::invalid("tool_choice", "`tool_choice` must be a string or an object")),
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Function(_)) {
        return Err(ApiError::invalid("tool_choice", "`tool_choice` asks for a call but `tools` is empty"));
    }
    Ok((tools, choice))
}

/// Messages as the template sees them: role and content (text) of each.
fn messages_json(messages: &[ChatMessage]) -> Value {
    Value::Array(messages.iter().map(|m| json!({"role": m.role, "content": m.content})).collect())
}

/// When the conversation holds tool calls or tool results: the messages as JSON with them
/// (`tool_calls` of assistant turns, `tool_call_id` and `name` of tool turns).
fn tool_messages(raw: Option<&Value>, parsed: &[ChatMessage]) -> Result<Option<Value>, ApiError> {
    let Some(Value::Array(items)) = raw else { return Ok(None) };
    let has_tools = items.iter().any(|m| m.get("tool_calls").is_some_and(|t| !t.is_null()) || m["role"] == "tool");
    if !has_tools {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(parsed.len());
    for (i, (item, m)) in items.iter().zip(parsed).enumerate() {
        let mut v = json!({"role": m.role, "content": m.content});
        match item.get("tool_calls") {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) => {
                let mut fixed = Vec::with_capacity(calls.len());
                for (j, call) in calls.iter().enumerate() {
                    let param = format!("messages[{i}].tool_calls[{j}]");
                    let name = call.pointer("/function/name").and_then(Value::as_str);
                    let arguments = call.pointer("/function/arguments");
                    let (Some(name), Some(arguments)) = (name, arguments) else {
                        return Err(ApiError::invalid(
                            &param,
                            format!("`{param}` needs function.name and function.arguments"),
                        ));
                    };
                    // Templates print arguments as JSON: a string holding JSON becomes that JSON.
                    let arguments = match arguments {
                        Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
                        other => other.clone(),
                    };
                    fixed.push(json!({"id": call.get("id").cloned().unwrap_or(Value::Null), "type": "function",
                                      "function": {"name": name, "arguments": arguments}}));
                }
                v["tool_calls"] = Value::Array(fixed);
            }
            Some(_) => {
                return Err(ApiError::invalid(&format!("messages[{i}].tool_calls"), "`tool_calls` must be an array"))
            }
        }
        for key in ["tool_call_id", "name"] {
            if let Some(Value::String(s)) = item.get(key) {
                v[key] = json!(s);
            }
        }
        out.push(v);
    }
    Ok(Some(Value::Array(out)))
}

/// `response_format` (OpenAI) or `structured_outputs` (vLLM's extension), at most one.
fn parse_grammar(f: &Fields) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    let from_format = match f.get("response_format") {
        None => None,
        Some(Value::Object(rf)) => match rf.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(GrammarSpec::JsonObject),
            Some("json_schema") => {
                let param = "response_format.json_schema.schema";
                match rf.get("json_schema").and_then(|j| j.get("schema")) {
                    Some(schema @ Value::Object(_)) => Some(GrammarSpec::JsonSchema(schema.clone())),
                    Some(Value::Bool(true)) | None => Some(GrammarSpec::JsonObject),
                    Some(_) => return Err(ApiError::invalid(param, format!("`{param}` must be a JSON schema object"))),
                }
            }
            _ => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    "`response_format.type` must be one of text, json_object, json_schema",
                ))
            }
        },
        Some(_) => return Err(ApiError::invalid("response_format", "`response_format` must be an object")),
    };
    let from_outputs = match f.get("structured_outputs") {
        None => None,
        Some(Value::Object(so)) => {
            let kinds: Vec<&String> = so.keys().filter(|k| !so[k.as_str()].is_null()).collect();
            let bad = |msg: &str| ApiError::invalid("structured_outputs", msg);
            match kinds.as_slice() {
                [] => None,
                [k] => {
                    let v = &so[k.as_str()];
                    Some(match (k.as_str(), v) {
                        ("json", Value::Object(_)) => GrammarSpec::JsonSchema(v.clone()),
                        ("json", Value::String(s)) => GrammarSpec::JsonSchema(
                            serde_json::from_str(s).map_err(|e| bad(&format!("`structured_outputs.json` is not JSON: {e}")))?,
                        ),
                        ("regex", Value::String(s)) => GrammarSpec::Regex(s.clone()),
                        ("grammar", Value::String(s)) => GrammarSpec::Lark(s.clone()),
                        ("choice", Value::Array(items)) if !items.is_empty() => {
                            let mut alternatives = Vec::with_capacity(items.len());
                            for item in items {
                                let Value::String(s) = item else {
                                    return Err(bad("`structured_outputs.choice` must be an array of strings"));
                                };
                                alternatives.push(regex_escape(s));
                            }
                            GrammarSpec::Regex(format!("({})", alternatives.join("|")))
                        }
                        _ => {
                            return Err(bad(
                                "`structured_outputs` takes one of json (a schema), regex (a string), choice (strings) or grammar (a Lark grammar)",
                            ))
                        }
                    })
                }
                _ => return Err(bad("`structured_outputs` takes one constraint, not several")),
            }
        }
        Some(_) => return Err(ApiError::invalid("structured_outputs", "`structured_outputs` must be an object")),
    };
    match (from_format, from_outputs) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "structured_outputs",
            "give either `response_format` or `structured_outputs`, not both",
        )),
        (Some(g), None) => Ok(Some((g, "response_format"))),
        (None, Some(g)) => Ok(Some((g, "structured_outputs"))),
        (None, None) => Ok(None),
    }
}

/// `s` as a regex that matches exactly it.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Chat: `logprobs` (boolean) and `top_logprobs` (0..=20); completions: `logprobs` (0..=20
/// alternatives). `None` when no log-probs are wanted.
fn parse_logprobs(f: &Fields, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
    let max = crate::sample::MAX_TOP_LOGPROBS as i64;
    let in_range = |name: &str, k: i64| -> Result<usize, ApiError> {
        if (0..=max).contains(&k) {
            Ok(k as usize)
        } else {
            Err(ApiError::invalid(name, format!("`{name}` must be between 0 and {max}, got {k}")))
        }
    };
    match endpoint {
        Endpoint::Chat => {
            let wanted = f.boolean("logprobs")?.unwrap_or(false);
            let top = f.integer("top_logprobs")?.map(|k| in_range("top_logprobs", k)).transpose()?;
            match (wanted, top) {
                (false, Some(k)) if k > 0 => {
                    Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs` set to true"))
                }
                (false, _) => Ok(None),
                (true, top) => Ok(Some(top.unwrap_or(0))),
            }
        }
        Endpoint::Completion => match f.get("logprobs") {
            None | Some(Value::Bool(false)) => Ok(None),
            Some(Value::Number(_)) => Ok(Some(in_range("logprobs", f.integer("logprobs")?.unwrap_or(0))?)),
            Some(_) => Err(ApiError::invalid("logprobs", "`logprobs` must be an integer (alternatives per token)")),
        },
    }
}

/// Typed access to a request's fields; `null` reads as absent.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn number(&self, name: &str) -> Result<Option<f64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(_) => Err(ApiError::invalid(name, format!("`{name}` must be a number"))),
        }
    }

    fn integer(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => match (n.as_i64(), n.as_u64()) {
                (Some(i), _) => Ok(Some(i)),
                (None, Some(_)) => Ok(Some(i64::MAX)),
                _ => Err(ApiError::invalid(name, format!("`{name}` must be an integer"))),
            },
            Some(_) => Err(ApiError::invalid(name, format!("`{name}` must be an integer"))),
        }
    }

    fn boolean(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(ApiError::invalid(name, format!("`{name}` must be a boolean"))),
        }
    }

    fn string(&self, name: &str) -> Result<Option<String>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::invalid(name, format!("`{name}` must be a string"))),
        }
    }
}

fn parse_messages(value: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match value {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("messages", "Missing required parameter: `messages`"))
        }
        Some(Value::Array(items)) => items,
        Some(_) => return Err(ApiError::invalid("messages", "`messages` must be an array")),
    };
    if items.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must contain at least one message"));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let param = format!("messages[{i}]");
        let Value::Object(m) = item else {
            return Err(ApiError::invalid(&param, format!("`{param}` must be an object")));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) => r.as_str(),
            _ => return Err(ApiError::invalid(&format!("{param}.role"), format!("`{param}.role` must be a string"))),
        };
        let role = match role {
            "system" | "user" | "assistant" | "tool" => role,
            // OpenAI's newer name for system instructions.
            "developer" => "system",
            other => {
                return Err(ApiError::invalid(
                    &format!("{param}.role"),
                    format!("`{param}.role` must be one of system, developer, user, assistant, tool; got `{other}`"),
                ))
            }
        };
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            None | Some(Value::Null) if role == "assistant" => String::new(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                &format!("{param}.content[{j}]"),
                                "Only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                            ))
                        }
                    }
                }
                text
            }
            _ => {
                return Err(ApiError::invalid(
                    &format!("{param}.content"),
                    format!("`{param}.content` must be a string or an array of text parts"),
                ))
            }
        };
        out.push(ChatMessage::new(role, content));
    }
    Ok(out)
}

fn parse_prompts(value: Option<&Value>) -> Result<Vec<PromptInput>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string, an array of token ids, or an array of strings or of token-id arrays",
        )
    };
    let ids = |items: &[Value]| -> Result<Vec<u32>, ApiError> {
        items.iter().map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(bad)).collect()
    };
    match value {
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "Missing required parameter: `prompt`")),
        Some(Value::String(s)) => Ok(vec![PromptInput::Text(s.clone())]),
        Some(Value::Array(items)) => match items.first() {
            None => Err(ApiError::invalid("prompt", "`prompt` is empty")),
            Some(Value::Number(_)) => Ok(vec![PromptInput::Ids(ids(items)?)]),
            Some(_) => items
                .iter()
                .map(|item| match item {
                    Value::String(s) => Ok(PromptInput::Text(s.clone())),
                    Value::Array(inner) if !inner.is_empty() => Ok(PromptInput::Ids(ids(inner)?)),
                    _ => Err(bad()),
                })
                .collect(),
        },
        Some(_) => Err(bad()),
    }
}

/// Unix seconds, for `created`.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_prompt_tokens },
        "draft_n": u.draft_n,
        "draft_n_accepted": u.draft_n_accepted,
    })
}

/// One finished choice of a (non-streamed) response.
#[derive(Debug, Clone)]
pub struct Choice {
    pub text: String,
    pub finish: FinishReason,
    /// The choice's `logprobs` object, when asked for.
    pub logprobs: Option<Value>,
    /// Chat: the tool calls parsed from the output (`text` is then what came before them).
    pub tool_calls: Vec<Value>,
}

/// A log-prob as JSON: OpenAI's −9999 for a token the distribution rules out.
fn logprob_json(lp: f32) -> f64 {
    if lp.is_finite() {
        lp as f64
    } else {
        -9999.0
    }
}

/// Log-probs in the chat format: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}`.
pub fn chat_logprobs(items: &[TokenLogprob], tokenizer: &Tokenizer) -> Value {
    let entry = |id: u32, lp: f32| {
        let bytes = tokenizer.piece(id, false);
        json!({"token": String::from_utf8_lossy(bytes), "logprob": logprob_json(lp), "bytes": bytes})
    };
    let content: Vec<Value> = items
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = Value::Array(l.top.iter().map(|&(id, lp)| entry(id, lp)).collect());
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Log-probs in the completions format, built up token by token: `tokens`, `token_logprobs`,
/// `top_logprobs` (one `{token: logprob}` map per token) and `text_offset` (characters into
/// the choice's text).
#[derive(Debug, Default)]
pub struct CompletionLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f64>>,
    top_logprobs: Vec<Option<Map<String, Value>>>,
    text_offset: Vec<usize>,
    /// Characters of text so far.
    offset: usize,
}

impl CompletionLogprobs {
    /// Continues at `offset` characters (a streamed choice's later chunks).
    pub fn starting_at(offset: usize) -> Self {
        Self { offset, ..Self::default() }
    }

    fn push_token(&mut self, id: u32, tokenizer: &Tokenizer) -> String {
        let text = String::from_utf8_lossy(tokenizer.piece(id, false)).into_owned();
        self.text_offset.push(self.offset);
        self.offset += text.chars().count();
        self.tokens.push(text.clone());
        text
    }

    /// A prompt's first token, which has no log-prob (nothing precedes it).
    pub fn push_first(&mut self, id: u32, tokenizer: &Tokenizer) {
        self.push_token(id, tokenizer);
        self.token_logprobs.push(None);
        self.top_logprobs.push(None);
    }

    pub fn push(&mut self, l: &TokenLogprob, tokenizer: &Tokenizer) {
        self.push_token(l.token, tokenizer);
        self.token_logprobs.push(Some(logprob_json(l.logprob)));
        let mut top = Map::new();
        for &(id, lp) in &l.top {
            let text = String::from_utf8_lossy(tokenizer.piece(id, false)).into_owned();
            // Two ids with the same text: the likelier one stays (they come most likely first).
            top.entry(text).or_insert(json!(logprob_json(lp)));
        }
        self.top_logprobs.push(Some(top));
    }

    /// Characters of text covered so far.
    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn to_json(&self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

/// Identity of one response, repeated in every chunk.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

impl ResponseMeta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    /// What every response and chunk carries around its choices.
    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }

    /// The whole (non-streamed) response.
    pub fn response(&self, choices: &[Choice], usage: &Usage) -> Value {
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let logprobs = c.logprobs.clone().unwrap_or(Value::Null);
                match self.endpoint {
                    Endpoint::Chat if !c.tool_calls.is_empty() => json!({
                        "index": index,
                        "message": {"role": "assistant", "content": if c.text.is_empty() { Value::Null } else { json!(c.text) },
                                    "tool_calls": c.tool_calls},
                        "logprobs": logprobs,
                        "finish_reason": "tool_calls",
                    }),
                    Endpoint::Chat => json!({
                        "index": index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs,
                        "finish_reason": c.finish.openai(),
                    }),
                    Endpoint::Completion => json!({
                        "index": index,
                        "text": c.text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish.openai(),
                    }),
                }
            })
            .collect();
        let mut response = self.envelope(false, choices);
        response["usage"] = usage_json(usage);
        response
    }

    /// A streamed chunk of choice `index` carrying text (and, as the `specula` extension, each
    /// token's id, text piece and source), or the final one with `finish` set.
    pub fn chunk(
        &self,
        index: usize,
        text: &str,
        tokens: Option<&TokenChunk>,
        logprobs: Option<Value>,
        finish: Option<FinishReason>,
        role: bool,
    ) -> Value {
        let finish_reason = finish.map(|f| f.openai());
        let logprobs = logprobs.unwrap_or(Value::Null);
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let delta = match (role, finish.is_some() && text.is_empty()) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, true) => json!({}),
                    (false, false) => json!({"content": text}),
                };
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
            }
            Endpoint::Completion => {
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
            }
        };
        let mut chunk = self.envelope(true, vec![choice]);
        if let Some(t) = tokens.filter(|t| !t.is_empty()) {
            let sources: Vec<&str> = t
                .sources
                .iter()
                .map(|s| match s {
                    TokenSource::Draft => "draft",
                    TokenSource::DraftBranch => "draft-branch",
                    TokenSource::Target => "target",
                })
                .collect();
            chunk["specula"] = json!({"token_ids": t.ids, "pieces": t.pieces, "sources": sources});
        }
        chunk
    }

    /// A streamed chunk with choice `index`'s tool calls and its end (`finish_reason`
    /// `tool_calls`).
    pub fn tool_calls_chunk(&self, index: usize, tool_calls: Vec<Value>) -> Value {
        let choice = json!({"index": index, "delta": {"tool_calls": tool_calls}, "logprobs": null, "finish_reason": "tool_calls"});
        self.envelope(true, vec![choice])
    }

    /// The usage chunk sent after the last one when `stream_options.include_usage` is set.
    pub fn usage_chunk(&self, usage: &Usage) -> Value {
        let mut chunk = self.envelope(true, Vec::new());
        chunk["usage"] = usage_json(usage);
        chunk
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str, endpoint: Endpoint) -> Result<CompletionRequest, ApiError> {
        parse_request(body.as_bytes(), endpoint)
    }

    fn param_of(body: &str, endpoint: Endpoint) -> Option<String> {
        parse(body, endpoint).unwrap_err().param
    }

    #[test]
    fn parses_a_full_chat_request() {
        let r = parse(
            r#"{"model":"m","messages":[{"role":"developer","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],
               "temperature":0.5,"top_p":0.9,"top_k":-1,"min_p":0.1,"seed":-3,"stop":"x","max_completion_tokens":7,
               "presence_penalty":0.5,"frequency_penalty":-0.5,"stream":true,"stream_options":{"include_usage":true},"user":"u",
               "ignore_eos":true}"#,
            Endpoint::Chat,
        )
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.prompts, vec![PromptInput::Chat(vec![ChatMessage::system("be brief"), ChatMessage::user("hi")])]);
        assert_eq!(r.params.max_tokens, Some(7));
        assert_eq!(r.params.top_k, 0);
        assert_eq!(r.params.seed, Some((-3i64) as u64));
        assert_eq!(r.params.stop_strings, vec!["x".to_string()]);
        assert!(r.stream && r.include_usage && r.speculate && r.ignore_eos);
    }

    #[test]
    fn completion_prompts_in_every_shape() {
        let p = |s: &str| parse(&format!(r#"{{"prompt":{s}}}"#), Endpoint::Completion).map(|r| r.prompts);
        let text = |t: &str| PromptInput::Text(t.into());
        assert_eq!(p(r#""hi""#).unwrap(), vec![text("hi")]);
        assert_eq!(p(r#"["hi"]"#).unwrap(), vec![text("hi")]);
        assert_eq!(p("[1,2]").unwrap(), vec![PromptInput::Ids(vec![1, 2])]);
        assert_eq!(p("[[1,2]]").unwrap(), vec![PromptInput::Ids(vec![1, 2])]);
        assert_eq!(p(r#"["a","b"]"#).unwrap(), vec![text("a"), text("b")]);
        assert_eq!(p(r#"["a",[3]]"#).unwrap(), vec![text("a"), PromptInput::Ids(vec![3])]);
        assert!(p(r#"["a",[]]"#).is_err());
        assert!(p(r#"["a",3]"#).is_err());
        let many = format!("[{}]", vec![r#""x""#; 65].join(","));
        assert_eq!(param_of(&format!(r#"{{"prompt":{many}}}"#), Endpoint::Completion).as_deref(), Some("prompt"));
        let eighty = r#"{"prompt":["a","b","c","d","e"],"n":16}"#;
        assert_eq!(param_of(eighty, Endpoint::Completion).as_deref(), Some("prompt"));
        assert!(p("[]").is_err());
        assert!(p("[-1]").is_err());
        assert!(p("3").is_err());
    }

    #[test]
    fn each_bad_field_is_named() {
        let chat = |extra: &str| format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
        assert_eq!(param_of(&chat(r#","temperature":"hot""#), Endpoint::Chat).as_deref(), Some("temperature"));
        assert_eq!(param_of(&chat(r#","temperature":3"#), Endpoint::Chat).as_deref(), Some("temperature"));
        assert_eq!(param_of(&chat(r#","max_tokens":0"#), Endpoint::Chat).as_deref(), Some("max_tokens"));
        assert_eq!(
            param_of(&chat(r#","max_completion_tokens":-5"#), Endpoint::Chat).as_deref(),
            Some("max_completion_tokens")
        );
        assert_eq!(param_of(&chat(r#","max_tokens":1.5"#), Endpoint::Chat).as_deref(), Some("max_tokens"));
        assert_eq!(param_of(&chat(r#","top_p":0"#), Endpoint::Chat).as_deref(), Some("top_p"));
        assert_eq!(param_of(&chat(r#","stop":[1]"#), Endpoint::Chat).as_deref(), Some("stop"));
        assert_eq!(param_of(&chat(r#","stop":[""]"#), Endpoint::Chat).as_deref(), Some("stop"));
        assert_eq!(param_of(&chat(r#","n":99"#), Endpoint::Chat).as_deref(), Some("n"));
        let r = parse(&chat(r#","n":3,"logprobs":true,"top_logprobs":4"#), Endpoint::Chat).unwrap();
        assert_eq!((r.n, r.logprobs, r.echo), (3, Some(4), false));
        let r = parse(r#"{"prompt":"a","logprobs":0,"echo":true}"#, Endpoint::Completion).unwrap();
        assert_eq!((r.n, r.logprobs, r.echo), (1, Some(0), true));
        assert_eq!(parse(&chat(r#","logprobs":false"#), Endpoint::Chat).unwrap().logprobs, None);
        assert_eq!(param_of(&chat(r#","stream":"yes""#), Endpoint::Chat).as_deref(), Some("stream"));
        assert_eq!(param_of(&chat(r#","model":5"#), Endpoint::Chat).as_deref(), Some("model"));
        assert_eq!(param_of(&chat(r#","presence_penalty":9"#), Endpoint::Chat).as_deref(), Some("presence_penalty"));
        assert_eq!(param_of(r#"{"messages":[]}"#, Endpoint::Chat).as_deref(), Some("messages"));
        assert_eq!(param_of(r#"{"messages":"hi"}"#, Endpoint::Chat).as_deref(), Some("messages"));
        assert_eq!(
            param_of(r#"{"messages":[{"role":"wizard","content":"x"}]}"#, Endpoint::Chat).as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(
            param_of(r#"{"messages":[{"role":"user"}]}"#, Endpoint::Chat).as_deref(),
            Some("messages[0].content")
        );
        assert_eq!(param_of(r#"{}"#, Endpoint::Completion).as_deref(), Some("prompt"));
    }

    #[test]
    fn body_level_errors() {
        for (body, needle) in [
            (&b"{\"messages\": [}"[..], "parse the JSON"),
            (&b"[1,2]"[..], "JSON object"),
            (&b""[..], "empty"),
            (&b"{\"prompt\": \"\xff\xfe\"}"[..], "UTF-8"),
        ] {
            let e = parse_request(body, Endpoint::Completion).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
            assert!(e.message.contains(needle), "{}", e.message);
            assert_eq!(e.param, None);
        }
    }

    #[test]
    fn chunks_carry_the_token_sources() {
        let meta = ResponseMeta { id: "x".into(), created: 1, model: "m".into(), endpoint: Endpoint::Chat };
        let t = TokenChunk {
            ids: vec![5, 6],
            sources: vec![TokenSource::Draft, TokenSource::Target],
            pieces: vec!["a".into(), "b".into()],
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
        };
        let c = meta.chunk(0, "ab", Some(&t), None, None, false);
        assert_eq!(c["choices"][0]["delta"]["content"], "ab");
        assert_eq!(c["specula"]["sources"], json!(["draft", "target"]));
        assert_eq!(c["object"], "chat.completion.chunk");
        let last = meta.chunk(0, "", None, None, Some(FinishReason::Length), false);
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert!(last.get("specula").is_none());
    }

    #[test]
    fn chat_template_kwargs_are_an_object() {
        let body = r#"{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"enable_thinking":false}}"#;
        let req = parse(body, Endpoint::Chat).unwrap();
        assert_eq!(req.chat_template_kwargs.get("enable_thinking"), Some(&Value::Bool(false)));
        let req = parse(r#"{"messages":[{"role":"user","content":"hi"}]}"#, Endpoint::Chat).unwrap();
        assert!(req.chat_template_kwargs.is_empty());
        let bad = r#"{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":"no"}"#;
        assert_eq!(param_of(bad, Endpoint::Chat).as_deref(), Some("chat_template_kwargs"));
    }
}

/// What `/tokenize` is asked to tokenize.
#[derive(Debug, Clone)]
pub enum TokenizeInput {
    /// vLLM's `prompt` (special tokens added unless `add_special_tokens` is false) or
    /// llama-server's `content` (added only with `add_special`).
    Text { text: String, add_special: bool },
    /// vLLM's `messages`: the conversation rendered as a chat completion would render it
    /// (with `tools` and `chat_template_kwargs`); `add_generation_prompt` defaults to true.
    Chat { request: Box<CompletionRequest>, add_generation_prompt: bool },
}

/// A `/tokenize` request, in vLLM's shape or llama-server's.
#[derive(Debug, Clone)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub input: TokenizeInput,
    /// vLLM's `return_token_strs`: each token's vocabulary text beside the ids.
    pub token_strs: bool,
    /// llama-server's `with_pieces`: `tokens` as `{id, piece}` objects.
    pub with_pieces: bool,
}

/// Parses a `/tokenize` body (already known to be within the size limit).
pub fn parse_tokenize_request(body: &[u8]) -> Result<TokenizeRequest, ApiError> {
    let obj = json_object(body)?;
    let f = Fields(&obj);
    let model = f.string("model")?;
    let token_strs = f.boolean("return_token_strs")?.unwrap_or(false);
    let with_pieces = f.boolean("with_pieces")?.unwrap_or(false);
    let given: Vec<&str> = ["prompt", "content", "messages"].into_iter().filter(|k| f.get(k).is_some()).collect();
    let input = match given.as_slice() {
        ["prompt"] => TokenizeInput::Text {
            text: f.string("prompt")?.unwrap_or_default(),
            add_special: f.boolean("add_special_tokens")?.unwrap_or(true),
        },
        ["content"] => TokenizeInput::Text {
            text: f.string("content")?.unwrap_or_default(),
            add_special: f.boolean("add_special")?.unwrap_or(false),
        },
        ["messages"] => {
            if f.boolean("continue_final_message")?.unwrap_or(false) {
                return Err(ApiError::invalid("continue_final_message", "`continue_final_message` is not supported"));
            }
            if f.boolean("add_special_tokens")?.unwrap_or(false) {
                return Err(ApiError::invalid(
                    "add_special_tokens",
                    "`add_special_tokens` with `messages` is not supported: the ids are those a chat completion runs on",
                ));
            }
            TokenizeInput::Chat {
                request: Box::new(parse_request(body, Endpoint::Chat)?),
                add_generation_prompt: f.boolean("add_generation_prompt")?.unwrap_or(true),
            }
        }
        [] => return Err(ApiError::invalid("prompt", "Give `prompt` (text), `messages` (a chat) or `content` (text)")),
        _ => {
            return Err(ApiError::invalid(
                given[1],
                format!("Give one of `prompt`, `messages` and `content`, not {}", given.join(" and ")),
            ))
        }
    };
    Ok(TokenizeRequest { model, input, token_strs, with_pieces })
}

/// A `/detokenize` request: `{"tokens": [ids]}` (vLLM's and llama-server's shape).
#[derive(Debug, Clone)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// Parses a `/detokenize` body; ids are checked against `vocab` (the vocabulary size).
pub fn parse_detokenize_request(body: &[u8], vocab: usize) -> Result<DetokenizeRequest, ApiError> {
    let obj = json_object(body)?;
    let f = Fields(&obj);
    let model = f.string("model")?;
    let Some(Value::Array(items)) = f.get("tokens") else {
        return Err(ApiError::invalid("tokens", "`tokens` must be an array of token ids"));
    };
    let mut tokens = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        match item.as_u64() {
            Some(id) if id < vocab as u64 => tokens.push(id as u32),
            _ => {
                return Err(ApiError::invalid(
                    &format!("tokens[{i}]"),
                    format!("`tokens[{i}]` must be a token id below the vocabulary size {vocab}, got {item}"),
                ))
            }
        }
    }
    Ok(DetokenizeRequest { model, tokens })
}

/// A body's JSON object, with the same errors as the completion endpoints give.
fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let text = std::str::from_utf8(body).map_err(|e| {
        ApiError::bad_request(format!("The request body is not valid UTF-8 (at byte {})", e.valid_up_to()))
    })?;
    if text.trim().is_empty() {
        return Err(ApiError::bad_request("The request body is empty; send a JSON object"));
    }
    match serde_json::from_str(text) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err(ApiError::bad_request("The request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("We could not parse the JSON body of your request: {e}"))),
    }
}
