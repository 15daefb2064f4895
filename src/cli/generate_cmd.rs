use super::ModelArgs;
use crate::engine::{generate, GenerateOptions, Sequence, TextStream};
use crate::sample::SamplingParams;
use crate::tokenize::ChatMessage;
use anyhow::{bail, Context, Result};
use std::io::Write;

#[derive(clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text.
    #[arg(long, short = 'p')]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids (no template, no BOS added).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Render the prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, short = 'n', default_value_t = 128)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, short = 't', default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Print one JSON object (text, token ids, timings) instead of streaming.
    #[arg(long)]
    json: bool,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let loaded = args.model.load()?;
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(_), Some(_)) => bail!("give either --prompt or --prompt-ids, not both"),
        (None, None) => bail!("no prompt: give --prompt TEXT or --prompt-ids 1,2,3"),
        (None, Some(ids)) => ids.clone(),
        (Some(text), None) if args.chat => {
            let mut messages = Vec::new();
            if let Some(s) = &args.system {
                messages.push(ChatMessage::system(s.clone()));
            }
            messages.push(ChatMessage::user(text.clone()));
            loaded.encode_chat(&messages)?
        }
        (Some(text), None) => loaded.encode_prompt(text)?,
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let ctx = loaded.model.config.context_len.min(args.model.kv_tokens);
    if prompt.len() >= ctx {
        bail!("the prompt has {} tokens; the context holds {ctx} (model context {}, --kv-tokens {})",
            prompt.len(), loaded.model.config.context_len, args.model.kv_tokens);
    }
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
        max_tokens: Some(args.max_tokens),
        stop_strings: args.stop.clone(),
        ..SamplingParams::default()
    };
    params.validate()?;
    let pool = args.model.kv_pool(&loaded.model)?;
    let mut seq = Sequence::new(&prompt, pool.new_sequence(), params);
    let mut text = TextStream::new(args.stop.clone());
    let mut opts = GenerateOptions::default();
    let stdout = std::io::stdout();
    let json = args.json;
    let tokenizer = &loaded.tokenizer;
    let mut on_token = |ev: crate::engine::TokenEvent| {
        let piece = text.push(tokenizer, ev.token);
        if !json {
            let mut out = stdout.lock();
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        }
        !text.stopped()
    };
    let gen = generate(&loaded.model, &mut seq, &loaded.stop_ids(), None, &mut opts, &mut on_token)
        .context("generation failed")?;
    let tail = text.finish();
    if json {
        let out = serde_json::json!({
            "model": loaded.path.display().to_string(),
            "weights": loaded.model.weight_format.name(),
            "prompt_ids": prompt,
            "token_ids": gen.tokens,
            "text": text.text(),
            "finish_reason": gen.finish.openai(),
            "prompt_tokens": gen.prompt_tokens,
            "prefill_tokens_per_s": gen.prefill_tps(),
            "decode_tokens_per_s": gen.decode_tps(),
            "speculation": gen.metrics,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!("{tail}");
        eprintln!(
            "[{} tokens prompt, {:.1} tok/s prefill | {} tokens generated, {:.1} tok/s decode | finish: {} | weights {}]",
            gen.prompt_tokens,
            gen.prefill_tps(),
            gen.tokens.len(),
            gen.decode_tps(),
            gen.finish.openai(),
            loaded.model.weight_format.name()
        );
    }
    Ok(())
}
