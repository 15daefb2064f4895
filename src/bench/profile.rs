//! Where the time of an m-row verify block goes (`bench --mode ar --profile`): the block a
//! speculative step verifies (m new tokens on top of a cached context, logits for every row,
//! then rolled back), run with the forward's profiler on ([`crate::model::profile`]), and
//! the matmuls' achieved int8 throughput next to the machine's `vpdpbusd` peak, measured in
//! the same run ([`super::int8_peak`]).

use super::int8_peak::{self, CpuInfo, Int8Peak};
use crate::model::profile::{Phase, Profile, PROFILER};
use crate::model::{ForwardBatch, LogitsRows, Transformer};
use crate::speculative::step_cost::timing_filler;
use anyhow::{bail, Result};
use serde::Serialize;

/// Block sizes profiled when none are given: those of 1, 4, 8 and 16 up to `max_m`, and
/// `max_m` itself below 16.
pub fn default_sizes(max_m: usize) -> Vec<usize> {
    let max_m = max_m.max(1);
    let mut sizes: Vec<usize> = [1, 4, 8, 16].into_iter().filter(|&m| m <= max_m).collect();
    if max_m < 16 && !sizes.contains(&max_m) {
        sizes.push(max_m);
    }
    sizes
}

#[derive(Debug, Clone)]
pub struct ProfileSettings {
    /// Block sizes (rows), each profiled on its own.
    pub sizes: Vec<usize>,
    /// Cached tokens under every block.
    pub depth: usize,
    /// Blocks of each size run with the profiler on (interleaved over the sizes).
    pub rounds: usize,
    /// Seconds the peak measurement runs per thread count.
    pub peak_secs: f64,
}

/// One phase of one block size.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseRow {
    pub phase: String,
    /// Mean milliseconds per block.
    pub ms: f64,
    /// Share of the block's time.
    pub percent: f64,
    /// Calls per block (none for `other`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calls: Option<f64>,
    /// int8 multiply-adds per block (quantised matmuls only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub int8_macs: Option<u64>,
    /// Achieved int8 operations per second, in billions (2 per multiply-add).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub int8_gops: Option<f64>,
}

