use crate::bench::ar::{self, ArSettings};
use crate::bench::{report, spec};
use crate::speculative::{parse_draft_len, parse_draft_tree, MAX_DRAFT};
use anyhow::{bail, Result};

#[derive(clap::Args)]
pub struct BenchArgs {
    /// What to measure: `ar` = prefill/decode tokens/s and the verify-cost curve; `spec` =
    /// plain vs speculative decoding over prompt suites (table, JSON and chart in --out-dir).
    #[arg(long, default_value = "ar")]
    mode: String,
    /// Models (keys or paths); repeatable.
    #[arg(long, short = 'm', default_values_t = vec!["smollm2-135m".to_string()])]
    model: Vec<String>,
    /// Weight formats to compare; repeatable (default: the file's default format).
    #[arg(long)]
    weights: Vec<String>,
    #[arg(long, default_value_t = 512)]
    prefill_tokens: usize,
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    #[arg(long, default_value_t = 256)]
    verify_depth: usize,
    /// Largest block of the verify-cost curve (`spec` extends it to cover the draft lengths).
    #[arg(long, default_value_t = 16)]
    max_m: usize,
    /// `spec`: where the verify-cost curve the adaptive modes plan with comes from: `measure`
    /// (timed at the start of each run) or `cached` (the step-cost cache `serve` keeps, one
    /// curve per model, machine and size: measured and cached by the first run that needs it).
    /// Runs that compare builds or settings should share one curve: on a busy machine a fresh
    /// measurement moves cost(2) by 10–20%, and with it what the planner drafts.
    #[arg(long, default_value = "measure", value_parser = ["measure", "cached"])]
    verify_curve: String,
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Sequences decoded together for the batched decode column (`ar`; 0 skips it).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Cached tokens per sequence when the batched decode starts (`ar`).
    #[arg(long, default_value_t = 128)]
    batch_context: usize,
    /// Write every number as JSON here (`ar`), and the verify-cost curve as an SVG chart beside
    /// it (the same name, `.svg`).
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Profile verify blocks per phase (`ar`): where the time of m new tokens on top of
    /// --verify-depth cached ones goes (matmuls by kind, attention, norms, RoPE, …), and the
    /// matmuls' int8 ops/s against this machine's vpdpbusd peak, measured in the same run.
    #[arg(long)]
    profile: bool,
    /// Block sizes of the profile, comma-separated (default: 1, 4, 8, 16 up to --max-m).
    #[arg(long, value_delimiter = ',', requires = "profile")]
    profile_m: Vec<usize>,

