use crate::bench::ar::{self, ArSettings};
use anyhow::{bail, Result};

#[derive(clap::Args)]
pub struct BenchArgs {
    /// What to measure: `ar` = prefill/decode tokens/s and the verify-cost curve.
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
    #[arg(long, default_value_t = 16)]
    max_m: usize,
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Write every number as JSON here.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.mode != "ar" {
        bail!("unknown bench mode `{}` (available: ar)", args.mode);
    }
    let settings = ArSettings {
        prefill_tokens: args.prefill_tokens,
        decode_tokens: args.decode_tokens,
        verify_depth: args.verify_depth,
        max_m: args.max_m.clamp(1, 64),
        repeats: args.repeats.max(1),
    };
    let threads = std::env::var("CANDLE_NUM_THREADS").or_else(|_| std::env::var("RAYON_NUM_THREADS")).unwrap_or("all".into());
    let mut results = Vec::new();
    println!("| model | weights | prefill tok/s | decode tok/s | cost(2) | cost(4) | cost(8) | cost(16) |");
    println!("|---|---|---|---|---|---|---|---|");
    for model in &args.model {
        let path = crate::fetch::resolve_model(model, true)?;
        let formats: Vec<Option<String>> =
            if args.weights.is_empty() { vec![None] } else { args.weights.iter().cloned().map(Some).collect() };
        for w in formats {
            let weights = w.as_deref().map(crate::model::WeightFormat::parse).transpose()?;
            let loaded = crate::engine::LoadedModel::load(&path, weights, &candle_core::Device::Cpu)?;
            let r = ar::run(&loaded.model, &settings)?;
            let at = |m: usize| r.verify.get(m - 1).map_or("-".to_string(), |p| format!("{:.2}", p.ratio));
            println!(
                "| {model} | {} | {:.1} | {:.1} | {} | {} | {} | {} |",
                loaded.model.weight_format.name(),
                r.prefill_tps,
                r.decode_tps,
                at(2),
                at(4),
                at(8),
                at(16)
            );
            results.push(serde_json::json!({
                "model": model, "weights": loaded.model.weight_format.name(), "threads": threads,
                "settings": {"prefill_tokens": settings.prefill_tokens, "decode_tokens": settings.decode_tokens,
                    "verify_depth": settings.verify_depth, "repeats": settings.repeats},
                "report": r,
            }));
        }
    }
    if let Some(out) = &args.out {
        std::fs::write(out, serde_json::to_string_pretty(&results)?)?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}
