//! Rendering of a speculative benchmark: a markdown table per model, the JSON with every
//! number, and a PNG bar chart of speedups (drawn here with a built-in 5×7 bitmap font, so no
//! font or plotting library is needed).

use super::spec::{CellSummary, ModelReport, SpecBenchReport};
use anyhow::{Context, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Draft-block sizes whose verify cost the report quotes.
const CURVE_POINTS: [usize; 5] = [2, 4, 8, 12, 16];

fn fmt_temp(t: f32) -> String {
    format!("{t}")
}

/// The verify-cost curve as `cost(2) 1.31 · cost(4) 2.50 · …` (the points measured).
pub fn curve_line(curve: &[f64]) -> String {
    let parts: Vec<String> =
        CURVE_POINTS.iter().filter_map(|&m| curve.get(m - 1).map(|c| format!("cost({m}) {c:.2}"))).collect();
    if parts.is_empty() {
        "not measured".to_string()
    } else {
        parts.join(" · ")
    }
}

fn table_row(c: &CellSummary) -> String {
    let dash = || "–".to_string();
    let spec = c.drafter.is_some();
    let mismatches = match c.mismatches {
        Some(n) => format!("{n}/{}", c.prompts),
        None => dash(),
    };
    format!(
        "| {} | {} | {} | {:.2} | {:.2}× | {} | {:.2} | {:.2}× | {} | {} | {} | {} | {} | {} | {} | {} |",
        c.dataset,
        fmt_temp(c.temperature),
        c.mode,
        c.tokens_per_s,
        c.speedup,
        c.speedup_interval.map_or_else(dash, |(lo, hi)| format!("{lo:.2}–{hi:.2}")),
        c.decode_tokens_per_s,
        c.decode_speedup,
        if spec { format!("{:.2}", c.tau) } else { dash() },
        if spec { format!("{:.1}%", c.acceptance_rate * 100.0) } else { dash() },
        if spec { format!("{:.2}", c.mean_draft_len) } else { dash() },
        if spec { format!("{:.2}", 1000.0 * c.draft_secs / c.steps.max(1) as f64) } else { dash() },
        if spec { format!("{:.2}", c.mean_verify_cost) } else { dash() },
        if spec { format!("{:.2}×", c.bound) } else { dash() },
        if spec { format!("{:.0}%", c.of_bound * 100.0) } else { dash() },
        mismatches,
    )
}

/// One table per model: a row per data set × temperature × mode (plain decoding included).
pub fn render_markdown(report: &SpecBenchReport) -> String {
    let mut s = String::new();
    let mut limit = report.limit.map_or("all".to_string(), |l| l.to_string());
    if report.skip > 0 {
        limit = format!("{limit} after the first {}", report.skip);
    }
    let _ = writeln!(
        s,
        "Prompts per data set: {limit} · max tokens: {} · batch 1 · seed {} · threads: {}\n",
        report.max_tokens, report.seed, report.threads
    );
    let run = &report.run;
    let _ = writeln!(
        s,
        "Run {} · commit {} · CPU {} ({})\n",
        run.date,
        run.commit.as_deref().map_or("unknown", |c| &c[..c.len().min(12)]),
        run.cpu_model.as_deref().unwrap_or("unknown"),
        if run.cpu_flags.is_empty() { "flags unknown".to_string() } else { run.cpu_flags.join(" ") }
    );
    for m in &report.models {
        let _ = writeln!(s, "### {} ({})\n", m.model, m.weights);
        let _ = writeln!(s, "Verify-cost curve cost(m)/cost(1): {}\n", curve_line(&m.verify_curve));
        let _ = writeln!(
            s,
            "| data set | T | mode | tok/s | speedup | 95% interval | decode tok/s | decode speedup | τ | acceptance | mean k | draft ms/step | verify cost | bound | of bound | greedy mismatches |"
        );
        let _ = writeln!(s, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for c in &m.cells {
            let _ = writeln!(s, "{}", table_row(c));
        }
        s.push('\n');
        let spec: Vec<&CellSummary> = m.cells.iter().filter(|c| c.drafter.is_some() && c.steps > 0).collect();
        if !spec.is_empty() {
            let _ = writeln!(
                s,
                "| data set | T | mode | τ | its 95% interval over prompts | nodes/step | accepted by depth 1, 2, … | accepted by sibling rank 0, 1, … |"
            );
            let _ = writeln!(s, "|---|---|---|---:|---:|---:|---|---|");
            let shares = |v: &[f64]| v.iter().map(|a| format!("{:.0}%", a * 100.0)).collect::<Vec<_>>().join(" ");
            for c in spec {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {:.2} | {} | {:.2} | {} | {} |",
                    c.dataset,
                    fmt_temp(c.temperature),
                    c.mode,
                    c.tau,
                    c.tau_interval.map_or("–".to_string(), |(lo, hi)| format!("{lo:.2}–{hi:.2}")),
                    c.mean_draft_len,
                    shares(&c.acceptance_at),
                    shares(&c.acceptance_at_rank)
                );
            }
            s.push('\n');
        }
    }
    let _ = writeln!(
        s,
        "tok/s = generated tokens / (prefill + decode) seconds; decode tok/s excludes prefill and the first token. \
         95% interval: of the speedup, from a paired bootstrap over the prompts (the run-to-run noise). \
         τ = tokens committed per target verify step; mean k = drafted tokens (tree nodes) per step; draft ms/step = time \
         spent drafting per verify step (catching up excluded); verify cost = mean \
         cost(k+1)/cost(1) of the steps run; bound = τ / verify cost, the decode speedup if drafting were free; \
         of bound = decode speedup / bound. Greedy mismatches: prompts at T=0 whose speculative output differs \
         from plain decoding (must be 0). Accepted by depth d: of the steps whose draft reached depth d, the share \
         that accepted a token there; by sibling rank r: of the times the verifier tried a drafter's r-th choice \
         (the better ones rejected), the share accepted. τ's 95% interval: from a bootstrap over the prompts, how \
         far another sample of prompts of the set could move τ."
    );
    let _ = writeln!(s, "\nGreedy mismatches in total: {}", report.greedy_mismatches);
    s
}

/// Paths written by [`write_all`].
pub struct WrittenReport {
    pub markdown: PathBuf,
    pub json: PathBuf,
    pub chart: PathBuf,
}

/// Writes `report.md`, `report.json` and `chart.svg` into `dir` (created if missing).
pub fn write_all(report: &SpecBenchReport, markdown: &str, dir: &Path) -> Result<WrittenReport> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let out =
        WrittenReport { markdown: dir.join("report.md"), json: dir.join("report.json"), chart: dir.join("chart.svg") };
    std::fs::write(&out.markdown, markdown).with_context(|| format!("writing {}", out.markdown.display()))?;
    std::fs::write(&out.json, serde_json::to_string_pretty(report)?)
        .with_context(|| format!("writing {}", out.json.display()))?;
    std::fs::write(&out.chart, render_chart_svg(report)?)
        .with_context(|| format!("writing {}", out.chart.display()))?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// Chart

/// Bar colours by mode (plotters' palette of clearly distinct colours).
fn mode_colour(i: usize) -> RGBColor {
    const PALETTE: [(u8, u8, u8); 8] = [
        (31, 119, 180),
        (255, 127, 14),
        (44, 160, 44),
        (148, 103, 189),
        (140, 86, 75),
        (227, 119, 194),
        (127, 127, 127),
        (23, 190, 207),
    ];
    let (r, g, b) = PALETTE[i % PALETTE.len()];
    RGBColor(r, g, b)
}

struct Bar {
    mode: usize,
    speedup: f64,
    bound: f64,
    tau: f64,
}

/// One group of bars: a model × data set × temperature.
struct BarGroup {
    label: Vec<String>,
    bars: Vec<Bar>,
}

fn finite_or_zero(x: f64) -> f64 {
    if x.is_finite() {
        x.max(0.0)
    } else {
        0.0
    }
}

fn bar_groups(report: &SpecBenchReport, modes: &[String]) -> Vec<BarGroup> {
    let mut groups = Vec::new();
    for m in &report.models {
        for ds in &report.datasets {
            for &t in &report.temperatures {
                let bars: Vec<Bar> = m
                    .cells
                    .iter()
                    .filter(|c| &c.dataset == ds && c.temperature == t && c.drafter.is_some())
                    .filter_map(|c| {
                        let mode = modes.iter().position(|x| x == &c.mode)?;
                        Some(Bar {
                            mode,
                            speedup: finite_or_zero(c.speedup),
                            bound: finite_or_zero(c.bound),
                            tau: finite_or_zero(c.tau),
                        })
                    })
                    .collect();
                if bars.is_empty() {
                    continue;
                }
                let mut label = vec![ds.clone(), format!("T={}", fmt_temp(t))];
                if report.models.len() > 1 {
                    label.insert(0, short_model(m));
                }
                groups.push(BarGroup { label, bars });
            }
        }
    }
    groups
}

fn short_model(m: &ModelReport) -> String {
    m.model.rsplit('/').next().unwrap_or(&m.model).trim_end_matches(".gguf").to_string()
}

/// Bars of end-to-end speedup over plain decoding for every data set × temperature ×
/// speculative mode, each labelled with its speedup and τ, the verify-cost bound τ/cost(k+1)
/// of each as a black tick, and plain decoding (1×) as a red line. Drawn with plotters as SVG.
pub fn render_chart_svg(report: &SpecBenchReport) -> Result<String> {
    const BAR: u32 = 56;
    const GAP: u32 = 28;
    let modes: Vec<String> = report.modes.iter().filter(|m| *m != "plain").cloned().collect();
    let groups = bar_groups(report, &modes);
    let n_bars: usize = groups.iter().map(|g| g.bars.len()).sum();
    let width = (120 + n_bars as u32 * BAR + groups.len() as u32 * GAP).max(640);
    let label_lines = groups.iter().map(|g| g.label.len()).max().unwrap_or(1) as u32;
    let height = 480 + 18 * label_lines;
    let y_top =
        groups.iter().flat_map(|g| g.bars.iter().flat_map(|b| [b.speedup, b.bound])).fold(1.0f64, f64::max) * 1.2;
    let subtitle: String = report
        .models
        .iter()
        .map(|m| format!("{} ({}), {} tokens", short_model(m), m.weights, report.max_tokens))
        .collect::<Vec<_>>()
        .join("; ");

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        let err = |e: DrawingAreaErrorKind<std::io::Error>| anyhow::anyhow!("drawing the chart: {e:?}");
        root.fill(&WHITE).map_err(err)?;
        // x: one unit per bar, a gap of half a unit between groups.
        let x_max = n_bars as f64 + 0.5 * groups.len() as f64 + 0.5;
        let mut chart = ChartBuilder::on(&root)
            .caption(format!("Speedup over plain decoding (end to end) — {subtitle}"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(18 * label_lines + 12)
            .y_label_area_size(56)
            .build_cartesian_2d(0f64..x_max.max(1.0), 0f64..y_top)
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .disable_x_axis()
            .y_desc("speedup (×)")
            .y_label_formatter(&|v| format!("{v:.2}×"))
            .draw()
            .map_err(err)?;
        chart
            .draw_series(LineSeries::new([(0.0, 1.0), (x_max, 1.0)], RED.stroke_width(2)))
            .map_err(err)?
            .label("plain decoding (1×)")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RED.stroke_width(2)));
        for (i, mode) in modes.iter().enumerate() {
            // Empty series, for the legend entry of each mode.
            chart
                .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
                .map_err(err)?
                .label(mode.as_str())
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], mode_colour(i).filled()));
        }
        chart
            .draw_series(std::iter::empty::<PathElement<(f64, f64)>>())
            .map_err(err)?
            .label("bound τ / cost(k+1)")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK.stroke_width(3)));
        let mut x = 0.5;
        for g in &groups {
            let start = x;
            for bar in &g.bars {
                let (x0, x1) = (x + 0.08, x + 0.92);
                let colour = mode_colour(bar.mode);
                chart.draw_series([Rectangle::new([(x0, 0.0), (x1, bar.speedup)], colour.filled())]).map_err(err)?;
                if bar.bound > 0.0 {
                    chart
                        .draw_series([PathElement::new(
                            [(x0 - 0.05, bar.bound), (x1 + 0.05, bar.bound)],
                            BLACK.stroke_width(3),
                        )])
                        .map_err(err)?;
                }
                let label = format!("{:.2}× τ{:.2}", bar.speedup, bar.tau);
                chart
                    .draw_series([Text::new(
                        label,
                        (x + 0.5, bar.speedup.max(bar.bound) + y_top * 0.02),
                        ("sans-serif", 12).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Bottom)),
                    )])
                    .map_err(err)?;
                x += 1.0;
            }
            for (i, line) in g.label.iter().enumerate() {
                chart
                    .draw_series([Text::new(
                        line.clone(),
                        ((start + x) / 2.0, -y_top * (0.03 + 0.045 * i as f64)),
                        ("sans-serif", 13).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Top)),
                    )])
                    .map_err(err)?;
            }
            x += 0.5;
        }
        if groups.is_empty() {
            chart
                .draw_series([Text::new("no speculative runs", (0.3, y_top / 2.0), ("sans-serif", 16).into_font())])
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// The verify-cost curve of each (label, points): cost(m)/cost(1) against the rows m verified
/// in one forward, with the ideal of a GPU (flat at 1) and of pure arithmetic (m) for scale.
/// Drawn with plotters as SVG.
pub fn render_cost_curve_svg(curves: &[(String, Vec<(usize, f64)>)]) -> Result<String> {
    let m_max = curves.iter().flat_map(|(_, p)| p.iter().map(|&(m, _)| m)).max().unwrap_or(16).max(2) as f64;
    let y_max = curves.iter().flat_map(|(_, p)| p.iter().map(|&(_, r)| r)).fold(2.0f64, f64::max) * 1.1;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 460)).into_drawing_area();
        let err = |e: DrawingAreaErrorKind<std::io::Error>| anyhow::anyhow!("drawing the chart: {e:?}");
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("Verify cost: one forward over m rows, relative to one row", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(1f64..m_max, 0f64..y_max)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("rows verified together (m = draft length + 1)")
            .y_desc("cost(m) / cost(1)")
            .draw()
            .map_err(err)?;
        chart
            .draw_series(LineSeries::new([(1.0, 1.0), (y_max.min(m_max), y_max.min(m_max))], RGBColor(180, 180, 180)))
            .map_err(err)?
            .label("cost ∝ m (arithmetic-bound)")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RGBColor(180, 180, 180)));
        chart
            .draw_series(LineSeries::new([(1.0, 1.0), (m_max, 1.0)], RED.stroke_width(2)))
            .map_err(err)?
            .label("flat (an idle GPU)")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RED.stroke_width(2)));
        for (i, (label, points)) in curves.iter().enumerate() {
            let colour = mode_colour(i);
            let pts: Vec<(f64, f64)> = points.iter().map(|&(m, r)| (m as f64, r)).collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)).point_size(3))
                .map_err(err)?
                .label(label.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], colour.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Serving throughput against concurrent clients: output tokens per second (left axis) and the