    // --- `--mode spec` ---
    /// Drafter to compare with plain decoding: ngram[:N], suffix[:OPTIONS],
    /// draft-model:KEY|PATH[,weights=FORMAT][,vocab=N], dflash:DIR, eagle3:DIR or two joined by
    /// `+`; repeatable. A suffix drafter remembers the
    /// run's earlier prompts of the same model, as a server's would.
    #[arg(long)]
    drafter: Vec<String>,
    /// Draft length per step: a number or `auto` (adaptive); repeatable, each is its own mode.
    #[arg(long, default_values_t = vec!["auto".to_string()])]
    draft_len: Vec<String>,
    /// Draft trees (drafters that can draft them): `auto`, `off` or the most nodes per step;
    /// comma-separated, each is its own mode (`--draft-tree off,auto`: chains against trees).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["auto".to_string()])]
    draft_tree: Vec<String>,
    /// Where each prompt of an adaptive mode starts: `cold` (nothing known about the drafter) or
    /// `warm` (the acceptance it had on the set's earlier prompts, as on a running server);
    /// comma-separated, each is its own mode.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["cold".to_string()])]
    acceptance_history: Vec<String>,
    /// Longest draft the adaptive policy may choose (llama.cpp's `--draft-max`).
    #[arg(long = "draft-max", visible_alias = "draft", alias = "max-draft-len", default_value_t = MAX_DRAFT,
          value_parser = super::draft_max_arg)]
    draft_max: usize,
    /// Prompt set: gsm8k-100, humaneval, humaneval-edit, mt-bench, math500, or a training set
    /// (sharegpt, codeio, codeio-completion, reasoning-gym-math, word-problems, function-stubs: with
    /// `--skip`, prompts a drafter was not trained on); repeatable.
    #[arg(long, default_values_t = vec!["humaneval".to_string(), "gsm8k-100".to_string()])]
    dataset: Vec<String>,
    /// Prompts left out at the start of each data set (`--mode spec`).
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// Prompts per data set (default: all).
    #[arg(long)]
    limit: Option<usize>,
    /// New tokens per prompt (the same in every mode).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Temperatures to run, comma-separated; 0 = greedy (output checked against plain).
    #[arg(long, value_delimiter = ',', default_values_t = vec![0.0f32, 1.0])]
    temperatures: Vec<f32>,
    /// Chat template variables for the chat prompt sets (`spec`), as a JSON object, e.g.
    /// '{"enable_thinking": false}' (Qwen3 without thinking, as the published DFlash drafters were
    /// trained).
    #[arg(long)]
    chat_template_kwargs: Option<String>,
    /// Prompt i samples with seed SEED + i (temperature > 0), the same in every mode.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where `spec` writes report.md, report.json and chart.svg.
    #[arg(long, default_value = "bench-out")]
    out_dir: std::path::PathBuf,
}

pub fn run(args: BenchArgs) -> Result<()> {
    match args.mode.as_str() {
        "ar" => run_ar(args),
        "spec" => run_spec(args),
        other => bail!("unknown bench mode `{other}` (available: ar, spec)"),
    }
}

fn run_spec(args: BenchArgs) -> Result<()> {
    if args.weights.len() > 1 {
        bail!("--mode spec takes at most one --weights");
    }
    let settings = spec::SpecBenchSettings {
        models: args.model.clone(),
        weights: args.weights.first().cloned(),
        drafters: args.drafter.clone(),
        draft_lens: args.draft_len.iter().map(|s| parse_draft_len(s)).collect::<Result<_>>()?,
        draft_trees: args.draft_tree.iter().map(|s| parse_draft_tree(s)).collect::<Result<_>>()?,
        starts: args
            .acceptance_history
            .iter()
            .map(|s| match s.trim() {
                "cold" => Ok(false),
                "warm" => Ok(true),
                other => bail!("--acceptance-history takes cold and/or warm, got `{other}`"),
            })
            .collect::<Result<_>>()?,
        max_auto_draft_len: args.draft_max,
        datasets: args.dataset.clone(),
        skip: args.skip,
        limit: args.limit,
        max_tokens: args.max_tokens,
        temperatures: args.temperatures.clone(),
        seed: args.seed,
        curve_max_m: args.max_m.clamp(1, 64),
        cached_curve: args.verify_curve == "cached",
        chat_template_kwargs: match &args.chat_template_kwargs {
            Some(text) => crate::tokenize::parse_template_kwargs(text)?,
            None => Default::default(),
        },
    };
    settings.validate()?;
    let progress = indicatif::ProgressBar::new(0);
    progress.set_style(
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} runs, eta {eta} · {msg}")?
            .progress_chars("=> "),
    );
    progress.enable_steady_tick(std::time::Duration::from_millis(500));
    let result = spec::run(&settings, &progress);
    progress.finish_and_clear();
    let bench = result?;
    let markdown = report::render_markdown(&bench);
    print!("{markdown}");
    let written = report::write_all(&bench, &markdown, &args.out_dir)?;
    eprintln!("wrote {}, {}, {}", written.markdown.display(), written.json.display(), written.chart.display());
    if bench.greedy_mismatches > 0 {
        bail!(
            "{} greedy speculative output(s) differ from plain decoding (see {})",
            bench.greedy_mismatches,
            written.json.display()
        );
    }
    Ok(())
}

