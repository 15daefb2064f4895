//! Where and when a benchmark ran, recorded at the top of every report it writes.

use crate::cpu_identity::{matmul_threads, CpuIdentity};
use serde::Serialize;

/// The `run` object of a report.
#[derive(Debug, Clone, Serialize)]
pub struct RunInfo {
    /// UTC, RFC 3339 (`2026-12-06T14:05:09Z`).
    pub date: String,
    /// The commit the binary was built from (None outside a git checkout).
    pub commit: Option<String>,
    /// `model name` of /proc/cpuinfo.
    pub cpu_model: Option<String>,
    /// Which of the extensions the kernels use the CPU lists (empty where unknown).
    pub cpu_flags: Vec<String>,
    /// Threads of the matmul pool.
    pub threads: usize,
}

impl RunInfo {
    /// This process, now.
    pub fn now() -> Self {
        let seconds = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let commit = option_env!("SPECULA_BUILD_COMMIT").filter(|c| !c.is_empty()).map(str::to_string);
        let cpu = CpuIdentity::current();
        Self {
            date: rfc3339_utc(seconds),
            commit,
            cpu_model: cpu.model,
            cpu_flags: cpu.kernel_flags,
            threads: matmul_threads(),
        }
    }
}

/// Seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ` (the proleptic Gregorian calendar).
fn rfc3339_utc(seconds: u64) -> String {
    let (days, rem) = (seconds / 86_400, seconds % 86_400);
    // Days to a civil date: eras of 400 years (146,097 days), years starting in March.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 { month_index + 3 } else { month_index - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_utc_rfc3339() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(1_796_565_909), "2026-12-06T14:05:09Z");
        assert_eq!(rfc3339_utc(4_107_542_399), "2100-02-28T23:59:59Z");
    }
}
