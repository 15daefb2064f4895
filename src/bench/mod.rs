//! Benchmarks: the cost of the target's forward (`ar`) and speculative
//! decoding over prompt suites. Speed is only ever reported from here, never asserted in tests.

pub mod ar;
pub mod int8_peak;
pub mod profile;
pub mod report;
pub mod run_info;
pub mod spec;

pub use run_info::RunInfo;

/// Median of a non-empty sample (0 for an empty one).
pub fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}