/// median inter-token latency (right axis) per round of `specula loadtest`. Drawn with plotters
/// as SVG. `rounds`: (clients, output tok/s, median ITL ms).
pub fn render_throughput_svg(title: &str, rounds: &[(usize, f64, f64)]) -> Result<String> {
    let c_max = rounds.iter().map(|r| r.0).max().unwrap_or(1).max(2) as f64;
    let tps_max = rounds.iter().map(|r| r.1).fold(1.0f64, f64::max) * 1.15;
    let itl_max = rounds.iter().map(|r| r.2).fold(1.0f64, f64::max) * 1.15;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (720, 440)).into_drawing_area();
        let err = |e: DrawingAreaErrorKind<std::io::Error>| anyhow::anyhow!("drawing the chart: {e:?}");
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .right_y_label_area_size(60)
            .build_cartesian_2d(0f64..c_max * 1.05, 0f64..tps_max)
            .map_err(err)?
            .set_secondary_coord(0f64..c_max * 1.05, 0f64..itl_max);
        chart.configure_mesh().x_desc("concurrent clients").y_desc("output tokens/s").draw().map_err(err)?;
        chart.configure_secondary_axes().y_desc("median inter-token latency (ms)").draw().map_err(err)?;
        let blue = mode_colour(0);
        let orange = mode_colour(1);
        chart
            .draw_series(LineSeries::new(rounds.iter().map(|r| (r.0 as f64, r.1)), blue.stroke_width(2)).point_size(4))
            .map_err(err)?
            .label("output tokens/s")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], blue.stroke_width(2)));
        chart
            .draw_secondary_series(
                LineSeries::new(rounds.iter().map(|r| (r.0 as f64, r.2)), orange.stroke_width(2)).point_size(4),
            )
            .map_err(err)?
            .label("median ITL (ms)")
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], orange.stroke_width(2)));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::spec::{summarize_all, Mode, PromptRun};
    use crate::speculative::policy::DraftLen;
    use crate::speculative::SpecMetrics;

    fn report(datasets: &[&str], temps: &[f32], modes: &[Mode], models: usize) -> SpecBenchReport {
        let curve: Vec<f64> = (1..=16).map(|m| 1.0 + 0.35 * (m - 1) as f64).collect();
        let datasets: Vec<String> = datasets.iter().map(|s| s.to_string()).collect();
        let mut runs = Vec::new();
        for ds in &datasets {
            for &t in temps {
                for (i, mode) in modes.iter().enumerate() {
                    let mut m = SpecMetrics::default();
                    for _ in 0..8 {
                        if mode.is_plain() {
                            m.record(0, 0, 1);
                        } else {
                            m.record(4, i % 4 + 1, i % 4 + 2);
                        }
                    }
                    runs.push(PromptRun {
                        dataset: ds.clone(),
                        temperature: t,
                        mode: mode.label(),
                        prompt_id: "p0".into(),
                        prompt_tokens: 12,
                        tokens: 32,
                        finish: "length".into(),
                        prefill_secs: 0.1,
                        decode_secs: 1.0 / (i + 1) as f64,
                        tokens_per_s: 0.0,
                        decode_tokens_per_s: 0.0,
                        tau: m.tau(),
                        acceptance_rate: m.acceptance_rate(),
                        matches_plain: (!mode.is_plain() && t == 0.0).then_some(true),
                        metrics: m,
                        first_mismatch: None,
                    });
                }
            }
        }
        let cost =
            crate::speculative::StepCost::from_points(curve.iter().enumerate().map(|(i, &c)| (i + 1, c)).collect());
        let cells = summarize_all(&runs, modes, &datasets, temps, &cost);
        let model = |k: usize| ModelReport {
            model: format!("model-{k}"),
            path: format!("/m/model-{k}.gguf"),
            weights: "q8_0".into(),
            verify_curve: curve.clone(),
            cells: cells.clone(),
            runs: runs.clone(),
        };
        SpecBenchReport {
            run: crate::bench::RunInfo::now(),
            threads: "2".into(),
            datasets,
            temperatures: temps.to_vec(),
            modes: modes.iter().map(Mode::label).collect(),
            skip: 0,
            limit: Some(1),
            max_tokens: 32,
            seed: 0,
            models: (0..models).map(model).collect(),
            greedy_mismatches: 0,
        }
    }

    fn modes() -> Vec<Mode> {
        vec![
            Mode::plain(),
            Mode::spec("ngram", DraftLen::Fixed(4)),
            Mode::spec("draft-model:qwen2.5-coder-0.5b", DraftLen::Auto),
        ]
    }

    #[test]
    fn table_has_one_row_per_dataset_temperature_and_mode() {
        let r = report(&["humaneval", "gsm8k-100"], &[0.0, 1.0], &modes(), 1);
        let md = render_markdown(&r);
        // The main table's rows (the acceptance table below it has no speedups).
        let rows: Vec<&str> =
            md.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| data set") && l.contains('×')).collect();
        assert_eq!(rows.len(), 2 * 2 * 3);
        let by_rank = md.lines().filter(|l| l.starts_with("| ") && !l.contains('×') && !l.starts_with("| data set"));
        assert_eq!(by_rank.count(), 2 * 2 * 2, "an acceptance row per speculative cell");
        for ds in ["humaneval", "gsm8k-100"] {
            for mode in ["plain", "ngram k=4", "draft-model:qwen2.5-coder-0.5b k=auto"] {
                let n = rows
                    .iter()
                    .filter(|l| l.starts_with(&format!("| {ds} |")) && l.contains(&format!("| {mode} |")))
                    .count();
                assert_eq!(n, 2, "{ds} {mode}");
            }
        }
        // Plain rows run at 1×; greedy speculative rows report 0 of 1 prompts mismatching.
        let plain = rows.iter().find(|l| l.contains("| plain |")).unwrap();
        assert!(plain.contains("| 1.00× |"));
        let greedy_ngram = rows.iter().find(|l| l.contains("| 0 | ngram k=4 |")).unwrap();
        assert!(greedy_ngram.ends_with("| 0/1 |"), "{greedy_ngram}");
        let sampled_ngram = rows.iter().find(|l| l.contains("| 1 | ngram k=4 |")).unwrap();
        assert!(sampled_ngram.ends_with("| – |"), "{sampled_ngram}");
        assert!(md.contains("cost(4) 2.05"), "curve line missing: {md}");
    }

    #[test]
    fn chart_draws_a_bar_per_mode_and_group_with_its_labels() {
        for (datasets, temps, models) in
            [(vec!["humaneval"], vec![0.0], 1), (vec!["humaneval", "gsm8k-100", "mt-bench"], vec![0.0, 1.0], 2)]
        {
            let r = report(&datasets, &temps, &modes(), models);
            let svg = render_chart_svg(&r).unwrap();
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
            let groups = datasets.len() * temps.len() * models;
            // Two speculative modes per group, each a filled bar in its colour.
            for i in 0..2 {
                let c = mode_colour(i);
                let fill = format!("fill=\"#{:02X}{:02X}{:02X}\"", c.0, c.1, c.2);
                assert!(svg.matches(&fill).count() >= groups, "mode {i}: {fill}");
            }
            for ds in &datasets {
                assert!(svg.contains(ds), "{ds}");
            }
            assert!(svg.contains("plain decoding") && svg.contains("bound τ / cost(k+1)"));
        }
    }

    #[test]
    fn throughput_chart_has_both_series() {
        let svg = render_throughput_svg("load", &[(1, 150.0, 6.0), (4, 400.0, 9.0), (8, 520.0, 14.0)]).unwrap();
        assert!(svg.contains("output tokens/s") && svg.contains("median ITL (ms)") && svg.contains("load"));
    }

    #[test]
    fn cost_curve_chart_has_a_line_per_model() {
        let curves = vec![
            ("smollm2-135m native".to_string(), vec![(1, 1.0), (2, 1.1), (4, 1.4), (8, 2.2)]),
            ("qwen2.5-coder-1.5b native".to_string(), vec![(1, 1.0), (2, 1.0), (4, 1.3), (8, 1.8)]),
        ];
        let svg = render_cost_curve_svg(&curves).unwrap();
        assert!(svg.contains("smollm2-135m native") && svg.contains("qwen2.5-coder-1.5b native"));
        assert!(svg.matches("<polyline").count() >= 4, "two reference lines and two curves");
    }

    #[test]
    fn chart_without_speculative_modes_still_renders() {
        let r = report(&["humaneval"], &[0.0], &[Mode::plain()], 1);
        assert!(render_chart_svg(&r).unwrap().contains("no speculative runs"));
    }

    #[test]
    fn writes_all_three_files() {
        let r = report(&["humaneval"], &[0.0], &modes(), 1);
        let dir = tempfile::tempdir().unwrap();
        let md = render_markdown(&r);
        let out = write_all(&r, &md, &dir.path().join("nested")).unwrap();
        assert_eq!(std::fs::read_to_string(&out.markdown).unwrap(), md);
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out.json).unwrap()).unwrap();
        assert_eq!(json["models"][0]["cells"].as_array().unwrap().len(), 3);
        assert_eq!(json["models"][0]["verify_curve"].as_array().unwrap().len(), 16);
        assert!(json["models"][0]["cells"][1]["bound"].as_f64().unwrap() > 1.0);
        assert!(std::fs::read_to_string(&out.chart).unwrap().starts_with("<svg"));
    }
}