/// The profile of one block size.
#[derive(Debug, Clone, Serialize)]
pub struct BlockProfile {
    pub m: usize,
    /// Blocks profiled.
    pub blocks: usize,
    /// Mean milliseconds per block: the forward plus logits to tokens.
    pub ms: f64,
    /// Every phase, then `other` (forward time outside the phases).
    pub phases: Vec<PhaseRow>,
    /// int8 multiply-adds of all quantised matmuls per block.
    pub int8_macs: u64,
    /// Their achieved int8 operations per second, in billions (`None` without any).
    pub int8_gops: Option<f64>,
    /// That as a percentage of the all-threads `vpdpbusd` peak.
    pub percent_of_peak: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProfileReport {
    pub depth: usize,
    pub cpu: CpuInfo,
    /// `None` on a CPU without VNNI.
    pub peak: Option<Int8Peak>,
    pub blocks: Vec<BlockProfile>,
}

/// Switches the process-wide profiler on until dropped (also on an error).
struct Enabled;

impl Enabled {
    fn new() -> Self {
        PROFILER.reset();
        PROFILER.set_enabled(true);
        Self
    }
}

impl Drop for Enabled {
    fn drop(&mut self) {
        PROFILER.set_enabled(false);
    }
}

/// Single-token steps before anything is profiled, as the step-cost measurement does: the
/// first ones after a prefill run slow.
const WARMUP_STEPS: usize = 40;

pub fn run(model: &Transformer, s: &ProfileSettings) -> Result<ProfileReport> {
    if s.sizes.is_empty() || s.sizes.contains(&0) {
        bail!("profile block sizes must be at least 1 row, got {:?}", s.sizes);
    }
    let max_m = s.sizes.iter().copied().max().unwrap_or(1);
    let vocab = model.config.vocab;
    let pool = model.new_kv_pool(s.depth + max_m + 16);
    let mut cache = pool.new_sequence();
    if s.depth > 0 {
        let context = timing_filler(vocab, s.depth, 0);
        let mut batch = ForwardBatch::new();
        batch.push(&context, &mut cache, LogitsRows::None);
        model.forward(&mut batch)?;
    }
    let block = timing_filler(vocab, max_m, 1);
    let mut run = |m: usize| -> Result<()> {
        let mut batch = ForwardBatch::new();
        batch.push(&block[..m], &mut cache, LogitsRows::All);
        let out = model.forward(&mut batch)?;
        {
            let _t = crate::model::profile::timer(Phase::Logits);
            for row in out.seq_logits(0)? {
                std::hint::black_box(crate::sample::argmax(&row));
            }
        }
        drop(batch);
        cache.truncate(s.depth);
        Ok(())
    };
    for _ in 0..WARMUP_STEPS {
        run(1)?;
    }
    for &m in &s.sizes {
        run(m)?;
    }
    let mut totals = vec![Profile::default(); s.sizes.len()];
    let rounds = s.rounds.max(1);
    for _ in 0..rounds {
        for (total, &m) in totals.iter_mut().zip(&s.sizes) {
            let on = Enabled::new();
            run(m)?;
            drop(on);
            total.merge(&PROFILER.snapshot());
        }
    }
    PROFILER.reset();

    let peak = int8_peak::measure(s.peak_secs);
    let blocks = s.sizes.iter().zip(&totals).map(|(&m, p)| block_profile(m, rounds, p, peak.as_ref())).collect();
    Ok(ProfileReport { depth: s.depth, cpu: CpuInfo::read(), peak, blocks })
}

fn gops(macs: u64, nanos: u64) -> Option<f64> {
    (macs > 0 && nanos > 0).then(|| 2.0 * macs as f64 / nanos as f64)
}

fn block_profile(m: usize, blocks: usize, p: &Profile, peak: Option<&Int8Peak>) -> BlockProfile {
    let n = blocks as f64;
    let total = p.total_nanos().max(1) as f64;
    let ms = |nanos: u64| nanos as f64 / n / 1e6;
    let mut phases: Vec<PhaseRow> = Phase::ALL
        .iter()
        .map(|&phase| {
            let t = p.get(phase);
            PhaseRow {
                phase: phase.name().to_string(),
                ms: ms(t.nanos),
                percent: 100.0 * t.nanos as f64 / total,
                calls: Some(t.calls as f64 / n),
                int8_macs: (t.int8_macs > 0).then(|| t.int8_macs / blocks as u64),
                int8_gops: gops(t.int8_macs, t.nanos),
            }
        })
        .collect();
    phases.push(PhaseRow {
        phase: "other".to_string(),
        ms: ms(p.other_nanos()),
        percent: 100.0 * p.other_nanos() as f64 / total,
        calls: None,
        int8_macs: None,
        int8_gops: None,
    });
    let (mm_nanos, macs) = p.int8_matmuls();
    let int8_gops = gops(macs, mm_nanos);
    BlockProfile {
        m,
        blocks,
        ms: ms(p.total_nanos()),
        phases,
        int8_macs: macs / blocks as u64,
        int8_gops,
        percent_of_peak: int8_gops.zip(peak).map(|(g, pk)| 100.0 * g / pk.all_threads_gops),
    }
}

/// The profile as markdown: the CPU, one table (ms per block and % of the block for every
/// size), and a line per size on the matmuls' int8 throughput against the peak.
pub fn render(r: &ProfileReport) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(out, "{}", r.cpu.describe());
    let _ = writeln!(out);
    let sizes: Vec<String> = r.blocks.iter().map(|b| format!("m={} ms | %", b.m)).collect();
    let _ = writeln!(out, "| phase | {} |", sizes.join(" | "));
    let _ = writeln!(out, "|---|{}", "---|---|".repeat(r.blocks.len()));
    let n_phases = r.blocks.first().map_or(0, |b| b.phases.len());
    for i in 0..n_phases {
        let cells: Vec<String> =
            r.blocks.iter().map(|b| format!("{:.3} | {:.1}", b.phases[i].ms, b.phases[i].percent)).collect();
        let _ = writeln!(out, "| {} | {} |", r.blocks[0].phases[i].phase, cells.join(" | "));
    }
    let cells: Vec<String> = r.blocks.iter().map(|b| format!("**{:.3}** | 100", b.ms)).collect();
    let _ = writeln!(out, "| **block** | {} |", cells.join(" | "));
    let _ = writeln!(out);
    let blocks = r.blocks.first().map_or(0, |b| b.blocks);
    let _ = writeln!(
        out,
        "Mean of {blocks} blocks per size on {} cached tokens, logits for every row; after {WARMUP_STEPS} single-token steps.",
        r.depth
    );
    for b in &r.blocks {
        let line = match (b.int8_gops, &r.peak) {
            (None, _) => "no int8 multiply-adds (the matmul weights are not quantised)".to_string(),
            (Some(g), Some(pk)) => format!(
                "{g:.1} G int8 ops/s ({:.1}% of the {} peak {:.1} G measured now on {} threads; {:.1} G on 1)",
                b.percent_of_peak.unwrap_or(0.0),
                pk.instruction,
                pk.all_threads_gops,
                pk.threads,
                pk.one_thread_gops
            ),
            (Some(g), None) => {
                format!("{g:.1} G int8 ops/s (no int8 dot-product instruction on this CPU to compare with)")
            }
        };
        let _ = writeln!(out, "- m={}: matmuls: {line}", b.m);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_sizes_stop_at_max_m() {
        assert_eq!(default_sizes(16), vec![1, 4, 8, 16]);
        assert_eq!(default_sizes(64), vec![1, 4, 8, 16]);
        assert_eq!(default_sizes(8), vec![1, 4, 8]);
        assert_eq!(default_sizes(6), vec![1, 4, 6]);
        assert_eq!(default_sizes(1), vec![1]);
        assert_eq!(default_sizes(0), vec![1]);
    }

    #[test]
    fn block_profile_shares_add_up() {
        let mut p = Profile::default();
        p.phases[Phase::Qkv as usize] =
            crate::model::profile::PhaseTotals { nanos: 2_000_000, calls: 60, int8_macs: 1_000_000 };
        p.phases[Phase::Norm as usize] =
            crate::model::profile::PhaseTotals { nanos: 1_000_000, calls: 122, int8_macs: 0 };
        p.phases[Phase::Logits as usize] =
            crate::model::profile::PhaseTotals { nanos: 1_000_000, calls: 2, int8_macs: 0 };
        p.forward_nanos = 4_000_000;
        p.forwards = 2;
        let b = block_profile(4, 2, &p, None);
        assert!((b.ms - 2.5).abs() < 1e-9, "{}", b.ms);
        let percent: f64 = b.phases.iter().map(|r| r.percent).sum();
        assert!((percent - 100.0).abs() < 1e-9, "{percent}");
        assert_eq!(b.phases.last().map(|r| r.phase.as_str()), Some("other"));
        assert_eq!(b.int8_macs, 500_000);
        assert!((b.int8_gops.unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(b.percent_of_peak, None);
        let text = render(&ProfileReport {
            depth: 8,
            cpu: CpuInfo { model: None, avx512_vnni: None, amx_int8: None },
            peak: None,
            blocks: vec![b],
        });
        assert!(text.contains("| matmul qkv | 1.000 | 40.0 |"), "{text}");
        assert!(text.contains("m=4: matmuls: 1.0 G int8 ops/s"), "{text}");
    }
}
