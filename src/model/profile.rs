//! Where the time of a forward goes: wall time per phase (each matmul kind, attention, norms,
//! RoPE, …) and, for quantised matmuls, their int8 multiply-adds, accumulated process-wide
//! while switched on (`bench --mode ar --profile`).
//!
//! Off by default. Off, a timer costs one relaxed atomic load and reads no clock, so the
//! instrumented forward runs as before. On, every forward in the process adds to the same
//! totals: switch it on only around the forwards being profiled.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// A part of the forward. The first [`Phase::MATMULS`] are the matmul kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The fused q/k/v projection.
    Qkv,
    /// The attention output projection.
    AttnOut,
    /// The fused gate/up projection.
    GateUp,
    /// The MLP down projection.
    Down,
    LmHead,
    /// `paged_attention` and the writes of the new K/V into the cache.
    Attention,
    /// RMSNorm calls (per layer, post-norms, the final norm).
    Norm,
    /// RoPE tables and rotation, and the per-head q/k norms where the model has them.
    Rope,
    /// The token embedding lookup.
    Embedding,
    /// The gated activation and the residual adds.
    Elementwise,
    /// Logits to tokens (argmax over each row), timed by the caller of the forward.
    Logits,
}

impl Phase {
    pub const COUNT: usize = 11;
    /// The matmul kinds: [`Phase::ALL`]`[..MATMULS]`.
    pub const MATMULS: usize = 5;
    pub const ALL: [Phase; Self::COUNT] = [
        Phase::Qkv,
        Phase::AttnOut,
        Phase::GateUp,
        Phase::Down,
        Phase::LmHead,
        Phase::Attention,
        Phase::Norm,
        Phase::Rope,
        Phase::Embedding,
        Phase::Elementwise,
        Phase::Logits,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Qkv => "matmul qkv",
            Phase::AttnOut => "matmul o",
            Phase::GateUp => "matmul gate_up",
            Phase::Down => "matmul down",
            Phase::LmHead => "matmul lm_head",
            Phase::Attention => "attention",
            Phase::Norm => "norms",
            Phase::Rope => "rope",
            Phase::Embedding => "embedding",
            Phase::Elementwise => "elementwise",
            Phase::Logits => "logits to tokens",
        }
    }

    pub fn is_matmul(self) -> bool {
        (self as usize) < Self::MATMULS
    }

    /// Whether the phase runs inside the forward (all but [`Phase::Logits`]).
    pub fn in_forward(self) -> bool {
        self != Phase::Logits
    }
}

/// One phase's totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseTotals {
    pub nanos: u64,
    pub calls: u64,
    /// int8 multiply-adds (rows × out_features × in_features) of quantised matmuls; 0 for
    /// other phases and for matmuls on dense weights.
    pub int8_macs: u64,
}

/// The totals accumulated since the last reset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Profile {
    pub phases: [PhaseTotals; Phase::COUNT],
    /// Wall time of whole forwards, of which the in-forward phases are parts.
    pub forward_nanos: u64,
    pub forwards: u64,
}

impl Profile {
    pub fn get(&self, phase: Phase) -> &PhaseTotals {
        &self.phases[phase as usize]
    }

    /// Forward time not in any in-forward phase: batch validation, KV reservation, tensor
    /// copies between the phases.
    pub fn other_nanos(&self) -> u64 {
        let parts: u64 = Phase::ALL.iter().filter(|p| p.in_forward()).map(|&p| self.get(p).nanos).sum();
        self.forward_nanos.saturating_sub(parts)
    }

    /// Forward time plus the phases timed outside it ([`Phase::Logits`]).
    pub fn total_nanos(&self) -> u64 {
        self.forward_nanos + Phase::ALL.iter().filter(|p| !p.in_forward()).map(|&p| self.get(p).nanos).sum::<u64>()
    }

    /// Time and int8 multiply-adds of the matmuls that have any (the quantised ones).
    pub fn int8_matmuls(&self) -> (u64, u64) {
        Phase::ALL[..Phase::MATMULS]
            .iter()
            .map(|&p| self.get(p))
            .filter(|t| t.int8_macs > 0)
            .fold((0, 0), |(n, m), t| (n + t.nanos, m + t.int8_macs))
    }

