//! What a training run reports: per-step tallies, log lines (`train-log.jsonl`), the final
//! report, and the observer the CLI draws its progress with. Shared by both trainers.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Aggregated metrics of some sequences.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Metrics {
    pub loss: f64,
    /// Per draft position k = 1.. : fraction of scored rows whose argmax is the label. Rows
    /// whose label the drafter cannot produce (outside its vocabulary) count as misses.
    pub accuracy: Vec<Option<f64>>,
    /// Anchor estimate: 1 + mean leading hits over the anchors scored. Anchors are drawn
    /// evenly, so easy stretches weigh as much as hard ones: optimistic beside serving.
    pub tau: f64,
    pub blocks: usize,
    pub scored_rows: usize,
    /// Serving estimate (validation only): greedy verify steps simulated over the held-out
    /// answers, `committed tokens / verify steps` as serving counts it
    /// ([`crate::train::validation::simulate_verify_steps`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving_tau: Option<f64>,
    /// 95% interval of `serving_tau` from a bootstrap over the answers
    /// ([`crate::stats::ratio_of_sums_95`]): how far another sample of answers of the same kind
    /// could move it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving_tau_interval: Option<(f64, f64)>,
    /// Drafted positions per verify step in that simulation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving_draft_len: Option<usize>,
}

/// Sums of one objective's per-sequence terms, turned into [`Metrics`].
#[derive(Debug, Default)]
pub struct Tally {
    loss_sum: f64,
    loss_weight: f64,
    scored: Vec<usize>,
    hits: Vec<usize>,
    accepted: usize,
    drafts: usize,
    /// (committed tokens, verify steps) of each answer's simulated serving walk.
    walks: Vec<(usize, usize)>,
}

impl Tally {
    /// One sequence: its loss sum and weight (the reported loss is their ratio over all
    /// sequences), scored rows and hits per draft position, and leading hits per draft.
    pub fn add(&mut self, loss_sum: f64, loss_weight: f64, scored: &[usize], hits: &[usize], accepted: &[usize]) {
        if self.scored.len() < scored.len() {
            self.scored.resize(scored.len(), 0);
            self.hits.resize(scored.len(), 0);
        }
        self.loss_sum += loss_sum;
        self.loss_weight += loss_weight;
        for k in 0..scored.len() {
            self.scored[k] += scored[k];
            self.hits[k] += hits[k];
        }
        self.accepted += accepted.iter().sum::<usize>();
        self.drafts += accepted.len();
    }

    /// One answer's simulated serving walk: tokens committed over how many verify steps (an
    /// answer without a response position takes none and is not counted).
    pub fn add_serving_walk(&mut self, committed: usize, steps: usize) {
        if steps > 0 {
            self.walks.push((committed, steps));
        }
    }

    pub fn metrics(&self) -> Metrics {
        let (committed, steps) = self.walks.iter().fold((0, 0), |(c, n), w| (c + w.0, n + w.1));
        let walks: Vec<(f64, f64)> = self.walks.iter().map(|&(c, n)| (c as f64, n as f64)).collect();
        Metrics {
            loss: if self.loss_weight > 0.0 { self.loss_sum / self.loss_weight } else { 0.0 },
            accuracy: self.scored.iter().zip(&self.hits).map(|(&s, &h)| (s > 0).then(|| h as f64 / s as f64)).collect(),
            tau: 1.0 + self.accepted as f64 / self.drafts.max(1) as f64,
            blocks: self.drafts,
            scored_rows: self.scored.iter().sum(),
            serving_tau: (steps > 0).then(|| committed as f64 / steps as f64),
            serving_tau_interval: if steps > 0 { crate::stats::ratio_of_sums_95(&walks) } else { None },
            serving_draft_len: None,
        }
    }
}

/// One line of `train-log.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogLine {
    pub step: usize,
    pub lr: f64,
    pub grad_norm: f64,
    pub train: Metrics,
    pub val: Option<Metrics>,
    /// Scored rows per second over the steps since the previous line.
    pub rows_per_sec: f64,
    pub tokens_per_sec: f64,
    pub peak_rss_mb: Option<f64>,
}

/// Appends a line to `OUT/train-log.jsonl`.
pub fn append_log(out: &Path, line: &LogLine) -> anyhow::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(out.join("train-log.jsonl"))?;
    writeln!(f, "{}", serde_json::to_string(line)?)?;
    Ok(())
}

/// What a finished (or stopped) run reports.
#[derive(Debug, Clone)]
pub struct TrainReport {
    pub steps: usize,
    pub total_steps: usize,
    pub train_examples: usize,
    pub val_examples: usize,
    pub last: Option<LogLine>,
    pub final_val: Option<Metrics>,
    pub drafter_dir: PathBuf,
    /// Seconds of this process's steps, and of every run of this output directory.
    pub secs: f64,
    pub total_secs: f64,
    pub rows_per_sec: f64,
    pub peak_rss_mb: Option<f64>,
}

/// Peak resident memory of this process (Linux), in MB.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// One optimiser step as the progress display sees it.
#[derive(Debug, Clone, Copy)]
pub struct StepProgress {
    pub step: usize,
    pub total: usize,
    /// Training loss over the steps since the last log line.
    pub loss: f64,
    /// Scored rows per second of this step.
    pub rows_per_sec: f64,
    /// The latest validation estimate of τ (serving-shaped when known).
    pub tau: Option<f64>,
}

/// How a trainer reports progress.
pub trait TrainObserver {
    /// Work before the first step (features, validation) as `done` of `total` `what`.
    fn prepare(&mut self, _what: &str, _done: usize, _total: usize) {}
    fn step(&mut self, _progress: StepProgress) {}
    fn log(&mut self, _line: &LogLine) {}
}

impl TrainObserver for () {}
