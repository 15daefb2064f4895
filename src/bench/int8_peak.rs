//! The machine's int8 multiply-add peak, measured now: `vpdpbusd` on 10 independent
//! accumulators (`vpmaddubsw` on CPUs with AVX2 but no VNNI), on one thread and on every
//! thread of candle's worker pool, the one the matmuls run on. It is what the profile of
//! `bench --mode ar --profile` compares the matmuls' achieved int8 throughput with. Also the
//! CPU's model name and int8 extensions, from /proc/cpuinfo where there is one.

use serde::Serialize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// int8 operations per second of one instruction stream, counting a multiply and an add per
/// byte pair.
#[derive(Debug, Clone, Serialize)]
pub struct Int8Peak {
    /// The instruction timed: `vpdpbusd zmm` (AVX-512 VNNI), `vpdpbusd ymm` (AVX-VNNI) or
    /// `vpmaddubsw ymm` (AVX2).
    pub instruction: &'static str,
    /// int8 operations per instruction: lanes × byte pairs per lane × 2.
    pub ops_per_instruction: u64,
    pub one_thread_gops: f64,
    /// Threads of candle's pool, all running the loop at once.
    pub threads: usize,
    pub all_threads_gops: f64,
}

/// Measures the peak for about `secs` seconds per thread count; `None` on a CPU without
/// AVX-512 VNNI, AVX-VNNI or AVX2.
pub fn measure(secs: f64) -> Option<Int8Peak> {
    let kernel = Kernel::detect()?;
    // Calibrate the iteration count (this also brings the core up to its AVX-512 clock).
    let mut iters = 1u64 << 16;
    let t = Instant::now();
    std::hint::black_box(kernel.run(iters));
    let probe = t.elapsed().as_secs_f64().max(1e-6);
    iters = ((iters as f64 * secs / probe) as u64).max(1 << 16);
    let ops_per_run = (iters * ACCUMULATORS * kernel.ops_per_instruction()) as f64;

    let t = Instant::now();
    std::hint::black_box(kernel.run(iters));
    let one_thread_gops = ops_per_run / t.elapsed().as_secs_f64() / 1e9;

    let threads = AtomicUsize::new(0);
    let t = Instant::now();
    candle_core::utils::barrier_pool().execute(|_| {
        threads.fetch_add(1, Ordering::Relaxed);
        std::hint::black_box(kernel.run(iters));
    });
    let elapsed = t.elapsed().as_secs_f64();
    let threads = threads.into_inner();
    Some(Int8Peak {
        instruction: kernel.name(),
        ops_per_instruction: kernel.ops_per_instruction(),
        one_thread_gops,
        threads,
        all_threads_gops: ops_per_run * threads as f64 / elapsed / 1e9,
    })
}

/// Independent accumulators in the loop: enough to cover the instruction's latency on every
/// port that executes it.
const ACCUMULATORS: u64 = 10;

#[derive(Clone, Copy)]
enum Kernel {
    Zmm,
    Ymm,
    /// AVX2 without VNNI: `vpmaddubsw`, what the AVX2 kernels multiply with (byte pairs
    /// summed into i16; the kernels then add those up, which this loop leaves out).
    Maddubs,
}