    /// Adds another profile's totals to these.
    pub fn merge(&mut self, other: &Profile) {
        for (a, b) in self.phases.iter_mut().zip(&other.phases) {
            a.nanos += b.nanos;
            a.calls += b.calls;
            a.int8_macs += b.int8_macs;
        }
        self.forward_nanos += other.forward_nanos;
        self.forwards += other.forwards;
    }
}

/// Accumulators for a [`Profile`]. The process has one, [`PROFILER`]; the free functions of
/// this module use it.
pub struct Profiler {
    enabled: AtomicBool,
    nanos: [AtomicU64; Phase::COUNT],
    calls: [AtomicU64; Phase::COUNT],
    macs: [AtomicU64; Phase::COUNT],
    forward_nanos: AtomicU64,
    forwards: AtomicU64,
}

/// The process-wide profiler the forward reports to.
pub static PROFILER: Profiler = Profiler::new();

impl Default for Profiler {
    fn default() -> Self {
        Self::new()
    }
}

impl Profiler {
    pub const fn new() -> Self {
        Self {
            enabled: AtomicBool::new(false),
            nanos: [const { AtomicU64::new(0) }; Phase::COUNT],
            calls: [const { AtomicU64::new(0) }; Phase::COUNT],
            macs: [const { AtomicU64::new(0) }; Phase::COUNT],
            forward_nanos: AtomicU64::new(0),
            forwards: AtomicU64::new(0),
        }
    }

    #[inline]
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// Adds one call of `phase` (whether or not the profiler is on).
    pub fn record(&self, phase: Phase, nanos: u64, int8_macs: u64) {
        let i = phase as usize;
        self.nanos[i].fetch_add(nanos, Ordering::Relaxed);
        self.calls[i].fetch_add(1, Ordering::Relaxed);
        self.macs[i].fetch_add(int8_macs, Ordering::Relaxed);
    }

    /// Adds one whole forward.
    pub fn record_forward(&self, nanos: u64) {
        self.forward_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.forwards.fetch_add(1, Ordering::Relaxed);
    }

    /// Zeroes every total (the on/off switch stays as it is).
    pub fn reset(&self) {
        for a in self.nanos.iter().chain(&self.calls).chain(&self.macs) {
            a.store(0, Ordering::Relaxed);
        }
        self.forward_nanos.store(0, Ordering::Relaxed);
        self.forwards.store(0, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Profile {
        let mut p = Profile::default();
        for (i, t) in p.phases.iter_mut().enumerate() {
            t.nanos = self.nanos[i].load(Ordering::Relaxed);
            t.calls = self.calls[i].load(Ordering::Relaxed);
            t.int8_macs = self.macs[i].load(Ordering::Relaxed);
        }
        p.forward_nanos = self.forward_nanos.load(Ordering::Relaxed);
        p.forwards = self.forwards.load(Ordering::Relaxed);
        p
    }

    /// Times `phase` until the returned guard drops; nothing when off.
    #[inline]
    pub fn timer(&self, phase: Phase) -> Timer<'_> {
        self.start(Some(phase), 0)
    }

    /// Times a matmul of `rows` × `out_features` × `in_features` multiply-adds, counted as int8
    /// ones when `int8`.
    #[inline]
    pub fn matmul(&self, phase: Phase, int8: bool, rows: usize, out_features: usize, in_features: usize) -> Timer<'_> {
        if !self.enabled() {
            return Timer(None);
        }
        let macs = if int8 { (rows * out_features * in_features) as u64 } else { 0 };
        self.start(Some(phase), macs)
    }

    /// Times a whole forward until the guard drops.
    #[inline]
    pub fn forward_timer(&self) -> Timer<'_> {
        self.start(None, 0)
    }

    #[inline]
    fn start(&self, phase: Option<Phase>, int8_macs: u64) -> Timer<'_> {
        if !self.enabled() {
            return Timer(None);
        }
        Timer(Some(Running { profiler: self, phase, int8_macs, start: Instant::now() }))
    }
}

