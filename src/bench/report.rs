//! Rendering of a speculative benchmark: a markdown table per model, the JSON with every
//! number, and a PNG bar chart of speedups (drawn here with a built-in 5×7 bitmap font, so no
//! font or plotting library is needed).

use super::spec::{CellSummary, ModelReport, SpecBenchReport};
use anyhow::{Context, Result};
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
        "| {} | {} | {} | {:.2} | {:.2}× | {:.2} | {:.2}× | {} | {} | {} | {} | {} | {} | {} | {} |",
        c.dataset,
        fmt_temp(c.temperature),
        c.mode,
        c.tokens_per_s,
        c.speedup,
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
    let limit = report.limit.map_or("all".to_string(), |l| l.to_string());
    let _ = writeln!(
        s,
        "Prompts per data set: {limit} · max tokens: {} · batch 1 · seed {} · threads: {}\n",
        report.max_tokens, report.seed, report.threads
    );
    for m in &report.models {
        let _ = writeln!(s, "### {} ({})\n", m.model, m.weights);
        let _ = writeln!(s, "Verify-cost curve cost(m)/cost(1): {}\n", curve_line(&m.verify_curve));
        let _ = writeln!(
            s,
            "| data set | T | mode | tok/s | speedup | decode tok/s | decode speedup | τ | acceptance | mean k | draft ms/step | verify cost | bound | of bound | greedy mismatches |"
        );
        let _ = writeln!(s, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for c in &m.cells {
            let _ = writeln!(s, "{}", table_row(c));
        }
        s.push('\n');
    }
    let _ = writeln!(
        s,
        "tok/s = generated tokens / (prefill + decode) seconds; decode tok/s excludes prefill and the first token. \
         τ = tokens committed per target verify step; mean k = drafted tokens per step; draft ms/step = time \
         spent drafting per verify step (catching up excluded); verify cost = mean \
         cost(k+1)/cost(1) of the steps run; bound = τ / verify cost, the decode speedup if drafting were free; \
         of bound = decode speedup / bound. Greedy mismatches: prompts at T=0 whose speculative output differs \
         from plain decoding (must be 0)."
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

/// Writes `report.md`, `report.json` and `chart.png` into `dir` (created if missing).
pub fn write_all(report: &SpecBenchReport, markdown: &str, dir: &Path) -> Result<WrittenReport> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let out =
        WrittenReport { markdown: dir.join("report.md"), json: dir.join("report.json"), chart: dir.join("chart.png") };
    std::fs::write(&out.markdown, markdown).with_context(|| format!("writing {}", out.markdown.display()))?;
    std::fs::write(&out.json, serde_json::to_string_pretty(report)?)
        .with_context(|| format!("writing {}", out.json.display()))?;
    std::fs::write(&out.chart, render_chart_png(report)?)
        .with_context(|| format!("writing {}", out.chart.display()))?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// Chart

type Rgb = [u8; 3];

const WHITE: Rgb = [255, 255, 255];
const BLACK: Rgb = [0, 0, 0];
const GRID: Rgb = [222, 222, 222];
const AXIS: Rgb = [90, 90, 90];
const PLAIN_LINE: Rgb = [200, 0, 0];
const PALETTE: [Rgb; 8] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [23, 190, 207],
];

/// An RGB image being drawn; everything outside is clipped.
struct Canvas {
    width: usize,
    height: usize,
    pixels: Vec<u8>,
}

impl Canvas {
    fn new(width: usize, height: usize) -> Self {
        Self { width, height, pixels: WHITE.repeat(width * height) }
    }

    fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x >= 0 && y >= 0 && (x as usize) < self.width && (y as usize) < self.height {
            let i = (y as usize * self.width + x as usize) * 3;
            self.pixels[i..i + 3].copy_from_slice(&c);
        }
    }

    fn fill_rect(&mut self, x: i64, y: i64, w: i64, h: i64, c: Rgb) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.set(xx, yy, c);
            }
        }
    }

    /// Horizontal line; `dash` > 0 draws dashes of that length.
    fn hline(&mut self, x0: i64, x1: i64, y: i64, thickness: i64, c: Rgb, dash: i64) {
        for x in x0..=x1 {
            if dash == 0 || ((x - x0) / dash) % 2 == 0 {
                self.fill_rect(x, y, 1, thickness, c);
            }
        }
    }

    /// Text in the 5×7 font at `scale`, top-left at (x, y). Lowercase prints as uppercase.
    fn text(&mut self, x: i64, y: i64, s: &str, scale: i64, c: Rgb) {
        for (i, ch) in s.chars().enumerate() {
            let rows = glyph(ch);
            let gx = x + i as i64 * GLYPH_ADVANCE * scale;
            for (ry, row) in rows.iter().enumerate() {
                for (rx, bit) in row.bytes().enumerate() {
                    if bit == b'#' {
                        self.fill_rect(gx + rx as i64 * scale, y + ry as i64 * scale, scale, scale, c);
                    }
                }
            }
        }
    }

    fn encode_png(&self) -> Result<Vec<u8>> {
        let mut bytes = Vec::new();
        {
            let mut enc = png::Encoder::new(&mut bytes, self.width as u32, self.height as u32);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut writer = enc.write_header().context("encoding the chart")?;
            writer.write_image_data(&self.pixels).context("encoding the chart")?;
        }
        Ok(bytes)
    }
}

