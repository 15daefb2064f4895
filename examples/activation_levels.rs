//! What the activation levels cost, measured in one process: the model is loaded once per
//! setting and the settings take turns, round after round, on the same forwards (a prefill
//! of `--prefill` tokens; a verify-sized forward of 8 rows after 256 tokens of context; a
//! single decode row after the same context). Prints each setting's best and median time
//! and, per forward, its median ratio to `one` over the rounds. Turns within one round run
//! back to back, so the machine's drift (±20% here over minutes) mostly cancels.
//!
//!     cargo run --release --example activation_levels -- MODEL [--rounds 15] [--prefill 512]

use anyhow::{Context, Result};
use specula::engine::LoadedModel;
use specula::model::{ActivationLevels, ForwardBatch, KernelSettings, LogitsRows, Transformer};
use std::time::Instant;

const SETTINGS: [(&str, ActivationLevels); 3] =
    [("one", ActivationLevels::One), ("outliers", ActivationLevels::Outliers), ("two", ActivationLevels::Two)];

/// Seconds for one forward of `rows` new tokens after `context` tokens.
fn time_forward(model: &Transformer, tokens: &[u32], context: usize, rows: usize) -> Result<f64> {
    let pool = model.new_kv_pool((context + rows).next_multiple_of(16));
    let mut cache = pool.new_sequence();
    if context > 0 {
        let mut batch = ForwardBatch::new();
        batch.push(&tokens[..context], &mut cache, LogitsRows::None);
        model.forward(&mut batch)?;
    }
    let mut batch = ForwardBatch::new();
    let logits = if rows == 1 || context == 0 { LogitsRows::Last } else { LogitsRows::All };
    batch.push(&tokens[context..context + rows], &mut cache, logits);
    let start = Instant::now();
    model.forward(&mut batch)?;
    Ok(start.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args.first().context("usage: activation_levels MODEL [--rounds N] [--prefill N]")?;
    let flag = |name: &str, default: usize| -> Result<usize> {
        match args.iter().position(|a| a == name) {
            Some(i) => Ok(args.get(i + 1).context("flag value")?.parse()?),
            None => Ok(default),
        }
    };
    let (rounds, prefill) = (flag("--rounds", 15)?, flag("--prefill", 512)?);
    let path = specula::fetch::resolve_model(model, false)?;
    let device = candle_core::Device::Cpu;
    let models: Vec<LoadedModel> = SETTINGS
        .iter()
        .map(|&(_, levels)| {
            let settings = KernelSettings { activation_levels: levels, ..KernelSettings::from_env() };
            LoadedModel::load_with(&path, &settings, &device)
        })
        .collect::<Result<_>>()?;
    // Any fixed text: the cost does not depend on which tokens.
    let text = "The quick brown fox jumps over the lazy dog while the committee reviews its budget. ".repeat(200);
    let tokens = models[0].encode_prompt(&text)?;
    let needed = prefill.max(256 + 8);
    anyhow::ensure!(tokens.len() >= needed, "the filler text is {} tokens, {needed} needed", tokens.len());
    let forwards = [("prefill", 0, prefill), ("8 rows after 256", 256, 8), ("1 row after 256", 256, 1)];
    // times[forward][setting][round]
    let mut times = vec![vec![Vec::new(); SETTINGS.len()]; forwards.len()];
    for _ in 0..rounds {
        for (f, &(_, context, rows)) in forwards.iter().enumerate() {
            for (s, loaded) in models.iter().enumerate() {
                times[f][s].push(time_forward(&loaded.model, &tokens, context, rows)?);
            }
        }
    }
    println!("| {model}: forward | setting | best ms | median ms | median ratio to one |");
    println!("|---|---|---|---|---|");
    for (f, &(name, _, _)) in forwards.iter().enumerate() {
        for (s, &(setting, _)) in SETTINGS.iter().enumerate() {
            let ratios: Vec<f64> = times[f][s].iter().zip(&times[f][0]).map(|(t, one)| t / one).collect();
            let best = times[f][s].iter().copied().fold(f64::MAX, f64::min);
            println!(
                "| {name} | {setting} | {:.2} | {:.2} | {:.3} |",
                best * 1e3,
                median(times[f][s].clone()) * 1e3,
                median(ratios)
            );
        }
    }
    Ok(())
}