struct Running<'a> {
    profiler: &'a Profiler,
    /// `None`: a whole forward.
    phase: Option<Phase>,
    int8_macs: u64,
    start: Instant,
}

/// Adds the time since it was made to its phase when dropped (see [`Profiler::timer`]).
#[must_use = "the phase is timed until the timer drops"]
pub struct Timer<'a>(Option<Running<'a>>);

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        if let Some(r) = self.0.take() {
            let nanos = r.start.elapsed().as_nanos() as u64;
            match r.phase {
                Some(p) => r.profiler.record(p, nanos, r.int8_macs),
                None => r.profiler.record_forward(nanos),
            }
        }
    }
}

/// [`Profiler::timer`] of the process-wide profiler.
#[inline]
pub fn timer(phase: Phase) -> Timer<'static> {
    PROFILER.timer(phase)
}

/// [`Profiler::matmul`] of the process-wide profiler.
#[inline]
pub fn matmul(phase: Phase, int8: bool, rows: usize, out_features: usize, in_features: usize) -> Timer<'static> {
    PROFILER.matmul(phase, int8, rows, out_features, in_features)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_listed_in_index_order() {
        for (i, p) in Phase::ALL.iter().enumerate() {
            assert_eq!(*p as usize, i);
            assert_eq!(p.is_matmul(), i < Phase::MATMULS, "{p:?}");
        }
    }

    /// A profiler of its own, so forwards of other tests (which report to [`PROFILER`])
    /// cannot add to it.
    #[test]
    fn accumulates_only_when_on_and_resets() {
        let p = Profiler::new();
        drop(p.timer(Phase::Norm));
        drop(p.matmul(Phase::Qkv, true, 2, 3, 4));
        drop(p.forward_timer());
        assert_eq!(p.snapshot(), Profile::default(), "off: nothing recorded");

        p.set_enabled(true);
        for _ in 0..3 {
            drop(p.matmul(Phase::Qkv, true, 2, 3, 4));
        }
        drop(p.matmul(Phase::Down, false, 2, 3, 4));
        drop(p.timer(Phase::Norm));
        p.record(Phase::Attention, 500, 0);
        p.record(Phase::Logits, 70, 0);
        p.record_forward(1_000);
        let s = p.snapshot();
        assert_eq!(s.get(Phase::Qkv).calls, 3);
        assert_eq!(s.get(Phase::Qkv).int8_macs, 3 * 24);
        assert_eq!(s.get(Phase::Down).calls, 1);
        assert_eq!(s.get(Phase::Down).int8_macs, 0, "dense matmuls count no int8 multiply-adds");
        assert_eq!(s.get(Phase::Norm).calls, 1);
        assert_eq!(s.get(Phase::Norm).int8_macs, 0);
        assert_eq!(s.get(Phase::Attention).nanos, 500);
        assert_eq!(s.get(Phase::Rope).calls, 0);
        assert_eq!(s.forwards, 1);
        assert_eq!(s.forward_nanos, 1_000);
        let in_forward: u64 = Phase::ALL.iter().filter(|q| q.in_forward()).map(|&q| s.get(q).nanos).sum();
        assert_eq!(s.other_nanos(), 1_000u64.saturating_sub(in_forward));
        assert_eq!(s.total_nanos(), 1_070);
        let (mm_nanos, macs) = s.int8_matmuls();
        assert_eq!(macs, 72);
        assert_eq!(mm_nanos, s.get(Phase::Qkv).nanos);

        let mut twice = s.clone();
        twice.merge(&s);
        assert_eq!(twice.get(Phase::Qkv).calls, 6);
        assert_eq!(twice.get(Phase::Qkv).int8_macs, 144);
        assert_eq!(twice.forward_nanos, 2_000);

        p.reset();
        assert_eq!(p.snapshot(), Profile::default(), "reset zeroes every total");
        assert!(p.enabled(), "reset leaves the switch alone");
        p.set_enabled(false);
        drop(p.timer(Phase::Norm));
        assert_eq!(p.snapshot(), Profile::default());
    }
}