/// Horizontal pixels per character at scale 1 (5 columns + 1 space).
const GLYPH_ADVANCE: i64 = 6;
const GLYPH_HEIGHT: i64 = 7;

fn text_width(s: &str, scale: i64) -> i64 {
    let n = s.chars().count() as i64;
    if n == 0 {
        0
    } else {
        (n * GLYPH_ADVANCE - 1) * scale
    }
}

/// 5×7 glyphs, one string per row, `#` = ink.
const FONT: &[(char, [&str; 7])] = &[
    (' ', [".....", ".....", ".....", ".....", ".....", ".....", "....."]),
    ('A', [".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"]),
    ('B', ["####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."]),
    ('C', [".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."]),
    ('D', ["####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."]),
    ('E', ["#####", "#....", "#....", "####.", "#....", "#....", "#####"]),
    ('F', ["#####", "#....", "#....", "####.", "#....", "#....", "#...."]),
    ('G', [".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".####"]),
    ('H', ["#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"]),
    ('I', [".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."]),
    ('J', ["..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."]),
    ('K', ["#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"]),
    ('L', ["#....", "#....", "#....", "#....", "#....", "#....", "#####"]),
    ('M', ["#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"]),
    ('N', ["#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"]),
    ('O', [".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."]),
    ('P', ["####.", "#...#", "#...#", "####.", "#....", "#....", "#...."]),
    ('Q', [".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"]),
    ('R', ["####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"]),
    ('S', [".####", "#....", "#....", ".###.", "....#", "....#", "####."]),
    ('T', ["#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."]),
    ('U', ["#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."]),
    ('V', ["#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."]),
    ('W', ["#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."]),
    ('X', ["#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"]),
    ('Y', ["#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."]),
    ('Z', ["#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"]),
    ('0', [".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."]),
    ('1', ["..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."]),
    ('2', [".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"]),
    ('3', ["####.", "....#", "....#", ".###.", "....#", "....#", "####."]),
    ('4', ["...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."]),
    ('5', ["#####", "#....", "####.", "....#", "....#", "#...#", ".###."]),
    ('6', ["..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."]),
    ('7', ["#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."]),
    ('8', [".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."]),
    ('9', [".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."]),
    ('.', [".....", ".....", ".....", ".....", ".....", ".##..", ".##.."]),
    (',', [".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."]),
    (':', [".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."]),
    ('-', [".....", ".....", ".....", "#####", ".....", ".....", "....."]),
    ('_', [".....", ".....", ".....", ".....", ".....", ".....", "#####"]),
    ('/', ["....#", "....#", "...#.", "..#..", ".#...", "#....", "#...."]),
    ('(', ["...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."]),
    (')', [".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."]),
    ('[', [".###.", ".#...", ".#...", ".#...", ".#...", ".#...", ".###."]),
    (']', [".###.", "...#.", "...#.", "...#.", "...#.", "...#.", ".###."]),
    ('=', [".....", ".....", "#####", ".....", "#####", ".....", "....."]),
    ('+', [".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."]),
    ('%', ["##..#", "##..#", "...#.", "..#..", ".#...", "#..##", "#..##"]),
    ('<', ["...#.", "..#..", ".#...", "#....", ".#...", "..#..", "...#."]),
    ('>', [".#...", "..#..", "...#.", "....#", "...#.", "..#..", ".#..."]),
    ('|', ["..#..", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."]),
    ('*', [".....", "..#..", "#.#.#", ".###.", "#.#.#", "..#..", "....."]),
    ('\'', ["..#..", "..#..", ".#...", ".....", ".....", ".....", "....."]),
    ('?', [".###.", "#...#", "....#", "...#.", "..#..", ".....", "..#.."]),
    ('×', [".....", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "....."]),
    ('τ', [".....", ".....", "#####", "..#..", "..#..", "..#..", "...##"]),
];

/// Characters without a glyph print as an outlined box.
const UNKNOWN_GLYPH: [&str; 7] = ["#####", "#...#", "#...#", "#...#", "#...#", "#...#", "#####"];

fn glyph(c: char) -> &'static [&'static str; 7] {
    let c = if c.is_ascii_lowercase() { c.to_ascii_uppercase() } else { c };
    FONT.iter().find(|(g, _)| *g == c).map_or(&UNKNOWN_GLYPH, |(_, rows)| rows)
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

/// Grid step for an axis up to `max`.
fn grid_step(max: f64) -> f64 {
    if max <= 2.0 {
        0.25
    } else if max <= 5.0 {
        0.5
    } else {
        (max / 8.0).ceil()
    }
}

/// Bars of end-to-end speedup over plain decoding for every data set × temperature ×
/// speculative mode, with the verify-cost bound of each as a dashed tick and the 1× line
/// (plain decoding) marked. Returns PNG bytes.
pub fn render_chart_png(report: &SpecBenchReport) -> Result<Vec<u8>> {
    const S: i64 = 2; // text scale
    const BAR_W: i64 = 64;
    const BAR_GAP: i64 = 8;
    const GROUP_GAP: i64 = 40;
    const PLOT_H: i64 = 380;
    const LEFT: i64 = 90;
    const RIGHT: i64 = 30;
    let line_h = (GLYPH_HEIGHT + 4) * S;

    let modes: Vec<String> = report.modes.iter().filter(|m| *m != "plain").cloned().collect();
    let groups = bar_groups(report, &modes);
    let title = "SPEEDUP OVER PLAIN DECODING (END TO END)";
    let subtitle: String = report
        .models
        .iter()
        .map(|m| format!("{} ({}), {} TOKENS", short_model(m), m.weights, report.max_tokens))
        .collect::<Vec<_>>()
        .join("; ");

    // Legend entries: one per mode, then the bound tick.
    let legend: Vec<(String, Option<Rgb>)> = modes
        .iter()
        .enumerate()
        .map(|(i, m)| (m.clone(), Some(PALETTE[i % PALETTE.len()])))
        .chain(std::iter::once(("bound τ/cost(k+1)".to_string(), None)))
        .collect();
    let legend_w: i64 = legend.iter().map(|(l, _)| 20 + 8 + text_width(l, S) + 24).sum();

    let label_lines = groups.iter().map(|g| g.label.len()).max().unwrap_or(1) as i64;
    let group_w: Vec<i64> = groups
        .iter()
        .map(|g| {
            let bars = g.bars.len() as i64 * BAR_W + (g.bars.len() as i64 - 1).max(0) * BAR_GAP;
            bars.max(g.label.iter().map(|l| text_width(l, S)).max().unwrap_or(0))
        })
        .collect();
    let groups_w = group_w.iter().map(|w| w + GROUP_GAP).sum::<i64>();
    let width = (LEFT + groups_w.max(300) + RIGHT)
        .max(text_width(title, S) + 40)
        .max(legend_w + 40)
        .max(text_width(&subtitle, S) + 40);
    // The plot takes the whole width; the groups sit in its middle.
    let plot_w = width - LEFT - RIGHT;
    let top = 20 + 3 * line_h + 20;
    let height = top + PLOT_H + 16 + label_lines * line_h + 20;
    let mut cv = Canvas::new(width as usize, height as usize);

    cv.text(20, 20, title, S, BLACK);
    cv.text(20, 20 + line_h, &subtitle, S, AXIS);
    let mut x = 20;
    let ly = 20 + 2 * line_h;
    for (label, color) in &legend {
        match color {
            Some(c) => cv.fill_rect(x, ly, 20, GLYPH_HEIGHT * S, *c),
            None => cv.hline(x, x + 19, ly + GLYPH_HEIGHT * S / 2 - 1, 3, BLACK, 4),
        }
        cv.text(x + 28, ly, label, S, BLACK);
        x += 20 + 8 + text_width(label, S) + 24;
    }

    let y_max_value =
        groups.iter().flat_map(|g| g.bars.iter().flat_map(|b| [b.speedup, b.bound])).fold(1.0f64, f64::max);
    let step = grid_step(y_max_value * 1.1);
    let y_max = ((y_max_value * 1.1) / step).ceil() * step;
    let y_of = |v: f64| top + PLOT_H - ((v / y_max) * PLOT_H as f64).round() as i64;

    // Grid and axis labels.
    let mut v = 0.0;
    while v <= y_max + 1e-9 {
        let y = y_of(v);
        cv.hline(LEFT, LEFT + plot_w, y, 1, GRID, 0);
        let label = format!("{v:.2}X");
        cv.text(LEFT - 10 - text_width(&label, S), y - GLYPH_HEIGHT * S / 2, &label, S, AXIS);
        v += step;
    }
    cv.fill_rect(LEFT, top, 2, PLOT_H + 1, AXIS);
    cv.hline(LEFT, LEFT + plot_w, y_of(0.0), 2, AXIS, 0);
    // Plain decoding (1×), under the bars; their value labels are drawn on a white ground.
    cv.hline(LEFT, LEFT + plot_w, y_of(1.0), 2, PLAIN_LINE, 10);
    cv.text(LEFT + plot_w - text_width("PLAIN", S), y_of(1.0) - 6 - GLYPH_HEIGHT * S, "PLAIN", S, PLAIN_LINE);

    // Bars.
    let mut gx = LEFT + (plot_w - groups_w) / 2 + GROUP_GAP / 2;
    for (g, gw) in groups.iter().zip(&group_w) {
        let bars_w = g.bars.len() as i64 * BAR_W + (g.bars.len() as i64 - 1).max(0) * BAR_GAP;
        let mut bx = gx + (gw - bars_w) / 2;
        for bar in &g.bars {
            let y = y_of(bar.speedup);
            cv.fill_rect(bx, y, BAR_W, y_of(0.0) - y, PALETTE[bar.mode % PALETTE.len()]);
            if bar.bound > 0.0 {
                cv.hline(bx - 4, bx + BAR_W + 3, y_of(bar.bound) - 1, 3, BLACK, 6);
            }
            let value = format!("{:.2}X", bar.speedup);
            let vy = y_of(bar.speedup.max(bar.bound)) - 10 - GLYPH_HEIGHT * S;
            let vx = bx + (BAR_W - text_width(&value, S)) / 2;
            cv.fill_rect(vx - 3, vy - 3, text_width(&value, S) + 6, GLYPH_HEIGHT * S + 6, WHITE);
            cv.text(vx, vy, &value, S, BLACK);
            // τ inside the bar's foot, where the bar is tall enough to hold it.
            let tau = format!("τ{:.2}", bar.tau);
            if y_of(0.0) - y >= (GLYPH_HEIGHT + 8) * S {
                let ty = y_of(0.0) - 6 - GLYPH_HEIGHT * S;
                cv.text(bx + (BAR_W - text_width(&tau, S)) / 2, ty, &tau, S, WHITE);
            }
            bx += BAR_W + BAR_GAP;
        }
        for (i, line) in g.label.iter().enumerate() {
            let ty = top + PLOT_H + 16 + i as i64 * line_h;
            cv.text(gx + (gw - text_width(line, S)) / 2, ty, line, S, BLACK);
        }
        gx += gw + GROUP_GAP;
    }
    if groups.is_empty() {
        cv.text(LEFT + 20, top + PLOT_H / 2, "NO SPECULATIVE RUNS", S, AXIS);
    }
    cv.encode_png()
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
            threads: "2".into(),
            datasets,
            temperatures: temps.to_vec(),
            modes: modes.iter().map(Mode::label).collect(),
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
            Mode { drafter: Some("ngram".into()), draft_len: Some(DraftLen::Fixed(4)) },
            Mode { drafter: Some("draft-model:qwen2.5-coder-0.5b".into()), draft_len: Some(DraftLen::Auto) },
        ]
    }

    #[test]
    fn table_has_one_row_per_dataset_temperature_and_mode() {
        let r = report(&["humaneval", "gsm8k-100"], &[0.0, 1.0], &modes(), 1);
        let md = render_markdown(&r);
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| data set")).collect();
        assert_eq!(rows.len(), 2 * 2 * 3);
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
    fn chart_is_a_png_of_the_size_its_layout_asks_for() {
        for (datasets, temps, models) in
            [(vec!["humaneval"], vec![0.0], 1), (vec!["humaneval", "gsm8k-100", "mt-bench"], vec![0.0, 1.0], 2)]
        {
            let r = report(&datasets, &temps, &modes(), models);
            let bytes = render_chart_png(&r).unwrap();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
            let decoder = png::Decoder::new(std::io::Cursor::new(&bytes));
            let mut reader = decoder.read_info().unwrap();
            let mut buf = vec![0; reader.output_buffer_size().unwrap()];
            let info = reader.next_frame(&mut buf).unwrap();
            assert_eq!(info.color_type, png::ColorType::Rgb);
            // Wide enough for every group, tall enough for the plot; bars of both modes drawn.
            let groups = datasets.len() * temps.len() * models;
            assert!(info.width as usize >= 90 + groups * (2 * 64 + 8), "width {}", info.width);
            assert!(info.height >= 380);
            let pixels = &buf[..info.buffer_size()];
            for color in [PALETTE[0], PALETTE[1]] {
                assert!(pixels.chunks(3).any(|p| p == color), "no bar in {color:?}");
            }
        }
    }

    #[test]
    fn chart_without_speculative_modes_still_renders() {
        let r = report(&["humaneval"], &[0.0], &[Mode::plain()], 1);
        let bytes = render_chart_png(&r).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    }

    #[test]
    fn font_glyphs_are_five_by_seven_and_case_insensitive() {
        for (c, rows) in FONT {
            assert!(rows.iter().all(|r| r.len() == 5 && r.bytes().all(|b| b == b'#' || b == b'.')), "{c}");
        }
        assert_eq!(glyph('a'), glyph('A'));
        assert_eq!(glyph('\u{2603}'), &UNKNOWN_GLYPH);
        assert_eq!(text_width("ab", 2), 22);
        // Every character a report label can contain has a glyph of its own.
        for c in "abcdefghijklmnopqrstuvwxyz0123456789 .,:-_/()=+%×".chars() {
            assert_ne!(glyph(c), &UNKNOWN_GLYPH, "{c}");
        }
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
        assert!(std::fs::read(&out.chart).unwrap().starts_with(b"\x89PNG"));
    }
}
