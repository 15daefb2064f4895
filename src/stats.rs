//! Intervals from a bootstrap over items (prompts, examples), shared by the benchmarks and the
//! trainer's τ estimate, so that an estimate and a measurement are read with the same ruler.

use crate::sample::SamplerRng;

/// Resamples per interval.
pub const BOOTSTRAP_RESAMPLES: usize = 2000;

/// 95% interval of `statistic` over `n` items: the items are drawn `n` times with replacement
/// (`statistic` gets the drawn indices), [`BOOTSTRAP_RESAMPLES`] times, and the 2.5% and 97.5%
/// quantiles of the results are returned. Deterministic (fixed seed). None with fewer than two
/// items: one item says nothing about the spread.
pub fn bootstrap_95(n: usize, mut statistic: impl FnMut(&[usize]) -> f64) -> Option<(f64, f64)> {
    if n < 2 {
        return None;
    }
    let mut rng = SamplerRng::from_seed(0x5eed);
    let mut drawn = vec![0usize; n];
    let mut samples: Vec<f64> = (0..BOOTSTRAP_RESAMPLES)
        .map(|_| {
            for d in drawn.iter_mut() {
                *d = ((rng.next_f64() * n as f64) as usize).min(n - 1);
            }
            statistic(&drawn)
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((q * (BOOTSTRAP_RESAMPLES - 1) as f64).round() as usize).min(BOOTSTRAP_RESAMPLES - 1)];
    Some((at(0.025), at(0.975)))
}

/// 95% interval of Σ numerator / Σ denominator over items `(numerator, denominator)`, e.g. τ as
/// committed tokens over verify steps, the items being prompts or answers.
pub fn ratio_of_sums_95(items: &[(f64, f64)]) -> Option<(f64, f64)> {
    bootstrap_95(items.len(), |drawn| {
        let (num, den) = drawn.iter().fold((0.0, 0.0), |(n, d), &i| (n + items[i].0, d + items[i].1));
        if den > 0.0 {
            num / den
        } else {
            0.0
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_items_give_the_point_and_spread_items_an_interval_around_it() {
        let same = vec![(3.0, 2.0); 10];
        assert_eq!(ratio_of_sums_95(&same), Some((1.5, 1.5)));
        // Half the answers at τ 1, half at τ 3, equal steps: the interval holds 2 and is wide.
        let spread: Vec<(f64, f64)> = (0..40).map(|i| (if i % 2 == 0 { 10.0 } else { 30.0 }, 10.0)).collect();
        let (lo, hi) = ratio_of_sums_95(&spread).unwrap();
        assert!(lo < 2.0 && hi > 2.0 && hi - lo > 0.3 && hi - lo < 1.2, "{lo} {hi}");
        assert_eq!(ratio_of_sums_95(&same[..1]), None);
    }

    #[test]
    fn the_resamples_are_the_same_every_call() {
        let items: Vec<(f64, f64)> = (1..=12).map(|i| (i as f64 * 1.7, 1.0 + (i % 5) as f64)).collect();
        assert_eq!(ratio_of_sums_95(&items), ratio_of_sums_95(&items));
    }
}
