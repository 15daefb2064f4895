//! Which CPU this process runs on, as far as kernel speed goes: its model name, the
//! instruction-set extensions the kernels choose between, and the matmul pool's size. Read by
//! benchmark reports and by the step-cost cache, which must not reuse a curve measured
//! elsewhere.

/// The instruction-set extensions the kernels choose between, as /proc/cpuinfo names them.
const KERNEL_FLAGS: &[&str] =
    &["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8"];

/// The CPU's model name and kernel-relevant flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuIdentity {
    /// `model name` of /proc/cpuinfo (None where unknown).
    pub model: Option<String>,
    /// Which of the extensions the kernels use the CPU lists (empty where unknown).
    pub kernel_flags: Vec<String>,
}

impl CpuIdentity {
    /// This machine's (read from /proc/cpuinfo once per process).
    pub fn current() -> Self {
        static CURRENT: std::sync::OnceLock<CpuIdentity> = std::sync::OnceLock::new();
        CURRENT
            .get_or_init(|| Self::from_cpuinfo(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default()))
            .clone()
    }

    /// The first processor's model name and kernel-relevant flags.
    pub fn from_cpuinfo(text: &str) -> Self {
        let field = |name: &str| cpuinfo_field(text, name);
        let flags = field("flags").unwrap_or_default();
        let listed: Vec<&str> = flags.split_whitespace().collect();
        let kernel_flags = KERNEL_FLAGS.iter().filter(|f| listed.contains(f)).map(|f| f.to_string()).collect();
        Self { model: field("model name").filter(|m| !m.is_empty()), kernel_flags }
    }
}

/// The first value of `name` (`model name`, `flags`, …) in the text of /proc/cpuinfo.
pub fn cpuinfo_field(text: &str, name: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (key, value) = l.split_once(':')?;
        (key.trim() == name).then(|| value.trim().to_string())
    })
}

/// The matmul pool's size: `CANDLE_NUM_THREADS` (which `--threads`, or else the binary's
/// start-up, sets), else rayon's, as candle itself falls back.
pub fn matmul_threads() -> usize {
    std::env::var("CANDLE_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(candle_core::utils::get_num_threads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpuinfo_gives_the_model_and_the_kernel_flags() {
        let text =
            "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 fma avx512f avx512_vnni amx_int8 amx_tile\n\
                    processor\t: 1\nmodel name\t: Other\n";
        let cpu = CpuIdentity::from_cpuinfo(text);
        assert_eq!(cpu.model.as_deref(), Some("Some CPU"));
        assert_eq!(cpu.kernel_flags, ["avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"]);
        assert_eq!(CpuIdentity::from_cpuinfo(""), CpuIdentity { model: None, kernel_flags: Vec::new() });
    }
}
