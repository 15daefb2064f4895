//! Tool calls in the format of Qwen2.5/Qwen3 chat templates (Hermes-style): the model writes
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, once per call. Parsing them
//! back into OpenAI's `tool_calls`, holding such text back from streams, and the grammar that
//! forces a call when `tool_choice` asks for one.

use crate::grammar::GrammarSpec;
use serde_json::{json, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One parsed call: the function's name and its arguments as a JSON string (OpenAI's form).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// Splits generated text into its content (the text before the first call) and the calls
/// that parse. Text that only looks like a call (bad JSON, no name) stays content.
pub fn parse(text: &str) -> (String, Vec<ToolCall>) {
    let Some(first) = text.find(OPEN) else { return (text.to_string(), Vec::new()) };
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(start) = rest.find(OPEN) {
        let body_start = start + OPEN.len();
        let (body, next) = match rest[body_start..].find(CLOSE) {
            Some(end) => (&rest[body_start..body_start + end], &rest[body_start + end + CLOSE.len()..]),
            // A call cut off by max_tokens: parse what is there.
            None => (&rest[body_start..], ""),
        };
        if let Ok(v) = serde_json::from_str::<Value>(body.trim()) {
            if let Some(name) = v.get("name").and_then(Value::as_str) {
                let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
                    Some(Value::String(s)) => s.clone(),
                    Some(a) => a.to_string(),
                    None => "{}".to_string(),
                };
                calls.push(ToolCall { name: name.to_string(), arguments });
            }
        }
        rest = next;
    }
    if calls.is_empty() {
        return (text.to_string(), calls);
    }
    (text[..first].trim_end().to_string(), calls)
}

/// How much of streamed `text` can be shown as content: everything before a call starts, or
/// before a trailing partial `<tool_call>`.
pub fn shown_len(text: &str) -> usize {
    if let Some(i) = text.find(OPEN) {
        return i;
    }
    // The longest suffix that is a prefix of OPEN is held back.
    (1..OPEN.len())
        .rev()
        .find(|&n| {
            text.len() >= n && text.is_char_boundary(text.len() - n) && OPEN.starts_with(&text[text.len() - n..])
        })
        .map_or(text.len(), |n| text.len() - n)
}

/// OpenAI's `tool_calls` entries; ids are `call_<request id>_<index>`.
pub fn to_json(calls: &[ToolCall], id_prefix: &str, with_index: bool) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({
                "id": format!("call_{id_prefix}_{i}"),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            });
            if with_index {
                v["index"] = json!(i);
            }
            v
        })
        .collect()
}

/// The grammar for `tool_choice` `required` (any of `tools`) or a named function: one call in
/// the template's format, its arguments matching the function's `parameters` schema.
pub fn forced_call_grammar(tools: &[Value], only: Option<&str>) -> Result<GrammarSpec, String> {
    let mut alternatives = Vec::new();
    for tool in tools {
        let f = &tool["function"];
        let Some(name) = f["name"].as_str() else { continue };
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let parameters = match &f["parameters"] {
            Value::Null => json!({"type": "object"}),
            p => p.clone(),
        };
        alternatives.push(json!({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        }));
    }
    if alternatives.is_empty() {
        return Err(match only {
            Some(name) => format!("`tool_choice` names `{name}`, which is not in `tools`"),
            None => "`tool_choice` is `required` but `tools` holds no function".to_string(),
        });
    }
    let mut schema = if alternatives.len() == 1 { alternatives.remove(0) } else { json!({"anyOf": alternatives}) };
    schema["x-guidance"] = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    Ok(GrammarSpec::Lark(format!("start: \"{}\\n\" %json {} \"\\n{}\"", OPEN, schema, CLOSE)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_parsed_and_the_content_before_them_kept() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse(text);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0], ToolCall { name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() });
        assert_eq!(calls[1].name, "now");
        let (content, calls) = parse("<tool_call>\nnot json\n</tool_call>");
        assert!(calls.is_empty() && content.contains("not json"));
        assert_eq!(parse("plain").0, "plain");
    }

    #[test]
    fn streams_hold_back_what_may_start_a_call() {
        assert_eq!(shown_len("Hello"), 5);
        assert_eq!(shown_len("Hello <tool"), 6);
        assert_eq!(shown_len("Hello <tool_call>{"), 6);
        assert_eq!(shown_len("a < b"), 5);
        assert_eq!(shown_len("a <"), 2);
    }

    #[test]
    fn forced_calls_name_a_known_function() {
        let tools = vec![json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})];
        assert!(forced_call_grammar(&tools, None).is_ok());
        assert!(forced_call_grammar(&tools, Some("g")).unwrap_err().contains("`g`"));
    }
}