impl Kernel {
    fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni") {
                return Some(Kernel::Zmm);
            }
            if is_x86_feature_detected!("avx") && is_x86_feature_detected!("avxvnni") {
                return Some(Kernel::Ymm);
            }
            if is_x86_feature_detected!("avx2") {
                return Some(Kernel::Maddubs);
            }
        }
        None
    }

    fn name(self) -> &'static str {
        match self {
            Kernel::Zmm => "vpdpbusd zmm",
            Kernel::Ymm => "vpdpbusd ymm",
            Kernel::Maddubs => "vpmaddubsw ymm",
        }
    }

    fn ops_per_instruction(self) -> u64 {
        match self {
            Kernel::Zmm => 16 * 4 * 2,
            Kernel::Ymm => 8 * 4 * 2,
            Kernel::Maddubs => 16 * 2 * 2,
        }
    }

    /// `iters` × [`ACCUMULATORS`] instructions; returns a sum of the accumulators so that
    /// nothing is optimised away.
    fn run(self, iters: u64) -> i32 {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: `detect` found the features each loop is compiled for.
            unsafe {
                match self {
                    Kernel::Zmm => x86::dpbusd_zmm(iters),
                    Kernel::Ymm => x86::dpbusd_ymm(iters),
                    Kernel::Maddubs => x86::maddubs_ymm(iters),
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = iters;
            unreachable!("no int8 kernel is detected off x86-64")
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Ten accumulators, each updated once per iteration from the same two operands. Each
    /// starts from its own opaque value: started equal, the compiler would see ten identical
    /// chains and keep one.
    macro_rules! ten_chains {
        ($iters:expr, $init:ident, $op:ident, $a:expr, $b:expr, $add:ident) => {{
            let (a, b) = ($a, $b);
            let c = |i: i32| $init(std::hint::black_box(i));
            let (mut c0, mut c1, mut c2, mut c3, mut c4) = (c(0), c(1), c(2), c(3), c(4));
            let (mut c5, mut c6, mut c7, mut c8, mut c9) = (c(5), c(6), c(7), c(8), c(9));
            for _ in 0..$iters {
                c0 = $op(c0, a, b);
                c1 = $op(c1, a, b);
                c2 = $op(c2, a, b);
                c3 = $op(c3, a, b);
                c4 = $op(c4, a, b);
                c5 = $op(c5, a, b);
                c6 = $op(c6, a, b);
                c7 = $op(c7, a, b);
                c8 = $op(c8, a, b);
                c9 = $op(c9, a, b);
            }
            let s = $add($add($add(c0, c1), $add(c2, c3)), $add(c4, c5));
            $add($add(s, $add(c6, c7)), $add(c8, c9))
        }};
    }

    #[target_feature(enable = "avx512f,avx512vnni")]
    pub(super) fn dpbusd_zmm(iters: u64) -> i32 {
        let a = _mm512_set1_epi8(std::hint::black_box(3));
        let b = _mm512_set1_epi8(std::hint::black_box(5));
        let s = ten_chains!(iters, _mm512_set1_epi32, _mm512_dpbusd_epi32, a, b, _mm512_add_epi32);
        _mm512_reduce_add_epi32(s)
    }

    /// `vpmaddubsw` has no accumulator: each chain feeds its result back as the unsigned
    /// operand (the bytes of i16 sums), which keeps ten dependent chains as the other loops
    /// do.
    #[target_feature(enable = "avx2")]
    pub(super) fn maddubs_ymm(iters: u64) -> i32 {
        let b = _mm256_set1_epi8(std::hint::black_box(5));
        let maddubs = |c: __m256i, _a: (), b: __m256i| _mm256_maddubs_epi16(c, b);
        let s = ten_chains!(iters, _mm256_set1_epi32, maddubs, (), b, _mm256_add_epi32);
        let mut lanes = [0i32; 8];
        // SAFETY: `lanes` holds exactly one 256-bit vector.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), s) };
        lanes.iter().fold(0i32, |acc, &x| acc.wrapping_add(x))
    }

    #[target_feature(enable = "avx2,avxvnni")]
    pub(super) fn dpbusd_ymm(iters: u64) -> i32 {
        let a = _mm256_set1_epi8(std::hint::black_box(3));
        let b = _mm256_set1_epi8(std::hint::black_box(5));
        let s = ten_chains!(iters, _mm256_set1_epi32, _mm256_dpbusd_avx_epi32, a, b, _mm256_add_epi32);
        let mut lanes = [0i32; 8];
        // SAFETY: `lanes` holds exactly one 256-bit vector.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), s) };
        lanes.iter().fold(0i32, |acc, &x| acc.wrapping_add(x))
    }
}

/// The CPU as the profile reports it.
#[derive(Debug, Clone, Serialize)]
pub struct CpuInfo {
    /// `model name` of /proc/cpuinfo (`None` where there is none).
    pub model: Option<String>,
    /// Whether the CPU has AVX-512 VNNI (`None`: unknown).
    pub avx512_vnni: Option<bool>,
    /// Whether it has AMX int8 tiles as /proc/cpuinfo lists them (`None`: unknown).
    pub amx_int8: Option<bool>,
}

impl CpuInfo {
    /// From /proc/cpuinfo; elsewhere (or where it cannot be read) the model is unknown and
    /// AVX-512 VNNI comes from the running CPU's feature detection.
    pub fn read() -> Self {
        match std::fs::read_to_string("/proc/cpuinfo") {
            Ok(text) => Self::parse(&text),
            Err(_) => Self { model: None, avx512_vnni: detected_avx512_vnni(), amx_int8: None },
        }
    }

    /// From the text of /proc/cpuinfo (its first processor).
    pub fn parse(text: &str) -> Self {
        let field = |name: &str| crate::cpu_identity::cpuinfo_field(text, name);
        let model = field("model name").filter(|m| !m.is_empty());
        let flags = field("flags");
        let has = |flag: &str| flags.as_ref().map(|f| f.split_whitespace().any(|x| x == flag));
        Self { model, avx512_vnni: has("avx512_vnni").or_else(detected_avx512_vnni), amx_int8: has("amx_int8") }
    }

    /// One line: the model and the two extensions.
    pub fn describe(&self) -> String {
        let yes_no = |b: Option<bool>| match b {
            Some(true) => "yes",
            Some(false) => "no",
            None => "unknown",
        };
        format!(
            "CPU: {}; avx512_vnni: {}; amx_int8: {}",
            self.model.as_deref().unwrap_or("unknown model"),
            yes_no(self.avx512_vnni),
            yes_no(self.amx_int8)
        )
    }
}

fn detected_avx512_vnni() -> Option<bool> {
    #[cfg(target_arch = "x86_64")]
    {
        Some(is_x86_feature_detected!("avx512vnni"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every x86-64 CPU with AVX2 gets a peak, from the best instruction it has.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn measures_the_best_int8_instruction_there_is() {
        let Some(peak) = measure(0.02) else {
            assert!(!is_x86_feature_detected!("avx2"), "an AVX2 CPU gets a peak");
            return;
        };
        let want = if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512f") {
            "vpdpbusd zmm"
        } else if is_x86_feature_detected!("avxvnni") {
            "vpdpbusd ymm"
        } else {
            "vpmaddubsw ymm"
        };
        assert_eq!(peak.instruction, want);
        assert!(peak.one_thread_gops > 1.0 && peak.all_threads_gops > 1.0, "{peak:?}");
    }

    #[test]
    fn parses_cpuinfo() {
        let text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Some CPU @ 2.0GHz\n\
                    flags\t\t: fpu sse avx512f avx512_vnni amx_tile amx_int8\n\nprocessor\t: 1\n\
                    model name\t: Other\n";
        let c = CpuInfo::parse(text);
        assert_eq!(c.model.as_deref(), Some("Some CPU @ 2.0GHz"));
        assert_eq!(c.avx512_vnni, Some(true));
        assert_eq!(c.amx_int8, Some(true));
        let c = CpuInfo::parse("model name\t: X\nflags\t: fpu avx512_vnnix\n");
        assert_eq!((c.avx512_vnni, c.amx_int8), (Some(false), Some(false)));
        assert!(c.describe().contains("amx_int8: no"), "{}", c.describe());
        let c = CpuInfo::parse("");
        assert_eq!((c.model, c.amx_int8), (None, None));
    }
}