fn run_ar(args: BenchArgs) -> Result<()> {
    let max_m = args.max_m.clamp(1, 64);
    let profile = match (args.profile, args.profile_m.is_empty()) {
        (false, _) => None,
        (true, true) => Some(crate::bench::profile::default_sizes(max_m)),
        (true, false) => Some(args.profile_m.clone()),
    };
    if let Some(bad) = profile.iter().flatten().find(|&&m| m == 0 || m > 256) {
        bail!("--profile-m takes block sizes of 1 to 256 rows, got {bad}");
    }
    let settings = ArSettings {
        prefill_tokens: args.prefill_tokens,
        decode_tokens: args.decode_tokens,
        verify_depth: args.verify_depth,
        max_m,
        repeats: args.repeats.max(1),
        batch: args.batch.min(256),
        batch_context: args.batch_context,
        profile,
    };
    let threads =
        std::env::var("CANDLE_NUM_THREADS").or_else(|_| std::env::var("RAYON_NUM_THREADS")).unwrap_or("all".into());
    let mut results = Vec::new();
    let mut curves: Vec<(String, Vec<(usize, f64)>)> = Vec::new();
    let mut profiles = Vec::new();
    // The batched decode column, and its ratio to prefill: how close decoding `batch`
    // sequences at once comes to the compute-bound prefill rate.
    let batch_col = format!("decode ×{} tok/s | ×{} / prefill", settings.batch, settings.batch);
    println!(
        "| model | weights | prefill tok/s | decode tok/s | {batch_col} | cost(2) | cost(4) | cost(8) | cost(16) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for model in &args.model {
        let path = crate::fetch::resolve_model(model, true)?;
        let formats: Vec<Option<String>> =
            if args.weights.is_empty() { vec![None] } else { args.weights.iter().cloned().map(Some).collect() };
        for w in formats {
            let weights = w.as_deref().map(crate::model::WeightFormat::parse).transpose()?;
            let loaded = crate::engine::LoadedModel::load(&path, weights, &candle_core::Device::Cpu)?;
            let r = ar::run(&loaded.model, &settings)?;
            curves.push((
                format!("{model} {}", loaded.model.weight_format.name()),
                r.verify.iter().map(|p| (p.m, p.ratio)).collect(),
            ));
            let at = |m: usize| r.verify.get(m - 1).map_or("-".to_string(), |p| format!("{:.2}", p.ratio));
            let batched =
                r.batch_decode_tps.map_or("- | -".to_string(), |b| format!("{b:.1} | {:.2}", b / r.prefill_tps));
            println!(
                "| {model} | {} | {:.1} | {:.1} | {batched} | {} | {} | {} | {} |",
                loaded.model.weight_format.name(),
                r.prefill_tps,
                r.decode_tps,
                at(2),
                at(4),
                at(8),
                at(16)
            );
            if let Some(p) = &r.profile {
                profiles.push((format!("{model} {}", loaded.model.weight_format.name()), p.clone()));
            }
            results.push(serde_json::json!({
                "run": crate::bench::RunInfo::now(),
                "model": model, "weights": loaded.model.weight_format.name(), "threads": threads,
                "settings": {"prefill_tokens": settings.prefill_tokens, "decode_tokens": settings.decode_tokens,
                    "verify_depth": settings.verify_depth, "repeats": settings.repeats,
                    "batch": settings.batch, "batch_context": settings.batch_context},
                "report": r,
            }));
        }
    }
    for (name, p) in &profiles {
        println!("\n### Profile: {name}\n");
        print!("{}", crate::bench::profile::render(p));
    }
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_string_pretty(&results)?)?;
        eprintln!("wrote {}", out.display());
        let chart = out.with_extension("svg");
        std::fs::write(&chart, report::render_cost_curve_svg(&curves)?)?;
        eprintln!("wrote {}", chart.display());
    }
    Ok(())
}
