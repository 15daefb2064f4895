use super::ModelArgs;
use crate::engine::{generate, EngineModel, GenerateOptions, Generation};
use crate::sample::SamplingParams;
use crate::speculative::{
    build_proposer, parse_draft_len, parse_draft_tree, Caller, DraftLen, DraftTree, DrafterSpec, Proposer,
};
use crate::speculative::{SpecMetrics, StepCost, StepCostSettings, MAX_DRAFT};
use crate::tokenize::ChatMessage;
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::time::Instant;

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
    /// Extra chat template variables as a JSON object (with --chat), e.g.
    /// '{"enable_thinking": false}' for Qwen3 without thinking.
    #[arg(long)]
    chat_template_kwargs: Option<String>,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, short = 'n', default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy. (`-t` is the thread count, as in llama.cpp.)
    #[arg(long = "temp", visible_alias = "temperature", default_value_t = 0.0)]
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
    /// Keep generating past end-of-sequence tokens (until -n, the context or a stop string).
    #[arg(long)]
    ignore_eos: bool,
    /// Speculative decoding drafter: `ngram[:N]` (prompt lookup over the prompt and output,
    /// n-grams of N tokens (default 3) down to 2), `suffix[:OPTIONS]` (suffix decoding over the
    /// prompt and output; docs/speculative.md), `draft-model:MODEL[,weights=FORMAT][,vocab=N]` (a
    /// smaller model with the same tokenizer, optionally in another weight format or drafting
    /// only the first N token ids), `dflash:DIR` or `eagle3:DIR` (learned drafters that read the target's
    /// hidden states), two joined by `+` (`ngram+dflash:DIR`: the second drafts where the
    /// first finds nothing), or `auto` (prompt lookup, with the repository's DFlash drafter for
    /// the model behind it where there is one), or `none` (the default: no drafter). Output is
    /// what decoding without one gives; only the speed changes.
    #[arg(long)]
    drafter: Option<String>,
    /// Draft tokens per step with --drafter: a number, or `auto` (measure this model's verify
    /// cost once, then choose 0..=15 per step from it and the acceptance so far).
    #[arg(long, default_value = "auto", value_parser = parse_draft_len)]
    draft_len: DraftLen,
    /// Longest draft per step (llama.cpp's `--draft-max`).
    #[arg(long = "draft-max", visible_alias = "draft", default_value_t = MAX_DRAFT,
          value_parser = super::draft_max_arg)]
    draft_max: usize,
    /// Draft trees, for drafters that can draft them (DFlash): `auto` (as many nodes as pay,
    /// chosen each step with the draft length), `off` (chains), or the most nodes per step.
    /// Trees verify several candidates per position in one forward; output is unchanged.
    #[arg(long, default_value = "auto", value_parser = parse_draft_tree)]
    draft_tree: DraftTree,
    /// Write one JSON line per decode step here (draft tokens, accepted count, next token).
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    // What can be checked without the model is checked before loading it (seconds for a 1.5B).
    let spec = args
        .drafter
        .as_deref()
        .filter(|d| *d != "none")
        .map(|d| DrafterSpec::parse_for_model(d, args.model.name()))
        .transpose()
        .context("--drafter")?;
    let (text, ids) = match (&args.prompt, &args.prompt_ids) {
        (Some(_), Some(_)) => bail!("give either --prompt or --prompt-ids, not both"),
        (None, None) => bail!("no prompt: give --prompt TEXT or --prompt-ids 1,2,3"),
        (text, ids) => (text, ids),
    };
    let loaded = args.model.load()?;
    let prompt = match (text, ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) if args.chat => {
            let mut messages = Vec::new();
            if let Some(s) = &args.system {
                messages.push(ChatMessage::system(s.clone()));
            }
            messages.push(ChatMessage::user(text.clone()));
            let kwargs = match &args.chat_template_kwargs {
                Some(text) => crate::tokenize::parse_template_kwargs(text)?,
                None => Default::default(),
            };
            loaded.encode_chat_with(&messages, &kwargs)?
        }
        (Some(text), None) => loaded.encode_prompt(text)?,
        (None, None) => bail!("no prompt"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let model_context = loaded.model.config.context_len;
    let ctx = args.model.max_model_len().map_or(model_context, |c| c.min(model_context)).min(args.model.kv_tokens);
    if prompt.len() >= ctx {
        bail!(
            "the prompt has {} tokens; the context holds {ctx} (model context {model_context}, --kv-tokens {}{})",
            prompt.len(),
            args.model.kv_tokens,
            args.model.max_model_len().map_or(String::new(), |c| format!(", --ctx-size {c}"))
        );
    }
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
        // Generation ends where the context does, as llama.cpp's does.
        max_tokens: Some(args.max_tokens.min(ctx - prompt.len())),
        stop_strings: args.stop.clone(),
        ..SamplingParams::default()
    };
    params.validate()?;
    let pool = args.model.kv_pool(&loaded.model)?;
    let mut proposer: Option<Box<dyn Proposer>> = match &spec {
        Some(spec) => Some(build_proposer(spec, loaded.target(), Caller::default())?),
        None => None,
    };
    let mut opts = GenerateOptions {
        stop_ids: if args.ignore_eos { Vec::new() } else { loaded.stop_ids() },
        draft_len: args.draft_len,
        max_draft: args.draft_max,
        draft_tree: args.draft_tree,
        trace: args.trace.is_some(),
        ..GenerateOptions::default()
    };
    if spec.is_some() && args.draft_len == DraftLen::Auto {
        let t = Instant::now();
        let cost = StepCost::measure(&loaded.model, &StepCostSettings::default())?;
        eprintln!(
            "[verify cost measured in {:.1} s: cost(2) {:.2}, cost(4) {:.2}, cost(8) {:.2}, cost(16) {:.2} × one token]",
            t.elapsed().as_secs_f64(),
            cost.relative(2),
            cost.relative(4),
            cost.relative(8),
            cost.relative(16)
        );
        opts.step_cost = Some(std::sync::Arc::new(cost));
    }
    let stdout = std::io::stdout();
    let json = args.json;
    let mut printed = 0;
    let mut on_chunk = |chunk: &crate::engine::TokenChunk| {
        printed += chunk.text().len();
        if !json {
            let mut out = stdout.lock();
            let _ = out.write_all(chunk.text().as_bytes());
            let _ = out.flush();
        }
    };
    let target = EngineModel { model: &loaded.model, tokenizer: Some(&loaded.tokenizer) };
    let proposer_ref = proposer.as_mut().map(|p| &mut **p as &mut dyn Proposer);
    let gen =
        generate(target, &pool, &prompt, params, proposer_ref, &opts, &mut on_chunk).context("generation failed")?;
    if let Some(path) = &args.trace {
        write_trace(path, &gen).with_context(|| format!("writing the trace to {}", path.display()))?;
    }
    let draft_len = match args.draft_len {
        DraftLen::Auto => serde_json::json!("auto"),
        DraftLen::Fixed(n) => serde_json::json!(n),
    };
    let speculation = spec.as_ref().map(|s| {
        serde_json::json!({
            "drafter": s.label(),
            "draft_len": draft_len,
            "verify_curve": opts.step_cost.as_ref().map(|c| (1..=MAX_DRAFT + 1).map(|m| c.relative(m)).collect::<Vec<_>>()),
            "steps": gen.metrics.steps,
            "spec_steps": gen.metrics.spec_steps,
            "drafted": gen.metrics.drafted,
            "accepted": gen.metrics.accepted,
            "acceptance_rate": gen.metrics.acceptance_rate(),
            "tau": gen.metrics.tau(),
            "per_position_acceptance": gen.metrics.per_position_acceptance(),
            "drafted_at": gen.metrics.drafted_at,
            "accepted_at": gen.metrics.accepted_at,
            "draft_secs": gen.metrics.draft_secs,
            "verify_secs": gen.metrics.verify_secs,
        })
    });
    if json {
        let out = serde_json::json!({
            "model": loaded.path.display().to_string(),
            "weights": loaded.model.weight_format.name(),
            "prompt_ids": prompt,
            "token_ids": gen.tokens,
            "text": gen.text,
            "finish_reason": gen.finish.openai(),
            "prompt_tokens": gen.prompt_tokens,
            "prefill_tokens_per_s": gen.prefill_tps(),
            "decode_tokens_per_s": gen.decode_tps(),
            "decode_secs": gen.decode_secs,
            "speculation": speculation,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        // The text streamed as it was committed; what a possible stop string held back comes
        // at the end.
        println!("{}", gen.text.get(printed..).unwrap_or(""));
        eprintln!(
            "[{} tokens prompt, {:.1} tok/s prefill | {} tokens generated, {:.1} tok/s decode | finish: {} | weights {}]",
            gen.prompt_tokens,
            gen.prefill_tps(),
            gen.tokens.len(),
            gen.decode_tps(),
            gen.finish.openai(),
            loaded.model.weight_format.name()
        );
        if let Some(spec) = &spec {
            eprintln!("{}", speculation_summary(&spec.label(), &gen.metrics));
        }
    }
    Ok(())
}

/// One line of speculation metrics for stderr.
fn speculation_summary(drafter: &str, m: &SpecMetrics) -> String {
    let per_position: Vec<String> = m.per_position_acceptance().iter().map(|a| format!("{a:.2}")).collect();
    format!(
        "[speculation {drafter}: {} steps ({} with a draft), drafted {}, accepted {} ({:.1}%), τ {:.2} tokens/step | \
         per position: {} | draft {:.2} s, verify {:.2} s]",
        m.steps,
        m.spec_steps,
        m.drafted,
        m.accepted,
        100.0 * m.acceptance_rate(),
        m.tau(),
        if per_position.is_empty() { "-".to_string() } else { per_position.join(" ") },
        m.draft_secs,
        m.verify_secs
    )
}

/// `--trace`: one JSON object per decode step.
fn write_trace(path: &std::path::Path, gen: &Generation) -> Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for (step, t) in gen.trace.iter().enumerate() {
        let line = serde_json::json!({
            "step": step,
            "draft": t.draft,
            "accepted": t.accepted,
            // The target's token after the accepted drafts: a bonus when all were accepted.
            "next_token": t.next_token,
            "bonus": !t.draft.is_empty() && t.accepted == t.draft.len(),
        });
        serde_json::to_writer(&mut out, &line)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(())
}
