//! Teacher-forced accuracy of weight paths and of llama.cpp against exact f32 arithmetic, on
//! greedy-reference files (prompt, llama.cpp's greedy tokens and their top-3 log-probs; made by
//! `tools/llamacpp_reference/greedy.py`). The definitions are in `specula::model::accuracy`;
//! docs/kernels.md has the tables this prints.
//!
//!     cargo run --release --example kernel_accuracy -- MODEL CASES.json [CASES.json ...]
//!         [--weights default,q8_0,...] [--verbose]
//!
//! MODEL: a model key or GGUF path. Each weight path and llama.cpp are compared with
//! `--weights f32` on prompt + llama.cpp's tokens (all rows of one forward).

use anyhow::{bail, Context, Result};
use specula::engine::LoadedModel;
use specula::model::accuracy::{teacher_forced_logprobs, Agreement};
use specula::model::WeightFormat;

struct Case {
    prompt: String,
    tokens: Vec<u32>,
    /// llama.cpp's log-prob of each of its tokens.
    llama_lp: Vec<f32>,
}

fn read_cases(path: &str) -> Result<Vec<Case>> {
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(path).with_context(|| path.to_string())?)?;
    let mut cases = Vec::new();
    for r in json["results"].as_array().context("no results")? {
        if r["mode"] != "completion" || r["top3"].is_null() {
            continue;
        }
        let tokens: Vec<u32> =
            r["token_ids"].as_array().context("token_ids")?.iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let mut llama_lp = Vec::new();
        for (t, top) in tokens.iter().zip(r["top3"].as_array().context("top3")?) {
            let first = &top[0];
            if first[0].as_u64() != Some(*t as u64) {
                bail!("{path}: a token is not llama.cpp's top-1 (not a greedy run)");
            }
            llama_lp.push(first[1].as_f64().context("log-prob")? as f32);
        }
        cases.push(Case { prompt: r["prompt"].as_str().context("prompt")?.to_string(), tokens, llama_lp });
    }
    Ok(cases)
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let model = args.next().context("usage: kernel_accuracy MODEL CASES.json... [--weights a,b] [--verbose]")?;
    let (mut files, mut paths, mut verbose) = (Vec::new(), vec!["default".to_string()], false);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--weights" => paths = args.next().context("--weights LIST")?.split(',').map(String::from).collect(),
            "--verbose" => verbose = true,
            _ => files.push(a),
        }
    }
    let cases: Vec<Case> =
        files.iter().map(|f| read_cases(f)).collect::<Result<Vec<_>>>()?.into_iter().flatten().collect();
    let path = specula::fetch::resolve_model(&model, false)?;
    let device = candle_core::Device::Cpu;
    let exact = LoadedModel::load(&path, Some(WeightFormat::F32), &device)?;
    let mut exact_rows = Vec::new();
    for c in &cases {
        let prompt = exact.encode_prompt(&c.prompt)?;
        exact_rows.push((prompt.clone(), teacher_forced_logprobs(&exact.model, &prompt, &c.tokens)?));
    }
    drop(exact);
    let mut llama = Agreement::default();
    for (c, (_, rows)) in cases.iter().zip(&exact_rows) {
        for ((row, &t), &lp) in rows.iter().zip(&c.tokens).zip(&c.llama_lp) {
            llama.add(t, lp, row, t);
        }
    }
    let mut table = vec![("llama.cpp".to_string(), llama)];
    for name in &paths {
        let weights = if name == "default" { None } else { Some(WeightFormat::parse(name)?) };
        let loaded = LoadedModel::load(&path, weights, &device)?;
        let label = format!("specula {name} ({})", loaded.model.weight_format.name());
        let mut agg = Agreement::default();
        for (c, (prompt, rows)) in cases.iter().zip(&exact_rows) {
            let ours = teacher_forced_logprobs(&loaded.model, prompt, &c.tokens)?;
            for (i, ((row, f32_row), &t)) in ours.iter().zip(rows).zip(&c.tokens).enumerate() {
                agg.add_row(row, f32_row, t);
                if verbose {
                    let (a, b) = (specula::sample::argmax(row), specula::sample::argmax(f32_row));
                    println!(
                        "{label} {:?} step {i:2}: token {t} lp {:.4} f32 {:.4} llama.cpp {:.4} | argmax {a} f32 {b}{}",
                        c.prompt,
                        row[t as usize],
                        f32_row[t as usize],
                        c.llama_lp[i],
                        if a != b { "  DIFFERENT" } else { "" }
                    );
                }
            }
        }
        table.push((label, agg));
    }
    println!("| {model} vs f32 | prompts | steps | top-1 = f32 | max |Δ log-prob| | mean |Δ log-prob| |");
    println!("|---|---|---|---|---|---|");
    for (label, a) in table {
        println!(
            "| {label} | {} | {} | {} | {:.4} | {:.4} |",
            cases.len(),
            a.steps,
            a.top1_same,
            a.max_abs,
            a.mean_abs()
        );
    }
    Ok(())
}
